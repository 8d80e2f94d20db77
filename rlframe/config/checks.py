"""How a configuration check is written and run: `rule(cfg, need)` calls `need(ok, key, message)` per rule.

    def mini_batch_divides_train_batch(cfg, need):
        need(cfg.data.train_batch_size % cfg.actor.ppo_mini_batch_size == 0, "actor.ppo_mini_batch_size",
             "... Fix: make the mini-batch divide the batch.")

A field's own range or choices is declared beside it (`lr: float = bounded(1e-6, "> 0")`,
`overlong: str = one_of("filter", OVERLONG)`; rlframe/bounds.py) and checked by `declared_bounds_hold`, first;
the named checks are the rules between fields. Each section module (model.py, data.py, ...) lists its checks in
`CHECKS` (rules on the config alone)
and `FOLDER_CHECKS` (`rule(cfg, need, model_dir)`: rules that read the model's folder, `model_dir`
None when it is not on this machine yet). `problems_of` runs them and gathers every failed rule as
"key: message"; `raise_problems` reports them all at once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextvars import ContextVar
from pathlib import Path
from typing import Any

from rlframe.bounds import bound_problems

Need = Callable[[bool, str, str], None]  # need(condition, key, message): a problem unless condition
Check = Callable[[Any, Need], None]  # rule(cfg, need)
FolderCheck = Callable[[Any, Need, "str | None"], None]  # rule(cfg, need, model_dir)
# Whether a check may start the user's processes or import the user's tool / environment files (MCP servers are
# started to list their tools): off where a check must have no side effects, the board's Preview
# (validate_config(cfg, run_user_code=False)); those files and servers are then checked as written only.
RUN_USER_CODE: ContextVar[bool] = ContextVar("RUN_USER_CODE", default=True)


class ConfigError(ValueError):
    """An inconsistent configuration; the message lists every problem with its key and fix."""


def problems_of(cfg: Any, checks: Iterable[Callable], *args: Any) -> list[str]:
    """Run each `check(cfg, need, *args)` in order; the failed rules as "key: message", in the order found."""
    problems: list[str] = []

    def need(condition: bool, key: str, message: str) -> None:
        if not condition:
            problems.append(f"{key}: {message}")

    for check in checks:
        check(cfg, need, *args)
    return problems


def declared_bounds_hold(cfg: Any, need: Need) -> None:
    """Every number within the bound declared beside its field (and finite), every enum key one of its choices."""
    for problem in bound_problems(cfg):
        key, message = problem.split(": ", 1)
        need(False, key, message)


def raise_problems(problems: list[str]) -> None:
    """ConfigError listing every problem, one per line; nothing when there is none."""
    if problems:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(problems))


def is_number(value: Any) -> bool:
    """An int or a float, not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def resolvable(path: str) -> bool:
    """A model folder on disk, an embedded model, or an HF hub id."""
    from rlframe.models.provision import is_resolvable

    return is_resolvable(path)


def local_model_dir(path: str) -> str | None:
    """A model folder with a config.json on this machine (a folder, or an embedded model already
    converted into the cache); None for hub ids and models not provisioned yet."""
    from rlframe.models.provision import EMBEDDED_MODELS, cache_root

    if path in EMBEDDED_MODELS:
        folder = cache_root() / "models" / EMBEDDED_MODELS[path].folder_name
    else:
        folder = Path(path).expanduser()
    return str(folder) if (folder / "config.json").is_file() else None
