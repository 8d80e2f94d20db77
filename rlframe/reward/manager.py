"""Run user reward functions on a batch of responses: routing, weights, timeouts (the processes: worker_process.py).

    manager = RewardManager([RewardSpec("reward_fns/math.py")], num_workers=2, timeout_s=10)
    result = manager.score(responses, ground_truths, data_sources, extra_infos)
    result.scores            # float64 [N], the reward of each response
    result.extras["acc"]     # per-sample extra keys the function returned (NaN / None where absent)
    result.metrics           # {"reward/score_mean": ..., "reward/failures": ..., ...}

Combining: every spec whose ``data_sources`` covers a row (``None`` covers every row) scores it,
and the row's reward is ``sum(weight * score)`` over those specs. A row that no spec covers is a
configuration error (``RewardError`` naming the data_source). With several specs, extra keys are
prefixed with the spec's label (the file stem, plus ``.name`` for a function not called
``compute_score``): ``math/acc``, ``math/score``.

Isolation: user code runs in ``num_workers`` worker processes (started with the "spawn" context,
which is safe in a driver that already runs threads, e.g. Ray's). Each per-sample call has
``timeout_s`` seconds; the whole batch has ``batch_timeout_s``. A worker that overruns is killed
(SIGKILL) and replaced, so a hung reward function costs one timeout, never the run. A batched
(``REWARD_TYPE = "batch"``) function gets its whole routed batch in one call, bounded by the batch
deadline. ``num_workers=0`` runs everything in the calling process: simplest to debug, but NO
timeout can be enforced there.

Containment (worker_process.py): each worker leads its own process group, SIGKILLed with it, so what a
reward function forks does not outlive it; what a worker prints reaches the driver's log up to
``max_output_bytes`` per batch. Before any of that, each reward file is imported once in a short-lived
child process with a deadline (``import_timeout_s``; loader.import_problem).

Failures: a function that raises, hangs, dies, or returns None / NaN / inf / a wrong type / a number
beyond float32 (the dtype rewards are trained in) gives that sample ``fallback_score``; it is counted in ``reward/failures`` (``reward/timeouts`` for the
timeouts), its message is kept in ``RewardResult.failures``, and the first failure of each
function is logged once in full (input, truncated, and traceback). With ``fail_fast=True`` the
first failure raises ``RewardError`` with that message instead.
"""

from __future__ import annotations

import logging
import math
import multiprocessing as mp
import numbers
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import wait as wait_for_handles
from pathlib import Path
from typing import Any

import numpy as np

from rlframe.reward.loader import (BATCH, IMPORT_TIMEOUT_S, SEQUENTIAL, RewardFunction, RewardLoadError,
                                   import_problem, load_reward_function, split_path_name)
from rlframe.reward.worker_process import (FLOAT32_MAX, MAX_OUTPUT_BYTES, START_FAILURE_HINT, WorkerProcess, call_reward,
                                           format_exception, truncate)

logger = logging.getLogger(__name__)

WORKER_STARTUP_TIMEOUT_S = 120.0  # a worker that is not ready by then means a broken environment


class RewardError(RuntimeError):
    """Scoring failed in a way the run should not continue from (fail_fast, routing, workers)."""


@dataclass
class RewardSpec:
    """One reward function: the file, the function in it, its weight, the data sources it scores
    (``None`` = every data source)."""

    path: str
    name: str = "compute_score"
    weight: float = 1.0
    data_sources: list[str] | None = None
    kwargs: dict | None = None  # extra keyword arguments on every call (verl's reward_kwargs)
    reward_type: str | None = None  # sample | sequential | batch; None: REWARD_TYPE, else the signature


@dataclass
class FunctionFailures:
    """One reward function's failures in one batch: rows failed of rows it scored, the first message."""

    label: str
    failed: int
    scored: int
    first_error: str | None = None


@dataclass
class RewardResult:
    scores: np.ndarray                                        # float64 [N]
    extras: dict[str, np.ndarray] = field(default_factory=dict)  # float (NaN) or object (None)
    metrics: dict[str, float] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    by_function: list[FunctionFailures] = field(default_factory=list)  # one per spec, in the specs' order


# ------------------------------------------------------------------ checking what users return


@dataclass
class _Task:
    spec_index: int
    rows: list[int]        # the batch rows this task scores (one row for a per-sample task)
    payload: Any
    timeout_s: float


# ------------------------------------------------------------------ the manager


def validate_reward_specs(specs: list[RewardSpec], *, allow_none: bool = False,
                          import_timeout_s: float = IMPORT_TIMEOUT_S) -> list[RewardFunction]:
    """Load every reward function in this (the driver) process, so that a bad file, a missing
    function or a bad weight is reported before any worker starts. Returns the loaded handles.

    Each file is first imported in a short-lived child process with the deadline `import_timeout_s`
    (loader.import_problem): an import that would end or hang this process is a RewardLoadError instead.
    `allow_none`: no spec at all is fine (an environment gives the whole reward)."""
    if not specs and not allow_none:
        raise RewardLoadError("no reward function configured: set `reward.functions`, e.g. "
                              "reward.functions=[{path: reward_fns/math.py}]")
    fns = []
    for i, spec in enumerate(specs):
        problem = import_problem(Path(split_path_name(spec.path, spec.name)[0]).expanduser().resolve(),
                                 import_timeout_s)
        if problem is not None:
            raise RewardLoadError(problem)
        if not isinstance(spec.weight, numbers.Real) or not math.isfinite(spec.weight):
            raise ValueError(f"reward spec {i} ({spec.path}): weight must be a finite number, "
                             f"got {spec.weight!r}")
        if spec.data_sources is not None and (
                isinstance(spec.data_sources, str) or len(spec.data_sources) == 0
                or not all(isinstance(s, str) for s in spec.data_sources)):
            raise ValueError(f"reward spec {i} ({spec.path}): data_sources must be a non-empty "
                             f"list of strings or None (all), got {spec.data_sources!r}")
        fns.append(load_reward_function(spec.path, spec.name, spec.kwargs, spec.reward_type))
    return fns


def _labels(specs: list[RewardSpec]) -> list[str]:
    labels: list[str] = []
    for spec in specs:
        label = Path(spec.path).stem
        if spec.name != "compute_score":
            label += f".{spec.name}"
        candidate, k = label, 2
        while candidate in labels:
            candidate, k = f"{label}#{k}", k + 1
        labels.append(candidate)
    return labels


class RewardManager:
    """Scores batches of responses with one or more reward functions; see the module docstring."""

    def __init__(self, specs: list[RewardSpec], *, num_workers: int = 2, timeout_s: float = 10.0,
                 batch_timeout_s: float = 300.0, fallback_score: float = 0.0,
                 fail_fast: bool = False, mp_context: str = "spawn", allow_no_functions: bool = False,
                 import_timeout_s: float = IMPORT_TIMEOUT_S, max_output_bytes: int = MAX_OUTPUT_BYTES):
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0 (0 = in-process), got {num_workers}")
        if timeout_s <= 0 or batch_timeout_s <= 0:
            raise ValueError("timeout_s and batch_timeout_s must be positive")
        self.specs = list(specs)
        self.fns = validate_reward_specs(self.specs, allow_none=allow_no_functions, import_timeout_s=import_timeout_s)
        self.labels = _labels(self.specs)
        self.num_workers = num_workers if self.specs else 0  # nothing to run: no worker processes
        self.max_output_bytes = int(max_output_bytes)
        self.timeout_s = float(timeout_s)
        self.batch_timeout_s = float(batch_timeout_s)
        self.fallback_score = float(fallback_score)
        self.fail_fast = fail_fast
        self._ctx = mp.get_context(mp_context)
        self._workers: list[WorkerProcess] = []
        self._logged_first_failure: set[str] = set()
        self._start_workers()  # they import the reward files while the caller does other setup

    # ---------------------------------------------------------------- pool

    def _start_workers(self) -> None:
        if self.num_workers > 0 and not self._workers:
            self._workers = [WorkerProcess(self._ctx, self.fns, i, self.max_output_bytes)
                             for i in range(self.num_workers)]

    def _replace(self, worker: WorkerProcess) -> None:
        worker.kill()
        i = self._workers.index(worker)
        self._workers[i] = WorkerProcess(self._ctx, self.fns, i, self.max_output_bytes)

    def close(self) -> None:
        """Stop the worker processes. The manager restarts them if used again."""
        for worker in self._workers:
            worker.stop()
        self._workers = []

    def __enter__(self) -> "RewardManager":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    # ---------------------------------------------------------------- scoring

    def score(self, responses: list[str], ground_truths: list, data_sources: list[str],
              extra_infos: list | None = None,
              response_lengths: list[int] | None = None) -> RewardResult:
        n = len(responses)
        extra_infos = list(extra_infos) if extra_infos is not None else [None] * n
        response_lengths = (list(response_lengths) if response_lengths is not None
                            else [None] * n)
        for name, values in (("ground_truths", ground_truths), ("data_sources", data_sources),
                             ("extra_infos", extra_infos), ("response_lengths", response_lengths)):
            if len(values) != n:
                raise ValueError(f"{name} has {len(values)} entries for {n} responses")
        data_sources = [str(ds) for ds in data_sources]
        if not self.specs:  # no rule-based reward (an environment gives it): every score is 0
            return RewardResult(scores=np.zeros(n), metrics={"reward/score_mean": 0.0, "reward/failures": 0.0,
                                                             "reward/timeouts": 0.0})

        routes = self._route(data_sources)
        tasks = self._make_tasks(routes, responses, ground_truths, data_sources, extra_infos,
                                 response_lengths)
        if self.num_workers == 0:
            outcomes = self._run_in_process(tasks)
        else:
            outcomes = self._run_in_pool(tasks)
        return self._assemble(n, routes, tasks, outcomes, responses, ground_truths, data_sources)

    def _route(self, data_sources: list[str]) -> list[list[int]]:
        """For each spec, the rows it scores; every row must be covered by some spec."""
        routes = []
        for spec in self.specs:
            wanted = None if spec.data_sources is None else set(spec.data_sources)
            routes.append([i for i, ds in enumerate(data_sources) if wanted is None or ds in wanted])
        covered = set().union(*map(set, routes)) if routes else set()
        uncovered = sorted({data_sources[i] for i in range(len(data_sources)) if i not in covered})
        if uncovered:
            configured = {label: spec.data_sources for label, spec in zip(self.labels, self.specs)}
            raise RewardError(
                f"no reward function scores data_source {uncovered}; the reward functions cover "
                f"{configured}. Add the data source to a reward spec's `data_sources` (or set it "
                f"to null for all data sources)")
        return routes

    def _make_tasks(self, routes, responses, ground_truths, data_sources, extra_infos,
                    response_lengths) -> list[_Task]:
        tasks = []
        for k, (fn, rows) in enumerate(zip(self.fns, routes)):
            if not rows:
                continue
            if fn.kind in (BATCH, SEQUENTIAL):
                inputs = [{"response": responses[i], "response_length": response_lengths[i],
                           "ground_truth": ground_truths[i], "data_source": data_sources[i],
                           "extra_info": extra_infos[i]} for i in rows]
                if fn.kind == BATCH:
                    tasks.append(_Task(k, rows, inputs, self.batch_timeout_s))
                else:
                    tasks.extend(_Task(k, [i], item, self.timeout_s) for i, item in zip(rows, inputs))
            else:
                for i in rows:
                    payload = (data_sources[i], responses[i], ground_truths[i], extra_infos[i])
                    tasks.append(_Task(k, [i], payload, self.timeout_s))
        return tasks

    def _run_in_process(self, tasks: list[_Task]) -> list[tuple[str, Any]]:
        outcomes: list[tuple[str, Any] | None] = [None] * len(tasks)
        for t, task in enumerate(tasks):
            try:
                outcomes[t] = ("ok", call_reward(self.fns[task.spec_index], task.payload))
            except (Exception, SystemExit) as exc:
                outcomes[t] = ("error", format_exception(exc))
                if self.fail_fast:
                    break
        return [o if o is not None else ("skipped", "not run (fail_fast)") for o in outcomes]

    def _run_in_pool(self, tasks: list[_Task]) -> list[tuple[str, Any]]:
        """Feed the tasks to the workers; enforce the per-task and per-batch deadlines."""
        self._start_workers()
        for worker in self._workers:
            worker.output.new_batch()  # each worker may print max_output_bytes per batch into our log
        outcomes: list[tuple[str, Any] | None] = [None] * len(tasks)
        pending = deque(range(len(tasks)))
        batch_deadline = time.monotonic() + self.batch_timeout_s
        try:
            while True:
                now = time.monotonic()
                if now >= batch_deadline:
                    for worker in list(self._workers):
                        if worker.task is not None:
                            outcomes[worker.task] = (
                                "timeout", f"timed out: the batch deadline (batch_timeout_s="
                                           f"{self.batch_timeout_s}) passed while it ran")
                            self._replace(worker)
                    for t in pending:
                        outcomes[t] = ("timeout", f"timed out: not started before the batch "
                                                  f"deadline (batch_timeout_s={self.batch_timeout_s})")
                    break
                for worker in list(self._workers):
                    if worker.task is not None and now >= worker.deadline:
                        limit = tasks[worker.task].timeout_s
                        outcomes[worker.task] = ("timeout", f"timed out after {limit:g}s "
                                                            f"(the worker process was killed)")
                        self._replace(worker)
                    elif not worker.ready and now - worker.started_at > WORKER_STARTUP_TIMEOUT_S:
                        # Its "ready" may be waiting in the pipe: the driver was busy elsewhere since
                        # the pool started (workers start, validation generates) and read nothing.
                        self._receive(worker, outcomes)
                        if not worker.ready and worker in self._workers:
                            stderr = worker.stderr.text() if worker.process.exitcode is not None else ""
                            raise RewardError(f"a reward worker process did not start within "
                                              f"{WORKER_STARTUP_TIMEOUT_S:g}s"
                                              + (f"; its stderr:\n{stderr[-3000:]}" if stderr else "")
                                              + f"\n{START_FAILURE_HINT}")
                if self.fail_fast and any(o is not None and o[0] != "ok" for o in outcomes):
                    break
                for worker in list(self._workers):
                    if worker.ready and worker.task is None and pending:
                        t = pending.popleft()
                        task = tasks[t]
                        try:
                            worker.conn.send((t, task.spec_index, task.payload))
                        except OSError:  # the worker died since its last message
                            pending.appendleft(t)
                            self._replace(worker)
                            continue
                        worker.task = t
                        worker.deadline = min(now + task.timeout_s, batch_deadline)
                busy = [w for w in self._workers if w.task is not None]
                if not pending and not busy:
                    break
                waiting = [w for w in self._workers if w.task is not None or not w.ready]
                wake = min([batch_deadline] + [w.deadline for w in busy]
                           + [w.started_at + WORKER_STARTUP_TIMEOUT_S for w in waiting if not w.ready])
                handles = [w.conn for w in waiting] + [w.process.sentinel for w in waiting]
                ready = set(wait_for_handles(handles, timeout=max(0.0, wake - time.monotonic())))
                for worker in waiting:
                    if worker.conn in ready or worker.process.sentinel in ready:
                        self._receive(worker, outcomes)
        except BaseException:
            # The pool's state is unknown (e.g. Ctrl-C mid-batch): start afresh next time.
            for worker in self._workers:
                worker.kill()
            self._workers = []
            raise
        if self.fail_fast:  # tasks still in flight were abandoned: their workers must go
            for worker in list(self._workers):
                if worker.task is not None:
                    self._replace(worker)
        return [o if o is not None else ("skipped", "not run (fail_fast)") for o in outcomes]

    def _receive(self, worker: WorkerProcess, outcomes: list) -> None:
        """Read what a worker sent; a dead worker fails its task and is replaced."""
        try:
            while worker.conn.poll():
                message = worker.conn.recv()
                if message[0] == "ready":
                    worker.ready = True
                elif message[0] == "load_error":
                    raise RewardError(f"a reward worker process could not load the reward "
                                      f"functions (they loaded in the driver; is the worker's "
                                      f"environment different?):\n{message[1]}")
                else:
                    task_id, ok, result = message
                    if task_id == worker.task:
                        outcomes[task_id] = ("ok", result) if ok else ("error", result)
                        worker.task = None
        except (EOFError, OSError):
            pass
        if worker.process.exitcode is not None or worker.conn.closed:
            worker.process.join(timeout=1)
            if worker.task is not None:
                stderr = worker.stderr.text()
                outcomes[worker.task] = ("error", f"the reward worker process died (exit code "
                                                  f"{worker.process.exitcode}) while scoring"
                                         + (f"; its stderr ends:\n{stderr[-1500:]}" if stderr else ""))
            elif not worker.ready:
                stderr = worker.stderr.text()
                raise RewardError(f"a reward worker process exited while starting (exit code "
                                  f"{worker.process.exitcode}). Its stderr:\n"
                                  f"{stderr[-3000:] if stderr else '(nothing)'}\n{START_FAILURE_HINT}")
            self._replace(worker)

    # ---------------------------------------------------------------- results

    def _assemble(self, n, routes, tasks, outcomes, responses, ground_truths,
                  data_sources) -> RewardResult:
        num_specs = len(self.specs)
        per_spec = np.full((num_specs, n), np.nan)
        per_spec_extras: list[dict[str, list]] = [{} for _ in range(num_specs)]
        failures: list[str] = []
        num_timeouts = 0
        failed_rows: dict[int, set[int]] = {k: set() for k in range(num_specs)}
        first_error: dict[int, str] = {}

        def fail(k: int, row: int, message: str, kind: str) -> None:
            nonlocal num_timeouts
            per_spec[k, row] = self.fallback_score
            failed_rows[k].add(row)
            num_timeouts += kind == "timeout"
            label = self.labels[k]
            full = (f"reward function {label} ({self.specs[k].path}:{self.specs[k].name}) failed "
                    f"on row {row} (data_source={data_sources[row]!r}, ground_truth="
                    f"{truncate(repr(ground_truths[row]), 100)}, response="
                    f"{truncate(repr(responses[row]))}): {message}")
            failures.append(full)
            first_error.setdefault(k, full)
            if self.fail_fast:
                raise RewardError(full)
            if label not in self._logged_first_failure:
                self._logged_first_failure.add(label)
                logger.warning("%s\n(the first failure of each reward function is logged in full; "
                               "the others are counted in reward/failures; the sample gets "
                               "fallback_score=%s)", full, self.fallback_score)

        def record_extras(k: int, row: int, extras: dict) -> None:
            for key, value in extras.items():
                per_spec_extras[k].setdefault(key, [None] * n)[row] = value

        for task, (status, result) in zip(tasks, outcomes):
            k = task.spec_index
            if status == "ok" and self.fns[k].kind == BATCH:
                for row, (ok, value, extras) in zip(task.rows, result):
                    if ok:
                        per_spec[k, row] = value
                        record_extras(k, row, extras)
                    else:
                        fail(k, row, value, "error")
            elif status == "ok":
                score, extras = result
                per_spec[k, task.rows[0]] = score
                record_extras(k, task.rows[0], extras)
            elif status != "skipped":
                for row in task.rows:
                    fail(k, row, result, status)

        scores = np.zeros(n, dtype=np.float64)
        for k, rows in enumerate(routes):
            scores[rows] += self.specs[k].weight * per_spec[k, rows]
        overflow = np.flatnonzero(np.abs(scores) > FLOAT32_MAX)  # rewards are trained in float32
        for row in overflow:
            message = (f"the weighted sum of the reward functions' scores on row {row} is {scores[row]:g}, "
                       f"beyond float32 (the dtype rewards are trained in): it gets fallback_score="
                       f"{self.fallback_score}")
            failures.append(message)
            if self.fail_fast:
                raise RewardError(message)
            logger.warning(message)
            scores[row] = self.fallback_score

        prefix = num_specs > 1
        extras: dict[str, np.ndarray] = {}
        for k in range(num_specs):
            name = (lambda key: f"{self.labels[k]}/{key}") if prefix else (lambda key: key)
            if prefix:
                extras[name("score")] = per_spec[k].copy()
            for key, values in per_spec_extras[k].items():
                present = [v for v in values if v is not None]
                if all(isinstance(v, float) for v in present):
                    extras[name(key)] = np.array([np.nan if v is None else v for v in values],
                                                 dtype=np.float64)
                else:
                    column = np.empty(n, dtype=object)
                    column[:] = values
                    extras[name(key)] = column

        num_failures = len(failures)
        by_function = [FunctionFailures(label, len(failed_rows[k]), len(routes[k]), first_error.get(k))
                       for k, label in enumerate(self.labels)]
        metrics = {"reward/score_mean": float(scores.mean()) if n else 0.0,
                   "reward/failures": float(num_failures),
                   "reward/timeouts": float(num_timeouts)}
        for key, column in extras.items():
            if column.dtype == np.float64 and not np.isnan(column).all():
                metrics[f"reward/{key}_mean"] = float(np.nanmean(column))
        if prefix:
            for k, label in enumerate(self.labels):
                metrics[f"reward/{label}/failures"] = float(len(failed_rows[k]))
        if num_failures:
            logger.warning("reward: %d of %d scores failed (%d timeouts) and got fallback_score=%s",
                           num_failures, sum(len(r) for r in routes), num_timeouts,
                           self.fallback_score)
        return RewardResult(scores=scores, extras=extras, metrics=metrics, failures=failures, by_function=by_function)
