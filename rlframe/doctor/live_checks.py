"""Doctor checks on the real workers of the configuration: one start, probe generations, one real RL step.

    trainer = RLTrainer(cfg, ...)                  # the run's own launch path (rlframe/trainer/launch.py)
    b1, b2 = probe(), probe()                       # same prompts, same seeds: same tokens (determinism)
    gap(b1)                                         # engine vs trainer log-probs at step 0
    checksums before; trainer.train_step(1)         # one real step: generate, score, update, weight sync
    checksums after, sync report; b3 = probe()      # the engine changed and equals the trainer; gap after the sync
    LoRA: b3 against the adapted and the base model # the adapter reached the engine
    teacher: on b1, teacher = student gives KL 0; the teacher backend agrees with an HF forward  (teacher_checks.py)
"""

from __future__ import annotations

import copy
import time
from pathlib import Path

import torch

from rlframe.config import RLConfig
from rlframe.config.gates import GATE_NAMES
from rlframe.doctor.result import CheckResult, failed, passed, skipped, warned
from rlframe.doctor.reward_checks import check_group_signal
from rlframe.trainer.gates import GateStopped, logprob_gap_threshold, run_dtype
from rlframe.workers.weight_broadcast import checksum_close

GROUP = "live"


def doctor_config(cfg: RLConfig, scratch: Path) -> RLConfig:
    """The run's configuration for the doctor's own short run in `scratch`: same workers and settings; its
    gates warn instead of stopping (the doctor reports them), nothing exported, no tracker but jsonl."""
    live = copy.deepcopy(cfg)
    live.trainer.run_dir, live.trainer.export_hf, live.trainer.loggers = str(scratch), False, ["jsonl"]
    live.trainer.resume, live.trainer.save_every, live.trainer.max_restarts = "disable", 0, 0
    gates = live.trainer.gates
    for name in GATE_NAMES:
        if getattr(gates, name) == "stop":
            setattr(gates, name, "warn")
    return live


def probe(trainer):
    """A batch of the run's prompts x rollout.n samples, generated as step 0 (no update follows: the engine keeps
    its weights), through the rollout source's own path."""
    rollouts = trainer.rollouts
    return rollouts.take_generation(rollouts.start_generation(0))


def gap(batch, log_probs: torch.Tensor) -> float:
    """Mean |rollout_log_probs - log_probs| over the response tokens."""
    mask = batch.batch["response_mask"].float()
    return float(((batch.batch["rollout_log_probs"] - log_probs).abs() * mask).sum() / mask.sum().clamp(min=1))


def check_determinism(first, second) -> CheckResult:
    a, b = first.batch["responses"], second.batch["responses"]
    rows = [i for i in range(len(a)) if not torch.equal(a[i], b[i])]
    if not rows:
        return passed(GROUP, "determinism", f"the same prompts and seeds gave the same {len(a)} responses twice")
    row = rows[0]
    column = int((a[row] != b[row]).nonzero()[0])
    return warned(GROUP, "determinism", f"{len(rows)} of {len(a)} responses differ between two generations with the "
                  f"same seeds (first: row {row}, token {column})", "a resumed or repeated run will not sample the same "
                  "tokens: rollout.seed_each_sample=true; on GPU, nondeterministic kernels (batch-size dependent)")


def check_gap(name: str, value: float, threshold: float, dtype: str, when: str) -> CheckResult:
    measured = f"mean |log p_engine - log p_trainer| = {value:.2e} {when} (threshold {threshold:g} for {dtype})"
    if value > threshold:
        return failed(GROUP, name, measured, "the engine samples another distribution than the trainer trains: "
                      "compare dtype, attention kernel and sampling options (temperature, top-p/top-k) of both")
    return passed(GROUP, name, measured)


def check_weight_sync(before: dict, after: dict, report: dict | None) -> CheckResult:
    """After the real step: the engine holds the trainer's tensors (every streamed one, checksums equal), and where
    the engine's own values can be read before and after (workers/weight_broadcast.py), the tensors the step moved
    moved on the engine too."""
    engine_before, engine_after, trainer_after = before["engine"], after["engine"], after["trainer"]
    unequal = [n for n in trainer_after if n not in engine_after or not checksum_close(trainer_after[n], engine_after[n])]
    trainer_moved = [n for n in trainer_after if n in before["trainer"]
                     and not checksum_close(trainer_after[n], before["trainer"][n])]
    comparable = [n for n in trainer_moved if n in engine_before and n in engine_after]
    moved = [n for n in comparable if not checksum_close(engine_after[n], engine_before[n])]
    measured = (f"after one optimizer step: {len(trainer_moved)} trainer tensors moved; of those read back from the "
                f"engine before and after, {len(moved)} of {len(comparable)} moved there too; {len(unequal)} of "
                f"{len(trainer_after)} streamed differ from the engine's")
    if report:
        measured += f" (the sync's own check: {report['unequal']} of {report.get('streamed', report['checked'])} unequal, " \
                    f"{report['seconds'] * 1000:.0f} ms)"
    if unequal or (comparable and not moved):
        first = unequal[0] if unequal else comparable[0]
        return failed(GROUP, "weight_sync", measured + f"; first: {first}", "the engine kept its old weights: the "
                      "sync did not reach it (a skipped load, a LoRA adapter not applied, names the engine does not map)")
    if not trainer_moved:
        return warned(GROUP, "weight_sync", measured, "the step did not move the weights (zero gradient or learning "
                      "rate?): nothing to prove the sync with")
    return passed(GROUP, "weight_sync", measured)


def check_lora(trainer, batch, threshold: float) -> CheckResult:
    """Under LoRA, after the step: the engine's log-probs are the adapted model's (the trainer's), not the base
    model's (the actor with its adapters disabled)."""
    adapted = trainer.actor_rollout.compute_log_prob(batch).batch["old_log_probs"]
    base = trainer.actor_rollout.compute_ref_log_prob(batch).batch["ref_log_prob"]
    to_adapted, to_base = gap(batch, adapted), gap(batch, base)
    measured = f"engine vs adapted model {to_adapted:.2e}, vs base model {to_base:.2e}"
    if to_adapted > threshold and to_adapted >= 0.5 * to_base:
        return failed(GROUP, "lora_adapter", measured + ": the engine samples the base model",
                      "the adapter (or the merged weights) never reached the engine: see live/weight_sync")
    if to_base <= threshold:
        return warned(GROUP, "lora_adapter", measured + ": one step moved the adapted model too little to tell",
                      "a larger actor.optim.lr, or judge from a later step's rollout/logprob_abs_diff")
    return passed(GROUP, "lora_adapter", measured)


def check_timing(cfg: RLConfig, metrics: dict, start_s: float) -> CheckResult:
    step_s = metrics.get("timing/step", 0.0)
    phases = sorted(((k[7:], v) for k, v in metrics.items() if k.startswith("timing/") and k != "timing/step"
                     and v >= 0.05 * step_s), key=lambda kv: -kv[1])
    total = cfg.trainer.total_steps
    eta = start_s + total * step_s
    return passed(GROUP, "timing", f"one step {step_s:.1f} s ({', '.join(f'{k} {v:.1f}' for k, v in phases)}); "
                                   f"workers start in {start_s:.0f} s; {total} steps ~ {eta / 60:.1f} min + validation")


def fired_gates(trainer) -> CheckResult:
    fired = trainer.gates.fired
    if not fired:
        return passed(GROUP, "gates", "no gate fired on the doctor's step")
    return failed(GROUP, "gates", "; ".join(event.message() for event in fired), "see the checks above")


def run_live_checks(cfg: RLConfig, model_path: str, tokenizer, train_files: list[str], val_files: list[str],
                    run_dir: Path) -> list[CheckResult]:
    """Start the configuration's workers once, probe them, run one real step; the results."""
    if cfg.stage != "rl":
        return [skipped(GROUP, "workers", f"stage={cfg.stage}: the live checks cover the RL stage")]
    from rlframe.main import init_ray
    from rlframe.trainer.rl_trainer import RLTrainer

    live = doctor_config(cfg, Path(run_dir) / "doctor")
    Path(live.trainer.run_dir).mkdir(parents=True, exist_ok=True)
    from rlframe.memory_plan import plans_gpu

    dtype = run_dtype(cfg.model.dtype, plans_gpu(cfg))
    threshold = logprob_gap_threshold(cfg.trainer.gates, dtype)
    init_ray(live, Path(live.trainer.run_dir))  # the quiet console: workers' output to <doctor run dir>/logs/
    start = time.perf_counter()
    trainer = RLTrainer(live, model_path, tokenizer, train_files, val_files, Path(live.trainer.run_dir))
    start_s = time.perf_counter() - start
    results = [passed(GROUP, "workers", f"started in {start_s:.0f} s")]
    try:
        results += probe_and_step(trainer, live, threshold, dtype, start_s)
    finally:
        trainer.close()
    return results


def probe_and_step(trainer, cfg: RLConfig, threshold: float, dtype: str, start_s: float) -> list[CheckResult]:
    """The sequence of the module's docstring, on a freshly started trainer (as RunLoop.run begins at step 0)."""
    results = []
    trainer.before_restore(None)
    trainer.begin(0)
    sampler = trainer.rollouts.sampler
    position = sampler.state_dict()
    first = probe(trainer)
    sampler.load_state_dict(position)
    trainer.rollouts.batches = sampler.forever()
    second = probe(trainer)
    results.append(check_determinism(first, second))
    old = trainer.actor_rollout.compute_log_prob(first).batch["old_log_probs"]
    results.append(check_gap("logprob_gap_step0", gap(first, old), threshold, dtype, "at step 0"))
    if trainer.workers.teacher is not None:  # before the step: the actor still holds the student's folder weights
        from rlframe.doctor.teacher_checks import run_teacher_checks

        results += run_teacher_checks(cfg, trainer, first, trainer.model_path, threshold, dtype)
    before = trainer.actor_rollout.weight_checksums()[0]
    step_start = trainer.clock.start_step(1)
    try:
        metrics = trainer.train_step(1)
    except GateStopped as error:  # (the doctor's gates warn; a user's custom stop still lands here)
        return results + [failed(GROUP, "step", str(error), "see the gate's cause")]
    metrics.update(trainer.clock.step_metrics(step_start))
    results.append(check_group_signal(trainer.trained_batch))
    after = trainer.actor_rollout.weight_checksums()[0]
    results.append(check_weight_sync(before, after, trainer.rollouts.last_sync_check))
    third = probe(trainer)
    new = trainer.actor_rollout.compute_log_prob(third).batch["old_log_probs"]
    results.append(check_gap("logprob_gap_after_sync", gap(third, new), threshold, dtype, "after the step's sync"))
    if cfg.model.lora.rank > 0:
        results.append(check_lora(trainer, third, threshold))
    else:
        results.append(skipped(GROUP, "lora_adapter", "model.lora.rank=0"))
    results.append(fired_gates(trainer))
    results.append(check_timing(cfg, metrics, start_s))
    return results
