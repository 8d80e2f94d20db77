"""The `actor:` and `critic:` sections (the policy's and the value model's training) and their checks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from rlframe.bounds import bounded
from rlframe.config.checks import is_number, resolvable
from rlframe.workers.engine.registry import ENGINES


@dataclass
class OptimConfig:
    lr: float = bounded(1e-6, "> 0")  # AdamW's peak learning rate (after warm-up; constant afterwards)
    weight_decay: float = bounded(0.0, ">= 0")  # AdamW's decoupled weight decay
    betas: list[float] = bounded([0.9, 0.999], "[0, 1)", "Adam's (beta1, beta2)", length=2)  # AdamW's betas
    warmup_steps: int = bounded(0, ">= 0", "0: no warm-up")  # steps of linear learning-rate warm-up from 0 to lr
    # clip the gradient's global norm to this before each step
    grad_clip: float = bounded(1.0, "> 0", "the gradient norm's ceiling: at or below 0 every gradient is zeroed or flipped")


@dataclass
class ActorConfig:
    strategy: str = "fsdp"  # the training engine (workers/engine/registry.py): fsdp (FSDP2) | deepspeed (ZeRO) | megatron; ref and critic too
    world_size: int = bounded(1, ">= 1")  # data-parallel ranks of the actor (and colocated rollout / ref)
    optim: OptimConfig = field(default_factory=OptimConfig)
    ppo_mini_batch_size: int = bounded(8, ">= 1")  # prompts per optimiser step (x rollout.n sequences)
    ppo_micro_batch_size_per_device: int = bounded(4, ">= 1")  # sequences per forward/backward
    # passes of policy updates over each step's batch
    ppo_epochs: int = bounded(1, ">= 1", "0 would never update the policy")
    shuffle: bool = True  # shuffle the rows before cutting them into mini-batches (each epoch)
    policy_loss: str = "vanilla"  # vanilla (PPO clip) | gspo | cispo | your own (algorithm.custom_policy_loss)
    # The policy loss's options. "auto": its published default (rlframe/algos/losses.py
    # POLICY_LOSS_DEFAULTS; vanilla 0.2 / 0.2, dual clip 3.0, token-mean; gspo 3e-4 / 4e-4,
    # seq-mean-token-mean; cispo no lower bound / 0.28, token-mean). null: no bound (clip_ratio_c:
    # dual clip off; cispo's clip_ratio_low). Setting a key the loss ignores is an error.
    clip_ratio_low: Any = "auto"  # ratio range [1 - low, 1 + high]; high > low is DAPO's clip-higher
    clip_ratio_high: Any = "auto"  # the upper clip: ratio <= 1 + high (see clip_ratio_low)
    clip_ratio_c: Any = "auto"  # dual clip (vanilla): for A < 0 the loss is capped at -A * c
    loss_agg_mode: str = "auto"  # auto | token-mean | seq-mean-token-sum | seq-mean-token-mean | ...-sum-norm
    entropy_coeff: float = bounded(0.0, "finite")  # < 0 minimises the entropy
    # sequences per forward in compute_log_prob (and the reference's)
    log_prob_micro_batch_size_per_device: int = bounded(16, ">= 1")
    # With one epoch and one mini-batch per step the update is exactly on-policy: the old log-probs
    # equal the first forward's, so the separate compute_log_prob pass is skipped (and the
    # engine/trainer log-prob agreement is measured inside update_actor instead).
    skip_old_log_prob_when_on_policy: bool = True
    # Padding-free forward (all real tokens of a micro-batch packed in one row): flash-attn varlen on
    # GPU, rlframe's VARLEN_SDPA elsewhere (per-sequence causal SDPA, linear layers on real tokens
    # only; measured on CPU: 8.7 s packed vs 10.4 s padded fwd+bwd, 16 GRPO rollouts of SmolLM2).
    # auto = on, except with attn_implementation=eager (models that do not route attention through
    # transformers' attention interface cannot be packed).
    use_remove_padding: str = "auto"  # auto | true | false
    # Dynamic micro-batches: instead of a fixed count, pack rows up to a token budget per forward
    # (0 = off: use the fixed ppo_micro_batch_size_per_device / log_prob_micro_batch_size_per_device).
    ppo_max_token_len_per_device: int = bounded(0, ">= 0", "0: off")
    # the same token budget for the log-prob passes
    log_prob_max_token_len_per_device: int = bounded(0, ">= 0", "0: off")
    # Ulysses sequence parallelism: each group of this many consecutive ranks shares every packed row
    # (1/P of the tokens each; all-to-all around attention). Must divide world_size and the model's
    # attention heads; needs use_remove_padding. Applies to the actor and the reference policy.
    ulysses_sequence_parallel_size: int = bounded(1, ">= 1")
    offload_params: bool = False  # GPU only: keep params on CPU between phases (deepspeed: = deepspeed.offload)
    offload_optimizer: bool = False  # GPU only: keep optimizer state on CPU between phases (deepspeed: = adam_offload)
    # Vision-language models: keep the vision tower (and its patch merger) fixed; only the language
    # model trains (weight sync still sends every tensor). An error for a text-only model.
    freeze_vision_tower: bool = False


@dataclass
class CriticConfig:
    """The value model of PPO (started when the advantage estimator needs values: algorithm.adv_estimator=gae),
    colocated with the actor."""

    model_path: Optional[str] = None  # default: the actor's model.path (the value head starts at zero)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    # The value head starts at zero; at the backbone's small LR it would need hundreds of steps to
    # reach the reward scale, so it has its own LR (null: optim.lr).
    head_lr: Optional[float] = bounded(1e-3, "> 0")
    ppo_mini_batch_size: Optional[int] = bounded(None, ">= 1")  # prompts per optimiser step; default actor.ppo_mini_batch_size
    ppo_micro_batch_size_per_device: int = bounded(4, ">= 1")  # sequences per forward/backward
    forward_micro_batch_size_per_device: int = bounded(16, ">= 1")  # sequences per forward in compute_values
    ppo_epochs: int = bounded(1, ">= 1")  # passes of value updates over each step's batch
    cliprange_value: float = bounded(0.5, ">= 0", "0 disables clipping")  # value clipping around the old values
    # how the value loss is averaged: token-mean | seq-mean-token-sum | seq-mean-token-mean
    loss_agg_mode: str = "token-mean"


POLICY_LOSS_KEYS = ("clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "loss_agg_mode")  # actor.*, "auto"-able


def policy_loss_options(actor: ActorConfig) -> dict[str, Any]:
    """The actor's POLICY_LOSS_KEYS with "auto" resolved to the policy loss's published default (pure).

    A key the loss does not read resolves to None; one set explicitly is kept as it is
    (validate_config rejects it if the loss ignores it).
    """
    from rlframe.algos.losses import policy_loss_defaults

    defaults = policy_loss_defaults(actor.policy_loss)
    values = {key: getattr(actor, key) for key in POLICY_LOSS_KEYS}
    return {key: defaults.get(key) if isinstance(value, str) and value == "auto" else value
            for key, value in values.items()}


def apply_algorithm_defaults(cfg) -> Any:
    """Write policy_loss_options into cfg.actor (in place; idempotent: nothing is "auto" afterwards)."""
    for key, value in policy_loss_options(cfg.actor).items():
        setattr(cfg.actor, key, value)
    return cfg


# ------------------------------------------------------------------------------------ checks
def strategy_known(cfg, need) -> None:
    need(cfg.actor.strategy in ENGINES, "actor.strategy",
         f"'{cfg.actor.strategy}' is not a training engine here ({', '.join(ENGINES)}). Fix: actor.strategy=fsdp")




def _batch_sizes_positive(cfg) -> bool:
    return cfg.data.train_batch_size >= 1 and cfg.actor.ppo_mini_batch_size >= 1


def mini_batch_divides_train_batch(cfg, need) -> None:
    data, actor = cfg.data, cfg.actor
    need(not _batch_sizes_positive(cfg) or data.train_batch_size % actor.ppo_mini_batch_size == 0,
         "actor.ppo_mini_batch_size",
         f"data.train_batch_size={data.train_batch_size} is not a multiple of "
         f"actor.ppo_mini_batch_size={actor.ppo_mini_batch_size}. Fix: make the mini-batch divide the batch.")


def mini_batch_splits_over_ranks(cfg, need) -> None:
    """A mini-batch's sequences (ppo_mini_batch_size x rollout.n) split evenly over the ranks, and each
    rank's share into whole micro-batches."""
    actor = cfg.actor
    if not _batch_sizes_positive(cfg) or actor.world_size < 1:
        return
    mini_seqs = actor.ppo_mini_batch_size * cfg.rollout.n
    need(mini_seqs % actor.world_size == 0, "actor.world_size",
         f"a mini-batch of {mini_seqs} sequences (ppo_mini_batch_size x rollout.n) does not split "
         f"over actor.world_size={actor.world_size} ranks. Fix: change one of them.")
    per_rank = mini_seqs // actor.world_size
    micro = actor.ppo_micro_batch_size_per_device
    need(micro < 1 or per_rank % micro == 0, "actor.ppo_micro_batch_size_per_device",  # (< 1: its bound)
         f"each rank gets {per_rank} sequences per mini-batch, not a multiple of "
         f"ppo_micro_batch_size_per_device={micro}. Fix: pick a divisor of {per_rank}.")


def ulysses_divides_world(cfg, need) -> None:
    sp, world = cfg.actor.ulysses_sequence_parallel_size, cfg.actor.world_size
    need(sp < 1 or world < 1 or world % sp == 0, "actor.ulysses_sequence_parallel_size",  # (< 1: their bounds)
         f"{sp} must divide actor.world_size={world}. Fix: pick a divisor of the world size.")


def remove_padding_known(cfg, need) -> None:
    value = str(cfg.actor.use_remove_padding).lower()  # (a YAML true / false arrives as "True" / "False")
    need(value in ("auto", "true", "false"), "actor.use_remove_padding",
         f"{cfg.actor.use_remove_padding!r} is not one of auto, true, false. Fix: actor.use_remove_padding=auto")


def ulysses_needs_packing(cfg, need) -> None:
    need(cfg.actor.ulysses_sequence_parallel_size == 1 or str(cfg.actor.use_remove_padding).lower() != "false",
         "actor.ulysses_sequence_parallel_size",
         "sequence parallelism splits packed rows: it needs actor.use_remove_padding=auto or true")


def policy_loss_registered(cfg, need) -> None:
    from rlframe.algos import POLICY_LOSSES

    need(cfg.actor.policy_loss in set(POLICY_LOSSES) | {cfg.algorithm.custom_policy_loss.name}, "actor.policy_loss",
         f"'{cfg.actor.policy_loss}' is not a registered policy loss ({', '.join(sorted(POLICY_LOSSES))}). "
         "Fix: pick one, or load your own with algorithm.custom_policy_loss={path: ..., name: ...}")


def policy_loss_reads_its_keys(cfg, need) -> None:
    """A POLICY_LOSS_KEYS key set for a policy loss that ignores it is an error (null is harmless)."""
    from rlframe.algos import policy_loss_defaults

    actor, reads = cfg.actor, policy_loss_defaults(cfg.actor.policy_loss)  # the keys the loss reads -> defaults
    for key in POLICY_LOSS_KEYS:
        need(key in reads or getattr(actor, key) is None, f"actor.{key}",
             f"the {actor.policy_loss} policy loss ignores it (it reads {', '.join(reads)}). "
             f"Fix: remove actor.{key} (or set it to auto), or pick a policy loss that uses it.")


def loss_agg_mode_known(cfg, need) -> None:
    from rlframe.algos import AGG_MODES

    need(cfg.actor.loss_agg_mode in AGG_MODES, "actor.loss_agg_mode",
         f"'{cfg.actor.loss_agg_mode}' is not one of auto, {', '.join(AGG_MODES)}")


def clip_ratios_in_range(cfg, need) -> None:
    """The clip ratios the policy loss reads: low in (0, 1) (or null where the loss allows none), high > 0,
    the dual clip c > 1 or null."""
    from rlframe.algos import policy_loss_defaults

    actor, reads = cfg.actor, policy_loss_defaults(cfg.actor.policy_loss)
    low, high, c = actor.clip_ratio_low, actor.clip_ratio_high, actor.clip_ratio_c
    if "clip_ratio_low" in reads:
        need((low is None and reads["clip_ratio_low"] is None) or (is_number(low) and 0 < low < 1),
             "actor.clip_ratio_low", f"{low!r}: must be a number in (0, 1) (the ratio's lower bound is 1 - low)"
             + (", or null for none" if reads["clip_ratio_low"] is None else ""))
    if "clip_ratio_high" in reads:
        need(is_number(high) and high > 0, "actor.clip_ratio_high",
             f"{high!r}: must be a number > 0 (the ratio's upper bound is 1 + high)")
    if "clip_ratio_c" in reads:
        need(c is None or (is_number(c) and c > 1), "actor.clip_ratio_c",
             f"{c!r}: must be a number > 1, or null to turn the dual clip off")


CHECKS = (strategy_known, remove_padding_known, mini_batch_divides_train_batch,
          mini_batch_splits_over_ranks, ulysses_divides_world, ulysses_needs_packing, policy_loss_registered,
          policy_loss_reads_its_keys, loss_agg_mode_known, clip_ratios_in_range)


# ------------------------------------------------------------------------------ critic checks
# (only when the advantage estimator needs values: the critic is not started otherwise)
def _critic_runs(cfg) -> bool:
    from rlframe.config.algorithm import run_estimator_needs

    return run_estimator_needs(cfg).critic


def critic_loss_agg_mode_known(cfg, need) -> None:
    from rlframe.algos import AGG_MODES

    critic = cfg.critic
    need(not _critic_runs(cfg) or critic.loss_agg_mode in AGG_MODES, "critic.loss_agg_mode",
         f"'{critic.loss_agg_mode}' is not one of {AGG_MODES}")


def critic_model_resolves(cfg, need) -> None:
    path = cfg.critic.model_path
    need(not _critic_runs(cfg) or path is None or resolvable(path), "critic.model_path",
         f"'{path}' is neither a folder, an embedded model nor a hub id")


def critic_mini_batch_splits(cfg, need) -> None:
    """critic.ppo_mini_batch_size (default: the actor's) divides the batch; each rank's share of it
    splits into whole micro-batches."""
    if not _critic_runs(cfg):
        return
    critic, rollout = cfg.critic, cfg.rollout
    mini = critic.ppo_mini_batch_size or cfg.actor.ppo_mini_batch_size
    if mini < 1 or cfg.data.train_batch_size < 1:
        return  # (their bounds report it)
    need(cfg.data.train_batch_size % mini == 0, "critic.ppo_mini_batch_size",
         f"{mini} does not divide data.train_batch_size={cfg.data.train_batch_size}")
    per_rank = mini * rollout.n // max(cfg.actor.world_size, 1)
    micro = critic.ppo_micro_batch_size_per_device
    need(micro < 1 or per_rank % micro == 0, "critic.ppo_micro_batch_size_per_device",
         f"each rank gets {per_rank} sequences per critic mini-batch. Fix: pick a divisor of {per_rank}.")



CRITIC_CHECKS = (critic_loss_agg_mode_known, critic_model_resolves, critic_mini_batch_splits)


def skips_old_log_prob_pass(cfg) -> bool:
    """The update is exactly on-policy, so the old log-probs are the first forward's own and the separate
    compute_log_prob pass is skipped: actor.skip_old_log_prob_when_on_policy with one epoch and one
    mini-batch per step, and no KL in the reward (which needs the old log-probs before the update)."""
    actor = cfg.actor
    return (actor.skip_old_log_prob_when_on_policy and actor.ppo_epochs == 1
            and actor.ppo_mini_batch_size == cfg.data.train_batch_size and not cfg.algorithm.use_kl_in_reward)
