"""The `algorithm:` section (advantage estimator, KL, DAPO's shaping, plugins, off-policy correction) and its checks.

What the chosen estimator needs (a critic, groups, a greedy baseline, multi-turn rollouts) is read
from its registry entry (`rlframe.algos.EstimatorNeeds`), never from its name: `run_estimator_needs(cfg)`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from rlframe.bounds import bounded, one_of

if TYPE_CHECKING:
    from rlframe.algos.advantages import EstimatorNeeds


KL_CONTROLLERS = ("fixed", "adaptive")


@dataclass
class KLControlConfig:
    type: str = one_of("fixed", KL_CONTROLLERS)  # adaptive (Ziegler et al.): steer the measured KL towards target_kl
    kl_coef: float = bounded(0.001, ">= 0")  # beta (the initial beta for adaptive)
    target_kl: float = bounded(0.1, "> 0")  # adaptive: the KL per token the coefficient steers towards
    # adaptive: how many samples the coefficient takes to adjust (Ziegler et al.'s horizon)
    horizon: float = bounded(10000.0, "> 0")


@dataclass
class OverlongBufferConfig:
    """DAPO overlong reward shaping: a linear penalty over the last `len` tokens before the limit."""

    # DAPO's overlong reward shaping: a linear penalty over the last `len` tokens before data.max_response_length
    enable: bool = False
    len: int = bounded(16, ">= 1")  # tokens before data.max_response_length where the penalty starts
    penalty_factor: float = bounded(1.0, ">= 0")  # the penalty at the limit


@dataclass
class DynamicSamplingConfig:
    """DAPO dynamic sampling: drop groups whose rewards all agree; generate more until the batch is full."""

    # DAPO's dynamic sampling: drop groups whose rewards all agree and generate more until the batch is full
    enable: bool = False
    max_attempts: int = bounded(10, ">= 1")  # rollout rounds per step before giving up with an error


@dataclass
class PluginConfig:
    path: Optional[str] = None  # a Python file
    name: Optional[str] = None  # the function in it; also the name it is registered under


@dataclass
class AlgorithmConfig:
    # grpo | gae (PPO, starts the critic) | rloo | reinforce_plus_plus | reinforce_plus_plus_baseline | drgrpo | remax | opo | grpo_turn | your own (custom_estimator)
    adv_estimator: str = "grpo"
    # grpo: divide each group's centred rewards by their std (false: Dr. GRPO's mean-centring only)
    norm_adv_by_std: bool = True
    gamma: float = bounded(1.0, "[0, 1]")  # discount per token (gae, reinforce_plus_plus); 1: no discount
    # gae: the lambda of generalised advantage estimation (1: Monte-Carlo returns minus values)
    lam: float = bounded(1.0, "[0, 1]")
    turn_gamma: float = bounded(1.0, "[0, 1]")  # grpo_turn: discount per model turn of a multi-turn rollout (not per token)
    # a KL-to-reference term in the actor's loss (kl_loss_coef, kl_loss_type); starts the reference policy
    use_kl_loss: bool = True
    # the KL loss's weight in the actor's loss (use_kl_loss)
    kl_loss_coef: float = bounded(0.001, ">= 0", "below 0 the loss would push the policy away from the reference")
    kl_loss_type: str = "low_var_kl"  # k1 | k2 | k3 / low_var_kl | abs | mse
    whiten_advantages: bool = False  # whiten the advantages over the batch (usual for PPO with gae)
    # KL inside the reward (classic PPO-RLHF): token_level_rewards = scores - beta * kl(old policy, ref),
    # beta from kl_ctrl. The reference model is started only when use_kl_loss or use_kl_in_reward.
    use_kl_in_reward: bool = False
    kl_penalty: str = "k1"  # the per-token KL estimator for the reward penalty (see rlframe/algos/kl.py)
    kl_ctrl: KLControlConfig = field(default_factory=lambda: KLControlConfig())
    overlong_buffer: OverlongBufferConfig = field(default_factory=lambda: OverlongBufferConfig())
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=lambda: DynamicSamplingConfig())
    # Your own estimator / policy loss from a Python file: {path: my_algos.py, name: my_fn}. It is
    # registered under `name` before any worker starts; select it with adv_estimator=<name>
    # (or actor.policy_loss=<name>). What the estimator needs (a critic, groups, ...) is its
    # function's `needs` attribute (rlframe/algos/plugins.py). See examples/custom_estimator/.
    custom_estimator: PluginConfig = field(default_factory=lambda: PluginConfig())
    custom_policy_loss: PluginConfig = field(default_factory=lambda: PluginConfig())
    # The behaviour policy's correction (rlframe/algos/off_policy.py): tis weights each token's policy-gradient
    # term by min(pi_old / pi_rollout, tis_cap), pi_rollout being the engine's log-probs of its samples |
    # none | auto: tis with trainer.async_rollout (samples from older weights), none otherwise.
    off_policy_correction: str = "auto"
    # TIS: the cap of the per-token importance weight pi_trainer / pi_engine
    tis_cap: float = bounded(2.0, ">= 1", "a cap below 1 down-weights even on-policy tokens")


PLUGIN_ERRORS = (OSError, ImportError, AttributeError, TypeError, ValueError)  # what reading a user's file raises


def run_estimator_needs(cfg) -> EstimatorNeeds:
    """What algorithm.adv_estimator needs (rlframe.algos.plugins.configured_estimator_needs); nothing when a
    user's estimator file cannot be read (`custom_estimator_reads` reports why)."""
    from rlframe.algos.advantages import NO_NEEDS
    from rlframe.algos.plugins import configured_estimator_needs

    try:
        return configured_estimator_needs(cfg.algorithm)
    except PLUGIN_ERRORS:
        return NO_NEEDS


def off_policy_correction(cfg) -> str:
    """algorithm.off_policy_correction with auto resolved: tis for asynchronous or partial rollouts, none otherwise."""
    chosen = cfg.algorithm.off_policy_correction
    off_policy = cfg.trainer.async_rollout or cfg.rollout.partial.enable  # samples of older weights
    return ("tis" if off_policy else "none") if chosen == "auto" else chosen


# ------------------------------------------------------------------------------------ checks
def plugins_complete(cfg, need) -> None:
    """algorithm.custom_estimator / custom_policy_loss: both path and name (or neither); the path a file."""
    algo = cfg.algorithm
    for key, plugin in (("algorithm.custom_estimator", algo.custom_estimator),
                        ("algorithm.custom_policy_loss", algo.custom_policy_loss)):
        need((plugin.path is None) == (plugin.name is None), key, "set both path and name (or neither)")
        need(plugin.path is None or Path(plugin.path).is_file(), f"{key}.path", f"'{plugin.path}' is not a file")


def custom_estimator_reads(cfg, need) -> None:
    """The selected user estimator's file imports and declares well-formed needs (read here, before any worker)."""
    algo, plugin = cfg.algorithm, cfg.algorithm.custom_estimator
    if not (plugin.path and plugin.name == algo.adv_estimator and Path(plugin.path).is_file()):
        return
    from rlframe.algos.plugins import configured_estimator_needs

    try:
        configured_estimator_needs(algo)
    except PLUGIN_ERRORS as error:
        need(False, "algorithm.custom_estimator", str(error))


def estimator_registered(cfg, need) -> None:
    from rlframe.algos import ADVANTAGE_ESTIMATORS

    algo = cfg.algorithm
    need(algo.adv_estimator in set(ADVANTAGE_ESTIMATORS) | {algo.custom_estimator.name}, "algorithm.adv_estimator",
         f"'{algo.adv_estimator}' is not a registered estimator ({', '.join(sorted(ADVANTAGE_ESTIMATORS))}). "
         "Fix: pick one, or load your own with algorithm.custom_estimator={path: ..., name: ...}")


def groups_have_two_samples(cfg, need) -> None:
    """An estimator whose baseline comes from the group needs rollout.n >= 2."""
    need(not run_estimator_needs(cfg).groups or cfg.rollout.n >= 2, "rollout.n",
         f"{cfg.algorithm.adv_estimator} compares samples of one prompt (with one, every advantage is 0): "
         "set rollout.n >= 2")


def turn_estimator_has_turns(cfg, need) -> None:
    need(not run_estimator_needs(cfg).multi_turn or cfg.rollout.multi_turn.enable, "algorithm.adv_estimator",
         "grpo_turn credits the model turns of multi-turn rollouts; on single-turn ones it is grpo. "
         "Fix: algorithm.adv_estimator=grpo, or rollout.multi_turn.enable=true")



def kl_penalty_known(cfg, need) -> None:
    """algorithm.kl_penalty and kl_loss_type: estimators of rlframe/algos/kl.py."""
    from rlframe.algos.kl import KL_KINDS

    for key in ("kl_penalty", "kl_loss_type"):
        kind = getattr(cfg.algorithm, key)
        need(kind in KL_KINDS, f"algorithm.{key}", f"'{kind}' is not one of {', '.join(KL_KINDS)}")


def overlong_buffer_within_response(cfg, need) -> None:
    buffer, length = cfg.algorithm.overlong_buffer, cfg.data.max_response_length
    need(not buffer.enable or buffer.len <= length, "algorithm.overlong_buffer.len",
         f"must be in 1..data.max_response_length ({length})")


def dynamic_sampling_has_groups(cfg, need) -> None:
    """DAPO's dynamic sampling: at least one attempt, and groups of n >= 2 whose rewards can differ."""
    sampling = cfg.algorithm.dynamic_sampling
    if not sampling.enable:
        return
    need(cfg.rollout.n >= 2, "rollout.n", "dynamic sampling drops groups whose rewards agree: set rollout.n >= 2")


def off_policy_correction_known(cfg, need) -> None:
    """algorithm.off_policy_correction and its TIS cap (rlframe/algos/off_policy.py)."""
    from rlframe.algos.off_policy import OFF_POLICY_CORRECTIONS

    algo = cfg.algorithm
    need(algo.off_policy_correction in OFF_POLICY_CORRECTIONS, "algorithm.off_policy_correction",
         f"'{algo.off_policy_correction}' is not one of {', '.join(OFF_POLICY_CORRECTIONS)}")


CHECKS = (plugins_complete, custom_estimator_reads, estimator_registered, groups_have_two_samples,
          turn_estimator_has_turns, kl_penalty_known,
          overlong_buffer_within_response, dynamic_sampling_has_groups, off_policy_correction_known)
