"""The run loop every stage shares (RL, SFT, DPO, RM): steps, restarts, validation, metrics, checkpoints, close.

    start_step = restore(where the run starts)          # trainer/run_dir.py: plan_start; 0 for a fresh run
    validate() before training                          # step 0 of metrics.jsonl, + the start-up profile
    for step in start_step + 1 .. trainer.total_steps:
        (SIGINT/SIGTERM came: checkpoint, stop)         # trainer/signals.py: the safe point between steps
        metrics = train_step(step)                      # the stage's own step
        + timing/<phase>, timing/step (+ step_extras)   # trainer/phases.py
        + validate() every val_every steps and at the end
        log, timeline, checkpoint every trainer.save_every steps (and at the end)
    finish: summary.json, the exported model (trainer.export_hf), the run report

A dead or stuck worker restarts the workers and resumes from the latest complete checkpoint, up to
trainer.max_restarts times. A stage subclasses `RunLoop`, builds its data and calls `plan_run` (resume +
tracker) and `launch_workers`, and fills in the hooks below `# ---- the stage's part`.
"""

from __future__ import annotations

import json
import logging
import time
from contextlib import nullcontext
from pathlib import Path

from omegaconf import OmegaConf

from rlframe.config import RLConfig, to_container
from rlframe.trainer import checkpoint, fault
from rlframe.trainer.phases import PhaseClock
from rlframe.trainer.run_dir import plan_start, planned
from rlframe.trainer.signals import STOP
from rlframe.trainer.startup import STARTUP
from rlframe.trainer.tracking import Tracker
from rlframe.trainer.validation import validate_by_generation

logger = logging.getLogger(__name__)


class RunLoop:
    writes_report = False  # the HTML run report (rlframe/report.py) reads the RL metrics

    def __init__(self, cfg: RLConfig, model_path: str, tokenizer, run_dir: Path):
        self.cfg, self.model_path, self.tokenizer, self.run_dir = cfg, model_path, tokenizer, run_dir
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.clock = PhaseClock()
        self.first_val: dict[str, float] = {}  # step 0's validation
        self.last_metrics: dict[str, float] = {}
        self.setup_metrics: dict[str, float] = {}  # logged with step 0 (e.g. pair generation's statistics)
        self.scorer = None
        self.tracker: Tracker | None = None
        self.workers = None
        self.resume_from: checkpoint.Checkpoint | None = None
        self.run_id: str | None = None  # the lineage of this run's checkpoints (trainer/checkpoint.py: prune)
        self.last_checkpoint: checkpoint.Checkpoint | None = None  # saved or resumed from
        self._launching = None  # launch_workers_in_background: the start in flight (a Future of Workers)
        self._launch_started: float | None = None

    @property
    def step(self) -> int:
        return self.clock.step

    @property
    def actor_rollout(self):
        return self.workers.actor_rollout

    @property
    def ref(self):
        return self.workers.ref

    @property
    def critic(self):
        return self.workers.critic

    # ------------------------------------------------------------------ set-up, called by the stages
    def plan_run(self, total_steps: int) -> None:
        """The run's length, where it starts (the plan main's claim on run_dir made, trainer/run_dir.py; metrics
        logged after a resumed checkpoint are dropped) and its tracker."""
        cfg = self.cfg
        cfg.trainer.total_steps = total_steps
        plan = planned(self.run_dir) or plan_start(self.run_dir, cfg)
        self.resume_from, self.run_id = plan.resume_from, plan.run_id
        if self.resume_from is not None:
            checkpoint.trim_metrics_log(self.run_dir, self.resume_from.step)
        STOP.progress.run_dir, STOP.progress.total_steps = self.run_dir, total_steps
        STOP.progress.save_every = cfg.trainer.save_every
        self.tracker = Tracker(self.run_dir, list(cfg.trainer.loggers), cfg.trainer.project_name,
                               cfg.trainer.experiment_name, to_container(cfg), total_steps=total_steps)

    def launch_workers_in_background(self) -> None:
        """Start the workers in a thread while the stage's driver sets up the rest (its scorer, tracker, data
        state); the next `launch_workers` waits for them. Ray's calls are thread-safe, and no process is a child
        of the thread (Ray's raylet starts the workers)."""
        from concurrent.futures import ThreadPoolExecutor

        self._launch_started = time.perf_counter()
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="start-workers")
        self._launching = pool.submit(self.start_workers)
        pool.shutdown(wait=False)

    def abandon_launch(self) -> None:
        """The set-up failed while the workers started in the background: wait for them, then stop them."""
        launching, self._launching = self._launching, None
        if launching is not None:
            try:
                launching.result().shutdown()
            except BaseException:  # (their own failure: the set-up's error is the one to report)
                pass

    def launch_workers(self) -> None:
        first = self.workers is None  # a restart's second start is not the run's start-up
        launching, self._launching = self._launching, None
        start = self._launch_started if launching is not None else time.perf_counter()
        with self.clock.timed("init_workers"):
            self.workers = launching.result() if launching is not None else self.start_workers()
        if first:
            STARTUP.add("workers", time.perf_counter() - start)
            STARTUP.parts.update(getattr(self.workers, "startup_parts", dict)())
        self.clock.workers = self.workers
        self.workers_started()

    # ------------------------------------------------------------------ the loop
    def fit(self) -> dict:
        """Train from `resume_from` (or step 0); a dead or stuck worker restarts up to max_restarts times."""
        restarts = 0
        while True:
            try:
                with STARTUP.phase("restore") if self.resume_from is not None and not restarts else nullcontext():
                    start_step = self.restore(self.resume_from)
                return self.run(start_step=start_step)
            except fault.RESTARTABLE as error:
                if restarts >= self.cfg.trainer.max_restarts:
                    raise
                restarts += 1
                print(f"restart {restarts}/{self.cfg.trainer.max_restarts} after: {error.summary}", flush=True)
                self.workers.shutdown()
                self.launch_workers()
                self.resume_from = checkpoint.find_latest_complete(self.run_dir)
                # the steps after it run again: their lines go (before the first checkpoint, every line)
                self.tracker.rewind(self.resume_from.step if self.resume_from is not None else -1)

    def run(self, start_step: int) -> dict:
        cfg = self.cfg
        self.clock.step = start_step
        self.begin(start_step)
        if start_step == 0 and cfg.trainer.val_before_train and self.has_validation():
            with STARTUP.phase("validation"):
                self.first_val = {**self.validate(), **self.setup_metrics}
        startup = {}
        if STARTUP.total is None:  # this process's first start (not a restart's)
            STARTUP.finish()
            startup = STARTUP.metrics()
            print(STARTUP.line(), flush=True)
        if self.first_val and start_step == 0:  # step 0: the validation before training, with the start-up profile
            self.tracker.log(0, {**self.first_val, **startup})
            startup = {}
        for step in range(start_step + 1, cfg.trainer.total_steps + 1):
            if STOP.requested:  # a signal came: the safe point, before the next step
                self.stop_at_safe_point(step - 1)
            step_start = self.clock.start_step(step)
            metrics = self.train_step(step)
            metrics.update(self.clock.step_metrics(step_start))
            metrics.update(self.step_extras(metrics))
            metrics.update(startup)  # (no validation before training: the start-up profile goes with the first step)
            startup = {}
            if self.validation_due(step):
                metrics.update(self.validate())
            self.tracker.log(step, metrics)
            self.clock.write_timeline(self.run_dir, step, step_start)
            self.last_metrics = metrics
            if checkpoint.should_save(step, cfg.trainer.total_steps, cfg.trainer.save_every):
                self.save_checkpoint(step)
            STOP.progress.step = step
        self.end()
        return self.finish()

    def validation_due(self, step: int) -> bool:
        """Every `val_every` steps but the last, and at the last with trainer.val_at_end."""
        last = step == self.cfg.trainer.total_steps
        if last:
            return self.cfg.trainer.val_at_end and self.has_validation()
        return bool(self.val_every) and step % self.val_every == 0

    def save_checkpoint(self, step: int) -> None:
        state = {**self.driver_state(), "val_before": self.first_val, "last_metrics": self.last_metrics}
        t = self.cfg.trainer
        self.last_checkpoint = checkpoint.save_checkpoint(
            self.workers, self.run_dir, step, state, OmegaConf.to_yaml(OmegaConf.structured(self.cfg)),
            keep=t.max_checkpoints_to_keep, timeout_s=t.timeouts.update, run_id=self.run_id)
        STOP.progress.checkpoint = self.last_checkpoint.path

    def stop_at_safe_point(self, step: int) -> None:
        """A signal came (trainer/signals.py): save step `step` when checkpoints are on and it has none, then stop.

        Saving here means a resume loses no finished step; a second signal during the save stops at once and
        leaves the previous checkpoint (saves are atomic)."""
        saved = self.last_checkpoint is not None and self.last_checkpoint.step == step
        if self.cfg.trainer.save_every > 0 and step > 0 and not saved:
            print(f"saving a checkpoint of step {step} before stopping (signal again: stop at once without it)",
                  flush=True)
            self.save_checkpoint(step)
        STOP.check()

    def restore(self, ckpt: checkpoint.Checkpoint | None) -> int:
        """Load `ckpt` into the workers and the driver; returns the step to continue after (0: fresh)."""
        self.before_restore(ckpt)
        if ckpt is None:
            return 0
        state = checkpoint.restore_checkpoint(self.workers, ckpt, timeout_s=self.cfg.trainer.timeouts.init)
        self.last_checkpoint = ckpt
        STOP.progress.step, STOP.progress.checkpoint = ckpt.step, ckpt.path
        self.first_val, self.last_metrics = state["val_before"], state["last_metrics"]
        self.load_driver_state(state)
        return int(state["step"])

    def finish(self) -> dict:
        """summary.json (validation before/after, the exported model), and the run report."""
        summary = {"run_dir": str(self.run_dir), "val_before": self.first_val, "val_after": {
            k: v for k, v in self.last_metrics.items() if k.startswith("val/")}}
        if self.cfg.trainer.export_hf:
            export_dir = self.run_dir / "hf_model"
            self.export_model(export_dir)
            summary["hf_model"] = str(export_dir)
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        if self.writes_report:
            try:  # a failure here must not fail the run
                from rlframe.report import write_report

                print(f"report: {write_report(self.run_dir)}", flush=True)
            except Exception as error:
                logger.warning("could not write the run report: %s: %s", type(error).__name__, error)
        return summary

    def validate_by_generation(self) -> dict[str, float]:
        """Greedy responses to `self.val_set`, scored by `self.scorer` (trainer/validation.py); the first ones
        go to validation_samples.jsonl and the tracker."""
        metrics, samples = validate_by_generation(self.cfg, self.val_set, self.actor_rollout, self.scorer,
                                                  self.pad_token_id)
        self.write_samples("validation", samples)
        return metrics

    def write_samples(self, kind: str, samples: list[dict]) -> None:
        """<run_dir>/<kind>_samples.jsonl and the tracker: rows {response, ground_truth, score} of this step."""
        rows = [{"step": self.step, **sample} for sample in samples]
        with open(self.run_dir / f"{kind}_samples.jsonl", "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        self.tracker.log_samples(self.step, kind, rows)

    def close(self) -> None:
        if self.scorer is not None:
            self.scorer.close()
        if self.tracker is not None:
            self.tracker.close()
        if self.workers is not None:
            self.workers.shutdown()

    # ------------------------------------------------------------------ the stage's part
    def start_workers(self):
        """Start the stage's worker groups; returns what launch.start_workers returns (`Workers`)."""
        raise NotImplementedError

    def workers_started(self) -> None:
        """After every (re)start of the workers."""

    def train_step(self, step: int) -> dict[str, float]:
        """One step of training; its metrics."""
        raise NotImplementedError

    def validate(self) -> dict[str, float]:
        return {}

    def has_validation(self) -> bool:
        return True

    @property
    def val_every(self) -> int:
        return self.cfg.trainer.val_every

    def step_extras(self, metrics: dict[str, float]) -> dict[str, float]:
        """Metrics computed from a finished step's timing (throughput); none by default."""
        return {}

    def driver_state(self) -> dict:
        """What the driver saves in a checkpoint besides validation and the last metrics."""
        return {}

    def load_driver_state(self, state: dict) -> None:
        """Restore `driver_state` from a checkpoint's state."""

    def before_restore(self, ckpt: checkpoint.Checkpoint | None) -> None:
        """Before the workers load `ckpt` (None: a fresh start)."""

    def begin(self, start_step: int) -> None:
        """Before the first step of this attempt."""

    def end(self) -> None:
        """After the last step, before the summary."""

    def export_model(self, out: Path) -> None:
        """trainer.export_hf: the trained model as an HF folder."""
        self.actor_rollout.save_hf(str(out))
