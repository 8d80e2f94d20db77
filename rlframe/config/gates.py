"""The `trainer.gates:` section: checks on every RL step that warn about, or stop, a run that silently broke.

Each gate is `warn` (log it, gates/<name> = 1 in the metrics, a row in <run_dir>/gates.jsonl, the report),
`stop` (the same, then the run ends with the gate's message) or `off`. The rules are rlframe/trainer/gates.py;
docs/doctor.md explains each one and what usually causes it. The defaults do not fire on a healthy run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

GATE_ACTIONS = ("warn", "stop", "off")


@dataclass
class GatesConfig:
    """Gates on every RL step (rlframe/trainer/gates.py). `enable=false`: none run, and no weight checksum is taken."""

    enable: bool = True  # run the gates below on every RL step
    # The mean |log p_engine - log p_trainer| of the sampled tokens (rollout/logprob_abs_diff) above the
    # threshold of the run's dtype: the engine samples from another policy than the one trained.
    logprob_gap: str = "warn"
    logprob_gap_max: dict[str, float] = field(  # logprob_gap's threshold per model dtype
        default_factory=lambda: {"float32": 1e-3, "bfloat16": 0.05, "float16": 0.05})
    # After a sync, the engine's weights (a sampled checksum per tensor, every sync) differ from the trainer's,
    # or the trainer's moved and the engine's did not: rollouts sample an old policy.
    weight_sync: str = "stop"
    # The share of prompts whose samples all scored the same (no GRPO signal), averaged over the last
    # `zero_variance_window` steps, above `zero_variance_max_share`.
    zero_variance: str = "warn"
    zero_variance_max_share: float = 0.95  # zero_variance: the share of prompts with all-equal scores that fires it
    zero_variance_window: int = 5  # zero_variance: steps averaged over
    # Every sample of the batch scored the same, `constant_reward_steps` steps in a row.
    constant_reward: str = "warn"
    constant_reward_steps: int = 5  # constant_reward: consecutive steps that fire it
    # The policy's entropy per token (actor/entropy when logged, else the sampled tokens' mean negative
    # log-prob, rollout/sampled_nll) below `entropy_min_ratio` x its first step's value,
    # `entropy_collapse_steps` steps in a row.
    entropy_collapse: str = "warn"
    # entropy_collapse: the fraction of the first step's entropy below which a step counts
    entropy_min_ratio: float = 0.1
    entropy_collapse_steps: int = 3  # entropy_collapse: consecutive steps that fire it
    # A non-finite loss or gradient: the optimizer step was skipped (the run already stops after
    # trainer.max_consecutive_skipped_updates of them; `stop` here stops at the first).
    non_finite_loss: str = "warn"
    # On-policy distillation only (teacher.path): the share of the teacher's top-k tokens that are also in the
    # student's top-k (distill/topk_overlap) below `topk_overlap_min`, `topk_overlap_steps` steps in a row: the
    # two distributions barely share support and the top-k losses (forward_kl_topk, jsd) become unstable.
    topk_overlap: str = "warn"
    topk_overlap_min: float = 0.2  # topk_overlap: the overlap (0..1) below which a step counts
    topk_overlap_steps: int = 2  # topk_overlap: consecutive steps that fire it


GATE_NAMES = ("logprob_gap", "weight_sync", "zero_variance", "constant_reward", "entropy_collapse", "non_finite_loss",
              "topk_overlap")


# ------------------------------------------------------------------------------------ checks
def gate_actions_known(cfg, need) -> None:
    """Each gate's action is warn, stop or off."""
    gates = cfg.trainer.gates
    for name in GATE_NAMES:
        action = getattr(gates, name)
        need(action in GATE_ACTIONS, f"trainer.gates.{name}",
             f"'{action}' is not one of {', '.join(GATE_ACTIONS)}")


def gate_thresholds_in_range(cfg, need) -> None:
    """Shares and ratios in [0, 1], step counts >= 1, log-prob gap thresholds > 0."""
    g = cfg.trainer.gates
    need(0.0 <= g.zero_variance_max_share <= 1.0, "trainer.gates.zero_variance_max_share", "must be in [0, 1]")
    need(0.0 <= g.entropy_min_ratio <= 1.0, "trainer.gates.entropy_min_ratio", "must be in [0, 1]")
    need(0.0 <= g.topk_overlap_min <= 1.0, "trainer.gates.topk_overlap_min", "must be in [0, 1]")
    for key in ("zero_variance_window", "constant_reward_steps", "entropy_collapse_steps", "topk_overlap_steps"):
        need(getattr(g, key) >= 1, f"trainer.gates.{key}", "must be >= 1")
    for dtype, value in g.logprob_gap_max.items():
        need(value > 0, f"trainer.gates.logprob_gap_max.{dtype}", "must be > 0")


CHECKS = (gate_actions_known, gate_thresholds_in_range)
