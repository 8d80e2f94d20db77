"""Tools for multi-turn rollouts: loading user tool files, parsing tool calls, running calls with a deadline.

A tool file is an ordinary Python script (see `tools/` at the top of the repository), written the way a
reward script is; a typed function with a docstring is enough:

    def calculator(expression: str) -> str:
        '''Evaluate an arithmetic expression.

        Args:
            expression: the expression, e.g. 12 * (3 + 4)
        '''

The config names the file and the function (`rollout.multi_turn.tools=[{path: tools/calculator.py,
name: calculator}]`); the schema (the OpenAI function-calling form) is the file's own when it has one
(TOOL_SCHEMAS, SCHEMA, TOOLS, or a `schema` attribute on the function), else derived from the type hints
and the docstring (workers/rollout/tool_schemas.py). The function gets the call's arguments as keyword
arguments and returns the observation text (or a ToolResult). Tools of MCP servers join the same way
(workers/rollout/mcp_tools.py).

Parsers turn a model turn's text into tool calls (pluggable: `TOOL_CALL_PARSERS`):
  hermes  `<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>` (Qwen, SmolLM2)
  tag     `<calculator>2+3</calculator>`: the text inside goes to the tool's first required parameter
          (an easier format for very small models; a tool requiring more than one is refused: format_problem).
  or a user's `path/to/parser.py:function(text, tools) -> list[ToolCall]`.

Nothing a tool does crashes a rollout: a malformed call, an unknown tool, bad arguments, an exception
and a timeout each become an error observation the model sees (`ToolResult.error` set, counted).
Each call (and an environment's reset and step: Deferred) runs in a daemon thread with a wall-clock deadline; code that must be isolated (a code
interpreter) runs inside `rlframe/reward/sandbox.py` from the tool itself (see tools/python_interpreter.py).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from rlframe.workers.rollout.tool_schemas import ToolLoadError, check_schema, find_schema  # noqa: F401 (re-exported)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict | None  # None: the call could not be parsed (then `error` says why)
    error: str | None = None


@dataclass
class ToolResult:
    text: str
    error: str | None = None  # "parse" | "unknown_tool" | "arguments" | "exception" | "timeout" | "server"


@dataclass
class Tool:
    name: str
    function: Callable[..., object]
    schema: dict = field(default_factory=dict)
    path: str = ""

    @property
    def parameters(self) -> dict:
        return self.schema.get("function", {}).get("parameters", {})

    def first_required(self) -> str | None:
        required = self.parameters.get("required") or list(self.parameters.get("properties", {}))
        return required[0] if required else None


def resolve_tool_path(path: str) -> Path:
    """A tool path as given (relative to the working directory), else inside the installed package
    (`rlframe/tools/...` in the wheel, `tools/...` in a checkout)."""
    candidate = Path(path)
    if candidate.is_file():
        return candidate.resolve()
    package_root = Path(__file__).resolve().parents[2]  # the checkout root, or site-packages/rlframe's parent
    for base in (package_root, package_root / "rlframe", Path(__file__).resolve().parents[1].parent):
        if (base / path).is_file():
            return (base / path).resolve()
    return candidate


def _import_tool_file(path: Path, what: str = "tool"):
    """`what` names what is being loaded (e.g. "tool 'calculator'") for the error messages."""
    if not path.is_file():
        raise ToolLoadError(f"{what}: file not found: {path}. Point its path at an existing Python file, "
                            "e.g. tools/calculator.py")
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:10]
    module_name = f"rlframe_tool_{path.stem}_{digest}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ToolLoadError(f"{what}: cannot import {path}: not a Python source file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException as exc:
        sys.modules.pop(module_name, None)
        if isinstance(exc, KeyboardInterrupt):
            raise
        raise ToolLoadError(f"{what}: importing {path} failed ({type(exc).__name__}: {exc}). Fix the file; "
                            f"its traceback:\n{traceback.format_exc(limit=-3)}") from exc
    return module


def load_tool(path: str, name: str) -> Tool:
    """Import `path` and return its function `name` with its schema (the file's, else derived: tool_schemas.py)."""
    resolved = resolve_tool_path(path)
    module = _import_tool_file(resolved, f"tool '{name}'")
    function = getattr(module, name, None)
    if not callable(function):
        defined = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_")
                         and getattr(v, "__module__", None) == module.__name__)
        raise ToolLoadError(f"tool file {resolved} has no function '{name}' (it defines: {', '.join(defined) or 'none'})")
    schema, _ = find_schema(module, function, name, str(resolved))
    return Tool(name=name, function=function, schema=schema, path=str(resolved))


# ---------------------------------------------------------------------------- parsers

_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_hermes(text: str, tools: dict[str, Tool]) -> list[ToolCall]:
    """Every `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; an unclosed `<tool_call>` is a
    malformed call."""
    calls = []
    for body in _HERMES.findall(text):
        try:
            payload = json.loads(body.strip())
        except json.JSONDecodeError as exc:
            calls.append(ToolCall(name="", arguments=None, error=f"the tool call is not valid JSON ({exc.msg})"))
            continue
        if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
            calls.append(ToolCall(name="", arguments=None, error='a tool call needs {"name": ..., "arguments": {...}}'))
            continue
        arguments = payload.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        if not isinstance(arguments, dict):
            calls.append(ToolCall(name=payload["name"], arguments=None, error="'arguments' must be a JSON object"))
            continue
        calls.append(ToolCall(name=payload["name"], arguments=arguments))
    if not calls and "<tool_call>" in text:
        calls.append(ToolCall(name="", arguments=None, error="<tool_call> without a closing </tool_call>"))
    return calls


def parse_tag(text: str, tools: dict[str, Tool]) -> list[ToolCall]:
    """Every `<NAME>text</NAME>` for a configured tool NAME; the text is its first required parameter."""
    calls = []
    for name, tool in tools.items():
        for body in re.findall(rf"<{re.escape(name)}>(.*?)</{re.escape(name)}>", text, re.DOTALL):
            key = tool.first_required()
            calls.append(ToolCall(name=name, arguments={key: body.strip()} if key else {}))
        if not calls and f"<{name}>" in text:
            calls.append(ToolCall(name=name, arguments=None, error=f"<{name}> without a closing </{name}>"))
    return calls


def format_problem(tool: Tool, fmt: str) -> str | None:
    """Why `tool` cannot be called in the tool-call format `fmt`, or None: `tag` hands the text between
    <name> and </name> to ONE parameter, so a tool that requires more would fail every call."""
    if fmt != "tag":
        return None
    required = list(tool.parameters.get("required") or [])
    if len(required) <= 1:
        return None
    return (f"tool '{tool.name}' ({tool.path}) requires {len(required)} arguments ({', '.join(required)}), but the "
            f"'tag' format passes the text between <{tool.name}> and </{tool.name}> as one argument, so every call "
            "would fail. Fix: rollout.multi_turn.format=hermes (JSON arguments), or give the tool one required parameter")


TOOL_CALL_PARSERS: dict[str, Callable[[str, dict[str, Tool]], list[ToolCall]]] = {"hermes": parse_hermes,
                                                                                 "tag": parse_tag}


def get_parser(fmt: str) -> Callable[[str, dict[str, Tool]], list[ToolCall]]:
    """A built-in parser by name, or a user's `path/to/file.py:function` (text, tools) -> list[ToolCall]."""
    if fmt in TOOL_CALL_PARSERS:
        return TOOL_CALL_PARSERS[fmt]
    path, _, name = fmt.rpartition(":")
    if not path or not name:
        raise ToolLoadError(f"'{fmt}' is neither a built-in tool-call format ({', '.join(TOOL_CALL_PARSERS)}) "
                            "nor path/to/parser.py:function")
    module = _import_tool_file(resolve_tool_path(path), f"tool-call parser '{name}'")
    parser = getattr(module, name, None)
    if not callable(parser):
        raise ToolLoadError(f"tool-call parser file {path} has no function '{name}'")
    return parser


def tool_prompt(tools: dict[str, Tool], fmt: str) -> str:
    """The system message that tells the model which tools it has and how to call them."""
    if fmt != "hermes":
        lines = [f"- {t.name}: {t.schema['function'].get('description', '')} Call it by writing "
                 f"<{t.name}>{t.first_required() or 'input'}</{t.name}>." for t in tools.values()]
        return ("You can use tools. The result of a call comes back in a tool message; then give the answer.\n"
                + "\n".join(lines))
    schemas = "\n".join(json.dumps(t.schema) for t in tools.values())
    return ("You can call functions. Their signatures:\n<tools>\n" + schemas + "\n</tools>\n"
            'To call one, write <tool_call>{"name": <function-name>, "arguments": <args-json-object>}</tool_call>; '
            "the result comes back in a tool message. Then give the answer.")


# ---------------------------------------------------------------------------- running calls


def _check_arguments(tool: Tool, arguments: dict) -> str | None:
    try:
        import jsonschema

        jsonschema.validate(arguments, tool.parameters)
    except ImportError:
        missing = [k for k in tool.parameters.get("required", []) if k not in arguments]
        return f"missing arguments: {missing}" if missing else None
    except Exception as exc:  # jsonschema.ValidationError
        return getattr(exc, "message", str(exc))
    return None


class ToolCallRun:
    """One call running in a daemon thread: `done()` polls, `result()` waits until the deadline.

    A tool that hangs is abandoned at its deadline (the thread is a daemon and cannot block exit); the
    model sees a timeout error. Code that must really be killed belongs in the sandbox."""

    def __init__(self, tool: Tool | None, call: ToolCall, timeout_s: float, known: list[str]):
        import time

        self.call, self.timeout_s, self._outcome = call, timeout_s, None
        self._deadline = time.monotonic() + timeout_s
        self._event = threading.Event()
        if call.arguments is None:
            self._finish(ToolResult(f"Error: {call.error}", error="parse"))
        elif tool is None:
            self._finish(ToolResult(f"Error: unknown tool '{call.name}'. Available: {', '.join(known)}",
                                    error="unknown_tool"))
        elif (problem := _check_arguments(tool, call.arguments)) is not None:
            self._finish(ToolResult(f"Error: bad arguments for {call.name}: {problem}", error="arguments"))
        else:
            threading.Thread(target=self._run, args=(tool,), daemon=True, name=f"tool-{tool.name}").start()

    def _finish(self, result: ToolResult) -> None:
        if self._outcome is None:
            self._outcome = result
        self._event.set()

    def _run(self, tool: Tool) -> None:
        try:
            value = tool.function(**self.call.arguments)  # an MCP tool returns a ToolResult (its error named)
            self._finish(value if isinstance(value, ToolResult) else ToolResult(str(value)))
        except BaseException as exc:  # the tool's fault, not the rollout's
            self._finish(ToolResult(f"Error: {type(exc).__name__}: {exc}", error="exception"))

    def done(self) -> bool:
        import time

        return self._event.is_set() or time.monotonic() >= self._deadline

    def result(self) -> ToolResult:
        import time

        if not self._event.wait(max(0.0, self._deadline - time.monotonic())):
            return ToolResult(f"Error: the tool '{self.call.name}' timed out after {self.timeout_s:g} s", error="timeout")
        return self._outcome

# ---------------------------------------------------------------------------- environments


def load_environment(path: str, name: str):
    """A factory of environments with `reset(row) -> first message | None` and `step(model_text) ->
    (observation | None, reward, done)`: the class `name` of the file `path` itself, or, for a gymnasium.Env
    (reset(seed=, options=) / step -> 5-tuple), an adapter to that form (workers/rollout/gym_environment.py)."""
    resolved = resolve_tool_path(path)
    module = _import_tool_file(resolved, f"environment '{name}'")
    cls = getattr(module, name, None)
    if not isinstance(cls, type):
        raise ToolLoadError(f"environment file {resolved} has no class '{name}'")
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if missing:
        raise ToolLoadError(f"environment {resolved}:{name} lacks the method(s) {', '.join(missing)}: "
                            "reset(row) and step(model_text) -> (observation, reward, done), or a gymnasium.Env")
    from rlframe.workers.rollout.gym_environment import GymEnvironment, is_gym_environment

    return GymEnvironment.factory(cls) if is_gym_environment(cls) else cls


class Deferred:
    """`function(*args)` running in a daemon thread (an environment's __init__/reset/step/close): `done()` polls,
    `outcome()` -> (result, error) waits until the deadline; error is "timeout" or "Type: message"."""

    def __init__(self, function, timeout_s: float, *args):
        self.deadline, self.box, self.event = time.monotonic() + timeout_s, {}, threading.Event()
        self.position = None

        def target():
            try:
                self.box["result"] = function(*args)
            except BaseException as exc:  # the environment's fault, counted, not the rollout's
                self.box["error"] = f"{type(exc).__name__}: {exc}"
            self.event.set()

        threading.Thread(target=target, daemon=True, name="environment").start()

    def done(self) -> bool:
        return self.event.is_set() or time.monotonic() >= self.deadline

    def outcome(self):
        if not self.event.wait(max(0.0, self.deadline - time.monotonic())):
            return None, "timeout"
        return self.box.get("result"), self.box.get("error")
