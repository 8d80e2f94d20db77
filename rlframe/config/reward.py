"""The `reward:` and `reward_model:` sections (rule-based reward functions, a model-based reward) and their checks."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from rlframe.config.checks import resolvable


@dataclass
class RewardFunctionConfig:
    path: str = "reward_fns/math.py"
    name: str = "compute_score"
    weight: float = 1.0
    data_sources: Optional[list[str]] = None
    kwargs: dict[str, Any] = field(default_factory=dict)  # extra keyword arguments for the function (verl reward_kwargs)
    # sample | sequential (per sample) | batch (EasyR1); null: from the file's REWARD_TYPE, else by signature
    reward_type: Optional[str] = None


@dataclass
class RewardConfig:
    functions: list[RewardFunctionConfig] = field(default_factory=lambda: [RewardFunctionConfig()])
    num_workers: int = 2
    timeout_s: float = 10.0
    batch_timeout_s: float = 300.0
    fallback_score: float = 0.0
    fail_fast: bool = False
    # Score step k's samples in a background thread while the old-log-prob / reference / critic passes run;
    # the driver joins the scores before the advantage (timing/reward_wait_s: how long it blocked there).
    # Same scores, same failure messages and counts; false: score, then run those passes (the old order).
    # Steps that need the rewards before the log-probs (DAPO's dynamic sampling) always score first.
    overlap: bool = True


@dataclass
class RewardModelConfig:
    """A model-based reward (HF sequence-classification RM, num_labels=1) added to the rule rewards:
    score = sum of weighted reward functions + weight * rm_score. Runs colocated with the actor."""

    enable: bool = False
    path: str = ""
    weight: float = 1.0
    max_length: int = 2048
    micro_batch_size: int = 8
    dtype: str = "auto"
    trust_remote_code: bool = False


# ------------------------------------------------------------------------------------ checks
def reward_functions_load(cfg, need) -> None:
    """At least one reward function; each file exists and defines its function (loaded here, in the driver,
    before any worker). EasyR1's `file.py:function` in the path is split into path and name (in place)."""
    from rlframe.reward.loader import RewardLoadError, split_path_name
    from rlframe.reward.manager import RewardSpec, validate_reward_specs

    need(bool(cfg.reward.functions), "reward.functions", "no reward function. Fix: reward.functions=[{path: reward_fns/math.py}]")
    for i, fn in enumerate(cfg.reward.functions):
        fn.path, fn.name = split_path_name(fn.path, fn.name)  # EasyR1's file.py:function
        if not Path(fn.path).exists():
            need(False, f"reward.functions[{i}].path",
                 f"'{fn.path}' does not exist. Fix: point it at your reward script (e.g. reward_fns/math.py).")
            continue
        try:
            validate_reward_specs([RewardSpec(path=fn.path, name=fn.name, weight=fn.weight, data_sources=fn.data_sources,
                                              kwargs=dict(fn.kwargs), reward_type=fn.reward_type)])
        except (RewardLoadError, ValueError) as error:
            need(False, f"reward.functions[{i}]", str(error))


def reward_model_resolves(cfg, need) -> None:
    rm = cfg.reward_model
    need(not rm.enable or (bool(rm.path) and resolvable(rm.path)), "reward_model.path",
         f"'{rm.path}' is not a model folder or hub id. Fix: reward_model.path=/path/to/rm")


CHECKS = (reward_model_resolves, reward_functions_load)
