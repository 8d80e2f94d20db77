"""Load a user's reward function from a Python file.

A reward file is an ordinary script (see ``reward_fns/``). Two calling conventions are supported:

* per sample (verl), the default::

      def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict

  returning a float, or a dict with a ``score`` key plus any extra keys to log;

* batched (EasyR1), selected by a module-level ``REWARD_TYPE = "batch"``::

      def compute_score(reward_inputs: list[dict]) -> list[dict]

  each input has ``response``, ``response_length``, ``ground_truth``, ``data_source`` and
  ``extra_info``; each output has an ``overall`` key plus any extra keys to log.

The file's own directory is appended to ``sys.path``, so a reward file can import its sibling
helper modules (``from my_helpers import ...``) as when it is run as a script.

``RewardFunction`` is picklable: it carries only the path, the function name and the kind, and
imports the file again, lazily, in whichever process first calls it (the reward worker processes).
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import sys
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

SAMPLE = "sample"
BATCH = "batch"


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


def _defined_functions(module: ModuleType) -> list[str]:
    return sorted(name for name, obj in vars(module).items()
                  if inspect.isfunction(obj) and obj.__module__ == module.__name__
                  and not name.startswith("_"))


def _reward_kind(module: ModuleType, path: Path) -> str:
    kind = getattr(module, "REWARD_TYPE", SAMPLE)
    if kind not in (SAMPLE, BATCH):
        raise RewardLoadError(
            f"{path}: REWARD_TYPE must be {SAMPLE!r} (compute_score(data_source, solution_str, "
            f"ground_truth, extra_info=None)) or {BATCH!r} (compute_score(reward_inputs)), "
            f"got {kind!r}")
    return kind


class RewardFunction:
    """A picklable handle to ``name`` in the reward file ``path``.

    ``kind`` is ``"sample"`` (verl per-sample form) or ``"batch"`` (EasyR1 batched form).
    Calling it calls the user's function with the arguments given.
    """

    def __init__(self, path: str | Path, name: str = "compute_score", kind: str | None = None):
        self.path = str(Path(path).expanduser().resolve())
        self.name = name
        self._fn: Callable | None = None
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
        self.kind = _reward_kind(module, path)
        self._fn = fn
        return fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.load()(*args, **kwargs)

    def __getstate__(self) -> dict:
        return {"path": self.path, "name": self.name, "kind": self.kind}

    def __setstate__(self, state: dict) -> None:
        self.path, self.name, self.kind = state["path"], state["name"], state["kind"]
        self._fn = None

    def __repr__(self) -> str:
        return f"RewardFunction(path={self.path!r}, name={self.name!r}, kind={self.kind!r})"


def load_reward_function(path: str | Path, name: str = "compute_score") -> RewardFunction:
    """Load ``name`` from the reward file at ``path`` now (errors surface here, in the caller's
    process) and return a picklable handle to it. Raises ``RewardLoadError``."""
    if not path:
        raise RewardLoadError(
            "no reward file given: set the config key `reward.functions[i].path`, e.g. "
            "reward.functions=[{path: reward_fns/math.py}]")
    return RewardFunction(path, name)
