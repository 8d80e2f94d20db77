"""Gates: rules checked on every RL step that say when a run has silently broken, and warn or stop it.

    gates = Gates(cfg.trainer.gates, dtype="float32", run_dir=run_dir)
    metrics.update(step_signals(batch))              # reward/zero_variance_groups, reward/score_std, rollout/sampled_nll
    metrics.update(gates.check(step, metrics, sync))  # gates/<name>: 1.0 fired, 0.0 held; raises GateStopped

Each rule is a small pure function of this step's metrics (and, for the rules over several steps, the
recent history) that returns a `GateEvent` when it fires, else None. A fired gate names the step, the
metric, its value, the threshold and the likely cause: in the log, in the metrics (gates/<name>), in
<run_dir>/gates.jsonl (the report shows it) and, for a `stop` gate, in the error that ends the run.
"""

from __future__ import annotations

import json
import logging
import math
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from rlframe.config.gates import GatesConfig

logger = logging.getLogger(__name__)


@dataclass
class GateEvent:
    name: str
    step: int
    metric: str
    value: float
    threshold: float
    cause: str
    action: str = "warn"

    def message(self) -> str:
        return (f"gate {self.name} fired at step {self.step}: {self.metric} = {self.value:.6g} "
                f"(threshold {self.threshold:.6g}). Likely cause: {self.cause}")


class GateStopped(RuntimeError):
    """A `stop` gate fired; the message names the step, metric, value, threshold and likely cause."""


# ------------------------------------------------------------------------------------ the rules
def logprob_gap_gate(step: int, gap: float | None, threshold: float) -> GateEvent | None:
    """Fires when the mean |log p_engine - log p_trainer| of the sampled tokens exceeds `threshold`."""
    if gap is None or not gap > threshold:
        return None
    return GateEvent("logprob_gap", step, "rollout/logprob_abs_diff", gap, threshold,
                     "the rollout engine computes another distribution than the trainer: a weight sync that did not "
                     "land, a dtype or attention kernel that differs between them, a sampling option (temperature, "
                     "top-p/top-k) the trainer does not apply, or a tokenizer/template mismatch")


def weight_sync_gate(step: int, check: dict | None) -> GateEvent | None:
    """Fires when a sync left the engine unequal to the trainer (`check["unequal"]` > 0 of `check["streamed"]`
    tensors: some differ, or the engine does not hold them), or when the trainer's weights moved since the previous
    sync and the engine's did not (trainer_changed == 1, engine_changed == 0). `check`: compare_checksums' report
    (None: not checked)."""
    if not check:
        return None
    if check.get("unequal"):
        streamed = check.get("streamed", check["checked"])
        missing = check.get("missing", 0)
        return GateEvent("weight_sync", step, "weight_sync/checksum_unequal", float(check["unequal"]), 0.0,
                         f"after the sync {check['unequal']} of {streamed} tensors differ between the trainer and the "
                         f"engine{f' ({missing} not held by the engine at all)' if missing else ''} (first: "
                         f"{check['first_unequal']}): the engine did not load the weights (a skipped or failed load, a "
                         "LoRA adapter not applied, names the engine does not map)")
    if check.get("trainer_changed") == 1 and check.get("engine_changed") == 0:
        return GateEvent("weight_sync", step, "weight_sync/engine_changed", 0.0, 1.0,
                         "the trainer's weights moved since the previous sync but the engine's did not: the sync "
                         "left the engine on the old policy")
    return None


def zero_variance_gate(step: int, recent_shares: list[float], max_share: float, window: int) -> GateEvent | None:
    """Fires when the mean share of prompts whose samples all scored alike, over the last `window` steps
    (all of them present), exceeds `max_share`: group-relative advantages are zero there, nothing is learned."""
    if len(recent_shares) < window:
        return None
    mean = float(np.mean(recent_shares[-window:]))
    if not mean > max_share:
        return None
    return GateEvent("zero_variance", step, f"reward/zero_variance_groups (mean of {window} steps)", mean, max_share,
                     "almost every group's samples score the same: the task is too hard or too easy for the policy, "
                     "rollout.n or the temperature is too low, or the reward cannot tell answers apart")


def constant_reward_gate(step: int, recent_stds: list[float], steps: int) -> GateEvent | None:
    """Fires when every sample of the batch scored the same (reward/score_std == 0) `steps` steps in a row."""
    if len(recent_stds) < steps or any(std > 0 for std in recent_stds[-steps:]):
        return None
    return GateEvent("constant_reward", step, f"reward/score_std ({steps} steps in a row)", 0.0, 0.0,
                     "the reward returns one value for every response: a reward function that never matches the "
                     "answer format, a wrong ground-truth column, or a failing function scoring reward.fallback_score")


def entropy_collapse_gate(step: int, recent: list[float], first: float | None, min_ratio: float,
                          steps: int) -> GateEvent | None:
    """Fires when the entropy per token stayed below `min_ratio` x its first logged value `steps` steps in a row."""
    if first is None or first <= 0 or len(recent) < steps:
        return None
    threshold = min_ratio * first
    if any(value >= threshold for value in recent[-steps:]):
        return None
    return GateEvent("entropy_collapse", step, "entropy per token", recent[-1], threshold,
                     "the policy became (nearly) deterministic: too high a learning rate, no KL or entropy term, "
                     "or a reward the policy hacks with one fixed answer")


def non_finite_loss_gate(step: int, metrics: dict[str, float]) -> GateEvent | None:
    """Fires when the update skipped a non-finite step (actor/skipped_updates > 0) or logged a non-finite loss."""
    skipped = metrics.get("actor/skipped_updates", 0.0)
    loss = metrics.get("actor/pg_loss", 0.0)
    if skipped > 0:
        return GateEvent("non_finite_loss", step, "actor/skipped_updates", skipped, 0.0,
                         "a non-finite loss or gradient norm (the optimizer step was skipped): a learning rate too "
                         "high, an overflow in a low-precision dtype, or a non-finite reward or advantage")
    if not math.isfinite(loss):
        return GateEvent("non_finite_loss", step, "actor/pg_loss", loss, 0.0,
                         "a non-finite policy loss: an overflow, or a non-finite reward or advantage")
    return None


def topk_overlap_gate(step: int, recent: list[float], min_overlap: float, steps: int) -> GateEvent | None:
    """Fires when distill/topk_overlap (|top-k teacher ∩ top-k student| / K, mean per position) stayed below
    `min_overlap` `steps` steps in a row."""
    if len(recent) < steps or any(value >= min_overlap for value in recent[-steps:]):
        return None
    return GateEvent("topk_overlap", step, f"distill/topk_overlap ({steps} steps in a row)", recent[-1], min_overlap,
                     "the teacher's and the student's top-k tokens barely overlap: the top-k losses compare "
                     "distributions on almost disjoint support (unstable, dominated by the tail bucket). A teacher "
                     "too far from the student (another tokenizer or chat template, another task), too high a "
                     "learning rate, or a teacher scoring misaligned positions (python -m rlframe.doctor: "
                     "live/teacher_self_kl)")


# ------------------------------------------------------------------------------------ signals of a step
def group_scores(batch) -> tuple[np.ndarray, np.ndarray]:
    """(each response's score: the sum of its token-level scores [N], its prompt's uid [N])."""
    return (batch.batch["token_level_scores"].sum(-1).double().numpy(), np.asarray(batch.non_tensor_batch["uid"]))


def zero_variance_share(scores: np.ndarray, uids: np.ndarray) -> float:
    """The share of prompts (uids) whose responses all have the same score (groups of one count as such)."""
    groups: dict = {}
    for score, uid in zip(scores.tolist(), uids.tolist()):
        groups.setdefault(uid, []).append(score)
    if not groups:
        return 0.0
    return sum(max(g) - min(g) == 0 for g in groups.values()) / len(groups)


def step_signals(batch) -> dict[str, float]:
    """What the gates read that a step does not log otherwise: reward/zero_variance_groups, reward/score_std
    and rollout/sampled_nll (the sampled tokens' mean -log p under the engine: an estimate of the entropy per token)."""
    scores, uids = group_scores(batch)
    signals = {"reward/zero_variance_groups": zero_variance_share(scores, uids),
               "reward/score_std": float(scores.std())}
    if "rollout_log_probs" in batch:
        mask = batch.batch["response_mask"]
        nll = -(batch.batch["rollout_log_probs"] * mask).sum() / mask.sum().clamp(min=1)
        signals["rollout/sampled_nll"] = float(nll)
    return signals


def logprob_gap_threshold(config: GatesConfig, dtype: str) -> float:
    """The configured threshold of the run's dtype ("float32", "bfloat16", ...; the largest given when unknown)."""
    thresholds = dict(config.logprob_gap_max)
    return float(thresholds.get(dtype, max(thresholds.values(), default=0.05)))


def run_dtype(model_dtype: str, on_gpu: bool) -> str:
    """The dtype the trainer and the engine compute in: model.dtype, or (auto) bf16 on GPU, fp32 on CPU."""
    return model_dtype if model_dtype != "auto" else ("bfloat16" if on_gpu else "float32")


# ------------------------------------------------------------------------------------ the gates of a run
FIRED_KEPT = 64  # events Gates.fired keeps in memory (the doctor's one step fires at most one per gate)


class Gates:
    """Runs every enabled rule after each step; keeps the few steps of history the rules need."""

    def __init__(self, config: GatesConfig, dtype: str, run_dir: Path | None):
        self.config, self.run_dir, self.dtype = config, run_dir, dtype
        self.gap_threshold = logprob_gap_threshold(config, dtype)
        longest = max(config.zero_variance_window, config.constant_reward_steps, config.entropy_collapse_steps,
                      config.topk_overlap_steps)
        self.shares: deque = deque(maxlen=longest)
        self.stds: deque = deque(maxlen=longest)
        self.entropies: deque = deque(maxlen=longest)
        self.overlaps: deque = deque(maxlen=longest)  # distill/topk_overlap (distillation runs only)
        self.first_entropy: float | None = None
        # the latest events (the doctor reads its one step's); every one is in <run_dir>/gates.jsonl. Bounded: a
        # gate that warns every step of a long run must not grow the driver (issue 44's soak: 2 events a step)
        self.fired: deque[GateEvent] = deque(maxlen=FIRED_KEPT)

    def evaluate(self, step: int, metrics: dict[str, float], sync_check: dict | None) -> dict[str, GateEvent | None]:
        """Each enabled gate's event (None: it held) for this step; updates the history."""
        c, m = self.config, metrics
        for key, history in (("reward/zero_variance_groups", self.shares), ("reward/score_std", self.stds),
                             ("distill/topk_overlap", self.overlaps)):
            if key in m:
                history.append(m[key])
        entropy = m.get("actor/entropy", m.get("rollout/sampled_nll"))
        if entropy is not None and math.isfinite(entropy):
            self.first_entropy = entropy if self.first_entropy is None else self.first_entropy
            self.entropies.append(entropy)
        rules = {
            "logprob_gap": lambda: logprob_gap_gate(step, m.get("rollout/logprob_abs_diff"), self.gap_threshold),
            "weight_sync": lambda: weight_sync_gate(step, sync_check),
            "zero_variance": lambda: zero_variance_gate(step, list(self.shares), c.zero_variance_max_share,
                                                        c.zero_variance_window),
            "constant_reward": lambda: constant_reward_gate(step, list(self.stds), c.constant_reward_steps),
            "entropy_collapse": lambda: entropy_collapse_gate(step, list(self.entropies), self.first_entropy,
                                                              c.entropy_min_ratio, c.entropy_collapse_steps),
            "non_finite_loss": lambda: non_finite_loss_gate(step, m),
            "topk_overlap": lambda: topk_overlap_gate(step, list(self.overlaps), c.topk_overlap_min, c.topk_overlap_steps),
        }
        if "distill/topk_overlap" not in m:  # a run without a teacher: the distillation gate is not one of its gates
            rules.pop("topk_overlap")
        return {name: rule() for name, rule in rules.items() if getattr(c, name) != "off"}

    def check(self, step: int, metrics: dict[str, float], sync_check: dict | None = None) -> dict[str, float]:
        """Evaluate, report what fired (log, gates.jsonl) and return gates/<name> metrics; a fired `stop`
        gate raises GateStopped after the others are reported."""
        events = self.evaluate(step, metrics, sync_check)
        stops = []
        for name, event in events.items():
            if event is None:
                continue
            event.action = getattr(self.config, name)
            self.fired.append(event)
            logger.warning("%s%s", event.message(), " -> stopping the run (trainer.gates." + name + "=stop)"
                           if event.action == "stop" else "")
            self.record(event)
            if event.action == "stop":
                stops.append(event)
        if stops:
            raise GateStopped("; ".join(event.message() for event in stops)
                              + f". To run on anyway: trainer.gates.{stops[0].name}=warn")
        return {f"gates/{name}": float(event is not None) for name, event in events.items()}

    def state_dict(self) -> dict:
        """The history the rules over several steps read (saved in a checkpoint: a resumed run fires as the
        uninterrupted one would)."""
        return {"shares": list(self.shares), "stds": list(self.stds), "entropies": list(self.entropies),
                "first_entropy": self.first_entropy, "overlaps": list(self.overlaps)}

    def load_state_dict(self, state: dict) -> None:
        self.shares.extend(state.get("shares", []))
        self.stds.extend(state.get("stds", []))
        self.entropies.extend(state.get("entropies", []))
        self.overlaps.extend(state.get("overlaps", []))
        self.first_entropy = state.get("first_entropy")

    def record(self, event: GateEvent) -> None:
        if self.run_dir is not None:
            with open(Path(self.run_dir) / "gates.jsonl", "a") as f:
                f.write(json.dumps(asdict(event)) + "\n")


def sync_check_metrics(check: dict | None) -> dict[str, float]:
    """A sync's checksum report (workers/weight_broadcast.py compare_checksums) as weight_sync/* metrics."""
    if not check:
        return {}
    return {"weight_sync/checksum_tensors": float(check.get("streamed", check["checked"])),
            "weight_sync/checksum_unequal": float(check["unequal"]),
            "weight_sync/engine_changed": float(check["engine_changed"]),
            "perf/weight_checksum_s": float(check.get("seconds", 0.0))}


__all__ = ["GateEvent", "GateStopped", "Gates", "constant_reward_gate", "entropy_collapse_gate", "logprob_gap_gate",
           "logprob_gap_threshold", "non_finite_loss_gate", "run_dtype", "step_signals", "sync_check_metrics",
           "topk_overlap_gate", "weight_sync_gate", "zero_variance_gate", "zero_variance_share"]
