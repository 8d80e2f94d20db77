"""MCP tools: the tools of MCP servers (a command we start over stdio, or a streamable-HTTP url) as agent-loop Tools.

    rollout.multi_turn.mcp_servers=[{command: python, args: [examples/agents/mcp_calculator.py]}]
    rollout.multi_turn.mcp_servers=[{url: "http://127.0.0.1:8931/mcp"}]

Each server is one `mcp.Client` (the official `mcp` package) kept open on its own event-loop thread for the life
of the agent loop. At start its tools are listed (every page), filtered by `tools`, renamed by `prefix`, and their
input schemas checked like a tool file's (workers/rollout/tool_schemas.py). A tool is then an ordinary `Tool`
whose function sends `tools/call` from the calling thread (ToolCallRun's), so calls run concurrently, with the
same deadline (`tool_timeout_s`) and the same error observations as file tools: a result flagged `isError` is an
"exception" error, a server that died or cannot answer a "server" error naming it, with the tail of its stderr.

Processes: a stdio server runs in its own session (the SDK's choice); we start it through a one-line launcher
that asks Linux to send it SIGTERM when the thread that started it dies (PR_SET_PDEATHSIG), so a rollout worker
killed by Ray (SIGKILL: no atexit) leaves no server behind. `close()` stops it the SDK's way (stdin closed, then
SIGTERM, SIGKILL). `command: python` is the interpreter rlframe runs in.

Environment: a stdio server gets the MCP SDK's default environment (`get_default_environment()`: HOME, LOGNAME,
PATH, SHELL, TERM, USER on POSIX) plus the entry's `env` -- not this process's whole environment, whose HF, W&B and
cloud keys would otherwise reach third-party `npx`/`uvx` servers; `inherit_env: true` opts into full inheritance.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import json
import logging
import os
import shutil
import sys
import tempfile
import threading
from pathlib import Path
from urllib.parse import urlparse

from rlframe.workers.rollout.tool_schemas import ToolLoadError, check_schema
from rlframe.workers.rollout.tools import Tool, ToolResult, resolve_tool_path

# argv: [parent pid, command, *args]: die with the starting thread, unless the parent is already gone; then exec
_LAUNCHER = ("import ctypes, os, signal, sys\n"
             "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)\n"  # PR_SET_PDEATHSIG
             "os.getppid() == int(sys.argv[1]) or sys.exit(1)\n"
             "os.execvp(sys.argv[2], sys.argv[2:])\n")
STDERR_TAIL = 800  # characters of a server's stderr quoted in an error
logger = logging.getLogger(__name__)


def server_label(spec) -> str:
    """What errors call a server: its `name`, else its url's host:port, else its script's (or command's) name."""
    if spec.name:
        return spec.name
    if spec.url:
        return urlparse(spec.url).netloc or spec.url
    scripts = [Path(a).stem for a in spec.args if a.endswith(".py")]
    return scripts[0] if scripts else Path(spec.command).name


def mcp_server_settings(server):
    """McpServerSettings of one `rollout.multi_turn.mcp_servers` entry, resolved in the driver: `python` /
    `python3` is this interpreter; a relative path that names a file (in the working directory, else in the
    checkout / installed package, as tool paths) becomes absolute."""
    from rlframe.workers.settings import McpServerSettings

    def resolved(arg: str) -> str:
        if not arg or Path(arg).is_absolute() or arg.startswith("-"):
            return arg
        path = resolve_tool_path(arg)
        return str(path) if path.is_file() else arg

    command = sys.executable if server.command in ("python", "python3") else resolved(server.command)
    return McpServerSettings(name=server.name, command=command, args=tuple(resolved(a) for a in server.args),
                             env=tuple(sorted((str(k), str(v)) for k, v in (server.env or {}).items())),
                             url=server.url, tools=tuple(server.tools), prefix=server.prefix,
                             startup_timeout_s=float(server.startup_timeout_s),
                             inherit_env=bool(getattr(server, "inherit_env", False)))


def server_environment(spec) -> dict[str, str]:
    """A stdio server's environment: the MCP SDK's safe default (+ `env`), or with `inherit_env` ours (+ `env`)."""
    from mcp.client.stdio import get_default_environment

    base = dict(os.environ) if getattr(spec, "inherit_env", False) else get_default_environment()
    return {**base, **dict(spec.env)}


def describe(exc: BaseException) -> str:
    """`Type: message` of an exception, of the first leaf of an exception group (anyio's task groups wrap them)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}"


def result_text(result) -> str:
    """A CallToolResult as observation text: its text blocks joined, others named; else its structured content."""
    parts = []
    for block in result.content or []:
        text = getattr(block, "text", None)
        if text is None and getattr(block, "resource", None) is not None:
            text = getattr(block.resource, "text", None)
        parts.append(text if text is not None else f"[{getattr(block, 'type', 'content')}: "
                                                   f"{getattr(block, 'mime_type', '') or 'not text'}]")
    if not parts and getattr(result, "structured_content", None) is not None:
        return json.dumps(result.structured_content)
    return "\n".join(parts)


class McpServer:
    """One MCP server connection, open on a background event loop; `call` may be used from any thread."""

    def __init__(self, spec):
        self.spec, self.label = spec, server_label(spec)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.client = None
        self.failure: BaseException | None = None
        self.ready, self.closed = threading.Event(), threading.Event()
        self.stderr = None if spec.url else tempfile.TemporaryFile(mode="w+", encoding="utf-8", errors="replace")
        self.thread: threading.Thread | None = None
        self.warned = False

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> list:
        """Connect (start the process), list every tool (mcp_types.Tool); raise ToolLoadError naming the server."""
        if not self.spec.url and shutil.which(self.spec.command) is None:
            raise ToolLoadError(f"MCP server '{self.label}': the command '{self.spec.command}' is not found (not on "
                                "PATH, nor an executable file). Fix: install it, or give its full path")
        self.thread = threading.Thread(target=self._run_loop, daemon=True, name=f"mcp-{self.label}")
        self.thread.start()
        atexit.register(self.close)
        timeout = self.spec.startup_timeout_s
        if not self.ready.wait(timeout) or self.client is None:
            why = describe(self.failure) if self.failure is not None else f"no answer within {timeout:g} s (startup_timeout_s)"
            message = f"MCP server '{self.label}' ({self.where()}) did not start: {why}{self.stderr_tail()}"
            self.close()
            raise ToolLoadError(message)
        try:
            return self.submit(self._list_tools(), timeout)
        except Exception as exc:
            message = (f"MCP server '{self.label}' ({self.where()}): listing its tools failed ({describe(exc)})"
                       f"{self.stderr_tail()}")
            self.close()
            raise ToolLoadError(message) from None

    def _run_loop(self) -> None:
        self.loop = asyncio.new_event_loop()
        try:
            self.loop.run_until_complete(self._serve())
        finally:
            self.loop.close()

    async def _serve(self) -> None:
        """The client's whole life in one task (anyio's scopes must open and close in the same task)."""
        from mcp import Client

        self._stop = asyncio.Event()
        try:
            async with Client(self._transport()) as client:
                self.client = client
                self.ready.set()
                await self._stop.wait()
        except BaseException as exc:  # a server that cannot start, or died: named by whoever calls next
            self.failure = exc
        finally:
            self.client = None
            self.ready.set()
            self.closed.set()

    def _transport(self):
        if self.spec.url:
            from mcp.client.streamable_http import streamable_http_client

            return streamable_http_client(self.spec.url)
        from mcp.client.stdio import StdioServerParameters, stdio_client

        command, args = self.spec.command, list(self.spec.args)
        if sys.platform.startswith("linux"):
            command, args = sys.executable, ["-S", "-c", _LAUNCHER, str(os.getpid()), command, *args]
        params = StdioServerParameters(command=command, args=args, env=server_environment(self.spec))
        return stdio_client(params, errlog=self.stderr)

    async def _list_tools(self) -> list:
        tools, cursor = [], None
        while True:
            page = await self.client.list_tools(cursor=cursor)
            tools += list(page.tools)
            cursor = page.next_cursor
            if cursor is None:
                return tools

    def close(self) -> None:
        """Stop the connection (and the process we started); idempotent."""
        loop = self.loop
        if loop is not None and not self.closed.is_set() and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._stop.set)
            except RuntimeError:  # the loop closed meanwhile
                pass
            self.closed.wait(15)
        if self.thread is not None:
            self.thread.join(5)
        if self.stderr is not None and not self.stderr.closed:
            self.stderr.close()

    # ------------------------------------------------------------------ calls
    def submit(self, coroutine, timeout: float):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def call(self, name: str, arguments: dict, timeout_s: float, shown: str | None = None) -> ToolResult:
        """One `tools/call` of the server's tool `name` (`shown`: the name the model knows it by, in messages);
        every failure is an observation (ToolResult.error set), never an exception. The observation stays short
        (the model reads it); the server's stderr goes to the log, once per server."""
        shown = shown or name
        client = self.client
        if client is None:
            why = f" ({describe(self.failure)})" if self.failure is not None else ""
            self.warn(f"is not running{why}")
            return ToolResult(f"Error: the MCP server '{self.label}' is not running{why}", error="server")
        future = asyncio.run_coroutine_threadsafe(client.call_tool(name, arguments), self.loop)
        try:
            result = future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()  # the SDK tells the server the request is cancelled
            return ToolResult(f"Error: the tool '{shown}' timed out after {timeout_s:g} s", error="timeout")
        except Exception as exc:  # the connection broke, the server died, a protocol error
            self.warn(f"failed on '{name}' ({describe(exc)})")
            return ToolResult(f"Error: the MCP server '{self.label}' failed on '{shown}' ({describe(exc)})",
                              error="server")
        text = result_text(result)
        return ToolResult(f"Error: {text}", error="exception") if result.is_error else ToolResult(text)

    def warn(self, what: str) -> None:
        if not self.warned:
            self.warned = True
            logger.warning("MCP server '%s' (%s) %s; its tools' calls are error observations%s", self.label,
                           self.where(), what, self.stderr_tail())

    # ------------------------------------------------------------------ naming
    def where(self) -> str:
        return self.spec.url or " ".join([Path(self.spec.command).name, *self.spec.args])

    def stderr_tail(self) -> str:
        if self.stderr is None or self.stderr.closed:
            return ""
        try:
            self.stderr.flush()
            self.stderr.seek(0)
            text = self.stderr.read().strip()
        except (OSError, ValueError):
            return ""
        return f"\nits stderr ends with:\n{text[-STDERR_TAIL:]}" if text else ""


class McpToolFunction:
    """The function of an MCP tool: keyword arguments in, a ToolResult out (ToolCallRun runs it in a thread)."""

    def __init__(self, server: McpServer, name: str, shown: str, timeout_s: float):
        self.server, self.name, self.shown, self.timeout_s = server, name, shown, timeout_s

    def __call__(self, **arguments) -> ToolResult:
        return self.server.call(self.name, arguments, self.timeout_s, self.shown)


def server_tools(server: McpServer, listed: list, timeout_s: float) -> dict[str, Tool]:
    """The listed tools the spec chose (all when `tools` is empty), as Tools named prefix + name, schemas checked."""
    spec, names = server.spec, [t.name for t in listed]
    missing = [n for n in spec.tools if n not in names]
    if missing:
        raise ToolLoadError(f"MCP server '{server.label}' has no tool {', '.join(map(repr, missing))} (it lists: "
                            f"{', '.join(names) or 'none'}). Fix: its `tools` list")
    tools = {}
    for listed_tool in listed:
        if spec.tools and listed_tool.name not in spec.tools:
            continue
        name = spec.prefix + listed_tool.name
        schema = {"type": "function", "function": {"name": name, "description": listed_tool.description or "",
                                                   "parameters": listed_tool.input_schema}}
        check_schema(schema, f"MCP server '{server.label}', tool '{listed_tool.name}'")
        tools[name] = Tool(name=name, function=McpToolFunction(server, listed_tool.name, name, timeout_s), schema=schema,
                           path=f"mcp:{server.label}")
    return tools


def start_mcp_tools(specs, taken: dict[str, str], timeout_s: float) -> tuple[list[McpServer], dict[str, Tool]]:
    """Start every server and gather its tools; `taken`: tool name -> where it is already defined (a clash is an
    error naming both). On any error the servers started so far are closed again."""
    servers, tools = [], {}
    try:
        for i, spec in enumerate(specs):
            server = McpServer(spec)
            servers.append(server)
            for name, tool in server_tools(server, server.start(), timeout_s).items():
                owner = taken.get(name) or (tools[name].path if name in tools else None)
                if owner is not None:
                    raise ToolLoadError(f"MCP server '{server.label}' lists a tool '{name}', which {owner} already "
                                        "defines. Fix: `tools: [...]` to choose its tools, or `prefix: ...` to rename them")
                tools[name] = tool
    except BaseException:
        for server in servers:
            server.close()
        raise
    return servers, tools
