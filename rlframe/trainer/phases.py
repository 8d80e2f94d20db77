"""Phase timing and failure naming for the driver: how long each phase of a step took, and where a worker failed.

    clock = PhaseClock()
    with clock.timed("update"):            # timing/update; a WorkerError inside names the step and the phase
        actor.update_actor(batch)
    clock.record("rollout", start, end)    # a phase that ran elsewhere (a generation run ahead, the scoring thread)

Every phase's (start, end) of the current step goes to <run_dir>/timeline.jsonl (`write_timeline`), on one
clock counted from the driver's start; the run report draws it.
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from pathlib import Path

from rlframe.controller import WorkerError
from rlframe.trainer import fault


class PhaseClock:
    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.step = 0
        self.workers = None  # what launch.start_workers returned: a timeout dumps the stuck ranks' stacks
        self.times: dict[str, float] = {}  # phase -> seconds in the current step
        self.timeline: list[tuple[str, float, float]] = []  # (phase, start, end) of the current step

    def start_step(self, step: int) -> float:
        """Forget the previous step's phases; returns the step's start."""
        self.step, self.times, self.timeline = step, {}, []
        return time.perf_counter()

    @contextmanager
    def naming_failures(self, phase: str, step: int | None = None):
        """A worker's failure inside names the step (default: the current one) and the phase; a timeout also
        dumps the stuck stacks (fault.annotate)."""
        try:
            yield
        except WorkerError as error:
            raise fault.annotate(error, phase, self.step if step is None else step, self.workers)

    @contextmanager
    def timed(self, phase: str):
        start = time.perf_counter()
        with self.naming_failures(phase):
            yield
        self.record(phase, start, time.perf_counter())

    def record(self, phase: str, start: float, end: float) -> None:
        self.times[phase] = self.times.get(phase, 0.0) + end - start
        self.timeline.append((phase, start, end))

    def step_metrics(self, step_start: float) -> dict[str, float]:
        """timing/<phase> for each phase of the step, and timing/step (so far)."""
        metrics = {f"timing/{phase}": seconds for phase, seconds in self.times.items()}
        metrics["timing/step"] = time.perf_counter() - step_start
        return metrics

    def write_timeline(self, run_dir: Path, step: int, step_start: float) -> None:
        """<run_dir>/timeline.jsonl: the step's span and one row per phase, in seconds from the driver's start.
        With trainer.async_rollout a step's `rollout` began during the previous step."""
        with open(run_dir / "timeline.jsonl", "a") as f:
            for phase, start, end in [("step", step_start, time.perf_counter()), *self.timeline]:
                f.write(json.dumps({"step": step, "phase": phase, "start": round(start - self.started, 6),
                                    "end": round(end - self.started, 6)}) + "\n")
