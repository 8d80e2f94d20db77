"""Load a user's reward function from a Python file.

A reward file is an ordinary script (see ``reward_fns/``). Three calling conventions are supported:

* per sample (verl, kind ``"sample"``), called by keyword as verl does::

      def compute_score(data_source, solution_str, ground_truth, extra_info=None, **reward_kwargs) -> float | dict

  returning a float, or a dict with a ``score`` key plus any extra keys to log (a function whose
  parameters have other names is called positionally in that order);

* batched (EasyR1, ``REWARD_TYPE = "batch"``)::

      def compute_score(reward_inputs: list[dict], **reward_kwargs) -> list[dict]

  each input has ``response``, ``response_length``, ``ground_truth``, ``data_source`` and
  ``extra_info``; each output has an ``overall`` (or ``score``) key plus any extra keys to log;

* sequential (EasyR1, ``REWARD_TYPE = "sequential"``): ``compute_score(reward_input: dict) -> dict``,
  one such input per call.

The kind: the config's ``reward_type`` when set, else the file's ``REWARD_TYPE``, else the
signature: a function with ONE required parameter is EasyR1's (batch, EasyR1's own default when
REWARD_TYPE is absent); one with more (``data_source, solution_str, ...``) is verl's per-sample form.
``async def`` functions are awaited. ``reward_kwargs`` (``reward.functions[i].kwargs``) are passed
as keyword arguments on every call.

Loading binds that call to the function's signature without running it (``signature_problem``): a
function that fits none of the forms (``compute_score(solution_str, ground_truth)``) or does not take the
configured ``kwargs`` is a ``RewardLoadError`` before any worker starts, not a failure on every sample.

``path:name`` (EasyR1's ``reward_function=./math.py:compute_score``) names the function in the path.

The file's own directory is appended to ``sys.path``, so a reward file can import its sibling
helper modules (``from my_helpers import ...``) as when it is run as a script.

``RewardFunction`` is picklable: it carries only the path, the function name and the kind, and
imports the file again, lazily, in whichever process first calls it (the reward worker processes).

Before the driver imports a reward file itself, ``import_problem`` imports it once in a short-lived child
process with a deadline (``reward.import_timeout_s``): a file whose import ends its process (``os._exit``,
a signal) or never finishes (``input()``, a network wait, an endless loop) is reported as an error naming
the file, instead of ending or hanging the driver. ``check_reward_imports(cfg)`` does it for every
``reward.functions[i]``; ``validate_reward_specs`` (manager.py, hence ``validate_config``) calls it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import os
import signal
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

SAMPLE = "sample"
BATCH = "batch"
SEQUENTIAL = "sequential"
KINDS = (SAMPLE, BATCH, SEQUENTIAL)
SAMPLE_ARGS = ("data_source", "solution_str", "ground_truth", "extra_info")


def split_path_name(path: str, name: str | None = None) -> tuple[str, str | None]:
    """EasyR1's ``file.py:function`` -> (file.py, function); a plain path keeps ``name``."""
    head, sep, tail = str(path).rpartition(":")
    if sep and head.endswith(".py") and tail.isidentifier():
        return head, tail
    return str(path), name


class RewardLoadError(ValueError):
    """A reward file or function cannot be loaded; the message says what to fix."""


# One module object per (resolved) file per process, so several RewardFunctions share it.
_MODULE_CACHE: dict[str, ModuleType] = {}


def _import_file(path: Path) -> ModuleType:
    key = str(path)
    if key in _MODULE_CACHE:
        return _MODULE_CACHE[key]
    if not path.is_file():
        raise RewardLoadError(
            f"reward file not found: {path}. Point the config key `reward.functions[i].path` at an existing "
            f"Python file, e.g. reward.functions=[{{path: reward_fns/math.py}}]")
    # A private module name: a file called math.py must not shadow the standard library.
    digest = hashlib.sha1(key.encode()).hexdigest()[:10]
    module_name = f"rlframe_reward_{path.stem}_{digest}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise RewardLoadError(f"cannot import reward file {path}: not a Python source file")
    module = importlib.util.module_from_spec(spec)
    # Sibling imports: the file's directory becomes importable. It goes to the END of sys.path:
    # in front it would let reward_fns/math.py shadow the standard library's math module in this
    # process and in every process it spawns (the price: a helper named like an installed module
    # loses to it -- name your helpers distinctly).
    directory = str(path.parent)
    if directory not in sys.path:
        sys.path.append(directory)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException as exc:
        sys.modules.pop(module_name, None)
        if isinstance(exc, KeyboardInterrupt):
            raise
        raise RewardLoadError(
            f"importing reward file {path} failed:\n{traceback.format_exc()}") from exc
    _MODULE_CACHE[key] = module
    return module


IMPORT_TIMEOUT_S = 60.0  # reward.import_timeout_s: a reward file's import in the child must finish by then
_IMPORTED_OK = "imported"
_IMPORT_RAISED = "raised"
# The child: import the file as _import_file does (its folder appended to sys.path), then report on fd 3,
# which only this code writes to (the file may print whatever it likes on stdout / stderr).
# It dies with the process that started it (PR_SET_PDEATHSIG, where Linux offers it): in a session of its own, a
# check whose driver was killed went on until its import ended, if ever.
_IMPORT_CHILD = r"""
import importlib.util, os, signal, sys
report, path, parent = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
try:
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)
except (OSError, AttributeError):
    pass
if os.getppid() != parent:  # the driver died before the line above
    os._exit(1)
sys.path.append(os.path.dirname(path))
spec = importlib.util.spec_from_file_location("rlframe_reward_import_check", path)
module = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = module
try:
    spec.loader.exec_module(module)
    outcome = b"%s"
except BaseException:
    outcome = b"%s"
os.write(report, outcome)
os._exit(0)
""" % (_IMPORTED_OK, _IMPORT_RAISED)
# (path, mtime_ns, size) of the files whose import already passed in this process
_IMPORTS_CHECKED: set[tuple[str, int, int]] = set()


def _output_tail(file, limit: int = 1500) -> str:
    file.seek(0, os.SEEK_END)
    size = file.tell()
    file.seek(max(0, size - limit))
    text = file.read().decode("utf-8", errors="replace").strip()
    return ("..." if size > limit else "") + text


def _kill_group(process: subprocess.Popen) -> None:
    """SIGKILL the child's process group: what its import started (a thread's process, a fork) goes too."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def import_problem(path: str | Path, timeout_s: float = IMPORT_TIMEOUT_S) -> str | None:
    """Import the reward file ``path`` in a short-lived child process (its own process group, killed
    afterwards); why that import ended its process or did not finish within ``timeout_s``, or None.

    An import that raises is None here: the driver's own import then reports it with its traceback.
    A file whose import passed once (same path, size and mtime) is not imported again in this process."""
    path = Path(path)
    try:
        stat = path.stat()
    except OSError:
        return None  # missing: reported by the ordinary import, with the key to fix
    key = (str(path), stat.st_mtime_ns, stat.st_size)
    if key in _IMPORTS_CHECKED:
        return None
    read_end, write_end = os.pipe()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    with tempfile.TemporaryFile() as output:
        try:
            # stdin: a pipe nobody writes to, so that an input() at import blocks here as it would in the driver
            process = subprocess.Popen([sys.executable, "-c", _IMPORT_CHILD, str(write_end), str(path), str(os.getpid())],
                                       stdin=subprocess.PIPE, stdout=output, stderr=output, env=env,
                                       pass_fds=(write_end,), start_new_session=True)
        except OSError as error:
            os.close(read_end)
            os.close(write_end)
            return f"could not start a process to import it ({error})"
        os.close(write_end)
        try:
            process.wait(timeout=timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
        _kill_group(process)
        process.stdin.close()
        os.set_blocking(read_end, False)  # (a process the import left behind may hold the write end)
        try:
            outcome = os.read(read_end, 64).decode(errors="replace")
        except BlockingIOError:
            outcome = ""
        finally:
            os.close(read_end)
        tail = _output_tail(output)
    said = f"; its output ends:\n{tail}" if tail else ""
    if timed_out:
        return (f"importing {path} did not finish within {timeout_s:g} s (reward.import_timeout_s): a blocking "
                f"call at import time (input(), a network or lock wait, an endless loop?){said}. Fix: do slow "
                f"work inside the function (or once, on its first call), or raise reward.import_timeout_s")
    if outcome in (_IMPORTED_OK, _IMPORT_RAISED):
        if outcome == _IMPORTED_OK:
            _IMPORTS_CHECKED.add(key)
        return None
    how = (f"killed by signal {-process.returncode}" if process.returncode < 0
           else f"exit code {process.returncode}")
    return (f"importing {path} ended the importing process ({how}) before the import finished: the file "
            f"calls os._exit / sys.exit-like code, or crashes, at import time{said}. Fix: a reward file may "
            f"only define things at import; run work inside the function")


def check_reward_imports(cfg, deadline_s: float | None = None) -> list[tuple[str, str]]:
    """(key, message) for every `reward.functions[i]` whose file's import, in a child process with the
    deadline (default: cfg.reward.import_timeout_s), ends its process or hangs; [] when all import."""
    deadline = deadline_s if deadline_s is not None else getattr(cfg.reward, "import_timeout_s", IMPORT_TIMEOUT_S)
    problems = []
    for i, fn in enumerate(cfg.reward.functions):
        path, _ = split_path_name(fn.path, fn.name)
        problem = import_problem(Path(path).expanduser().resolve(), deadline)
        if problem is not None:
            problems.append((f"reward.functions[{i}]", problem))
    return problems


def _defined_functions(module: ModuleType) -> list[str]:
    return sorted(name for name, obj in vars(module).items()
                  if inspect.isfunction(obj) and obj.__module__ == module.__name__
                  and not name.startswith("_"))


def _required_params(fn: Callable) -> list[str]:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.default is p.empty
            and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _reward_kind(module: ModuleType, path: Path, fn: Callable, configured: str | None) -> str:
    """configured (reward_type) > the file's REWARD_TYPE > the signature (see the module docstring)."""
    kind = configured or getattr(module, "REWARD_TYPE", None)
    if kind is None:
        return BATCH if len(_required_params(fn)) == 1 else SAMPLE
    if kind not in KINDS:
        raise RewardLoadError(
            f"{path}: the reward type must be {SAMPLE!r} (compute_score(data_source, solution_str, "
            f"ground_truth, extra_info=None)), {BATCH!r} (compute_score(reward_inputs)) or {SEQUENTIAL!r} "
            f"(compute_score(reward_input)), got {kind!r} (REWARD_TYPE in the file or reward.functions[i].reward_type)")
    return kind


def _keyword_call(fn: Callable) -> bool:
    """verl calls per-sample functions by keyword; a function with other parameter names positionally."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    has_var_kw = any(p.kind == p.VAR_KEYWORD for p in params.values())
    return has_var_kw or all(name in params for name in SAMPLE_ARGS[:3])


SAMPLE_FORM = "compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs)"
FORMS = {SAMPLE: f"verl's per-sample form {SAMPLE_FORM}",
         BATCH: "EasyR1's batch form compute_score(reward_inputs, **kwargs)",
         SEQUENTIAL: "EasyR1's sequential form compute_score(reward_input, **kwargs)"}


def signature_problem(fn: Callable, kind: str, by_keyword: bool, kwargs: dict) -> str | None:
    """Why `fn` cannot take the call its kind makes (with the configured `kwargs`), or None.

    The call is bound to the signature without running it: a two-argument `f(solution_str, ground_truth)`
    (neither verl's nor EasyR1's form) or a function without the configured keyword arguments would otherwise
    fail on every sample, at the first step. A callable whose signature Python cannot read is not checked."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    if kind == SAMPLE:
        call = ((), dict.fromkeys(SAMPLE_ARGS)) if by_keyword else ((None,) * len(SAMPLE_ARGS), {})
    else:
        call = (([] if kind == BATCH else {},), {})
    args, keywords = call
    try:
        signature.bind(*args, **keywords)
    except TypeError as error:
        others = " nor ".join(FORMS[k] for k in (SAMPLE, BATCH) if k != kind)
        return (f"its signature {fn.__name__}{signature} is not {FORMS[kind]}, the call it gets ({error}), nor "
                f"{others}. Fix: write it in one of these forms (when the signature does not say which, REWARD_TYPE "
                f"in the file or reward.functions[i].reward_type names it)")
    if kwargs:
        try:
            signature.bind(*args, **keywords, **kwargs)
        except TypeError as error:
            return (f"{fn.__name__}{signature} does not take the keyword arguments that reward.functions[i].kwargs "
                    f"passes on every call ({', '.join(map(repr, kwargs))}: {error}). Fix: add them (or **kwargs) "
                    f"to its parameters, or remove them from reward.functions[i].kwargs")
    return None


def _await(result: Any) -> Any:
    if inspect.isawaitable(result):
        import asyncio

        async def wait():
            return await result

        return asyncio.run(wait())
    return result


class RewardFunction:
    """A picklable handle to ``name`` in the reward file ``path``.

    ``kind`` is ``"sample"`` (verl per-sample form) or ``"batch"`` (EasyR1 batched form).
    Calling it calls the user's function with the arguments given.
    """

    def __init__(self, path: str | Path, name: str = "compute_score", kind: str | None = None,
                 kwargs: dict | None = None, reward_type: str | None = None):
        path, name = split_path_name(str(path), name)
        self.path = str(Path(path).expanduser().resolve())
        self.name = name or "compute_score"
        self.kwargs = dict(kwargs or {})
        self.reward_type = reward_type
        self._fn: Callable | None = None
        self._by_keyword = True
        self.kind = kind if kind is not None else self._load_kind()

    def _load_kind(self) -> str:
        self.load()
        return self.kind

    def load(self) -> Callable:
        """Import the file (once per process) and return the user's function."""
        if self._fn is not None:
            return self._fn
        path = Path(self.path)
        module = _import_file(path)
        if not hasattr(module, self.name):
            defined = _defined_functions(module)
            raise RewardLoadError(
                f"reward file {path} defines no function {self.name!r}; it defines: "
                f"{', '.join(defined) if defined else '(no public functions)'}. Set "
                f"`reward.functions[i].name` to one of them")
        fn = getattr(module, self.name)
        if not callable(fn):
            raise RewardLoadError(
                f"{self.name!r} in reward file {path} is a {type(fn).__name__}, not a function")
        self.kind = _reward_kind(module, path, fn, self.reward_type)
        self._by_keyword = _keyword_call(fn)
        problem = signature_problem(fn, self.kind, self._by_keyword, self.kwargs)
        if problem is not None:
            raise RewardLoadError(f"{self.name!r} in reward file {path}: {problem}")
        self._fn = fn
        return fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _await(self.load()(*args, **kwargs))

    def score_sample(self, data_source: Any, solution_str: str, ground_truth: Any, extra_info: Any) -> Any:
        """One per-sample call the way verl makes it: by keyword, plus the configured reward kwargs."""
        fn = self.load()
        if self._by_keyword:
            return _await(fn(data_source=data_source, solution_str=solution_str, ground_truth=ground_truth,
                             extra_info=extra_info, **self.kwargs))
        return _await(fn(data_source, solution_str, ground_truth, extra_info, **self.kwargs))

    def score_inputs(self, inputs: Any) -> Any:
        """A batch (list of input dicts) or sequential (one input dict) call, plus the reward kwargs."""
        return _await(self.load()(inputs, **self.kwargs))

    def __getstate__(self) -> dict:
        return {"path": self.path, "name": self.name, "kind": self.kind, "kwargs": self.kwargs,
                "reward_type": self.reward_type}

    def __setstate__(self, state: dict) -> None:
        self.path, self.name, self.kind = state["path"], state["name"], state["kind"]
        self.kwargs, self.reward_type = state.get("kwargs", {}), state.get("reward_type")
        self._fn = None
        self._by_keyword = True

    def __repr__(self) -> str:
        return f"RewardFunction(path={self.path!r}, name={self.name!r}, kind={self.kind!r})"


def load_reward_function(path: str | Path, name: str = "compute_score", kwargs: dict | None = None,
                         reward_type: str | None = None) -> RewardFunction:
    """Load ``name`` from the reward file at ``path`` now (errors surface here, in the caller's
    process) and return a picklable handle to it. Raises ``RewardLoadError``."""
    if not path:
        raise RewardLoadError(
            "no reward file given: set the config key `reward.functions[i].path`, e.g. "
            "reward.functions=[{path: reward_fns/math.py}]")
    if reward_type == "sample":  # verl's name for it
        reward_type = SAMPLE
    return RewardFunction(path, name, kwargs=kwargs, reward_type=reward_type)
