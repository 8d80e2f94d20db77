"""Run user reward functions on a batch of responses: routing, weights, worker processes, timeouts.

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

Failures: a function that raises, hangs, dies, or returns None / NaN / inf / a wrong type gives
that sample ``fallback_score``; it is counted in ``reward/failures`` (``reward/timeouts`` for the
timeouts), its message is kept in ``RewardResult.failures``, and the first failure of each
function is logged once in full (input, truncated, and traceback). With ``fail_fast=True`` the
first failure raises ``RewardError`` with that message instead.
"""

from __future__ import annotations

import logging
import math
import multiprocessing as mp
import numbers
import os
import signal
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import wait as wait_for_handles
from pathlib import Path
from typing import Any

import numpy as np

from rlframe.reward.loader import BATCH, SEQUENTIAL, RewardFunction, RewardLoadError, load_reward_function

logger = logging.getLogger(__name__)

WORKER_STARTUP_TIMEOUT_S = 120.0  # a worker that is not ready by then means a broken environment
MAX_INPUT_CHARS_IN_MESSAGES = 300


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
class RewardResult:
    scores: np.ndarray                                        # float64 [N]
    extras: dict[str, np.ndarray] = field(default_factory=dict)  # float (NaN) or object (None)
    metrics: dict[str, float] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)


# ------------------------------------------------------------------ checking what users return


class _BadOutput(ValueError):
    pass


def _as_score(value: Any, what: str) -> float:
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):  # numpy / torch scalars
        value = value.item()
    if isinstance(value, (bool, np.bool_)) or isinstance(value, numbers.Real):
        score = float(value)
        if not math.isfinite(score):
            raise _BadOutput(f"{what} is {score}, not a finite number")
        return score
    raise _BadOutput(f"{what} must be a finite number, got {type(value).__name__}: "
                     f"{_truncate(repr(value), 100)}")


def _as_extra(value: Any) -> float | str | None:
    """Extras travel back as floats (numbers, bools), strings or None."""
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        value = value.item()
    if isinstance(value, (bool, np.bool_)) or isinstance(value, numbers.Real):
        return float(value)
    if value is None or isinstance(value, str):
        return value
    return _truncate(repr(value), 200)


def _check_sample_output(out: Any, score_key: str = "score") -> tuple[float, dict]:
    if isinstance(out, dict):
        if score_key not in out:
            raise _BadOutput(f"returned a dict without a {score_key!r} key (keys: {sorted(out)})")
        extras = {str(k): _as_extra(v) for k, v in out.items() if k != score_key}
        return _as_score(out[score_key], f"{score_key!r}"), extras
    if out is None:
        raise _BadOutput("returned None (a missing `return`?)")
    return _as_score(out, "the returned score"), {}


def _check_batch_output(out: Any, n: int) -> list[tuple[bool, Any, dict]]:
    """Per item: (True, score, extras) or (False, message, {})."""
    if isinstance(out, np.ndarray):
        out = out.tolist()
    if not isinstance(out, (list, tuple)):
        raise _BadOutput(f"a batched reward function must return a list, got {type(out).__name__}")
    if len(out) != n:
        raise _BadOutput(f"returned {len(out)} results for {n} inputs")
    items = []
    for item in out:
        try:
            key = "overall" if isinstance(item, dict) and "score" not in item else "score"
            score, extras = _check_sample_output(item, score_key=key)
            items.append((True, score, extras))
        except _BadOutput as exc:
            items.append((False, str(exc), {}))
    return items


def _call_reward(fn: RewardFunction, payload: Any) -> Any:
    """Call the user's function on one task's payload and check what it returns."""
    if fn.kind == BATCH:
        return _check_batch_output(fn.score_inputs(payload), len(payload))
    if fn.kind == SEQUENTIAL:
        out = fn.score_inputs(payload)
        return _check_sample_output(out, "overall" if isinstance(out, dict) and "score" not in out else "score")
    data_source, response, ground_truth, extra_info = payload
    return _check_sample_output(fn.score_sample(data_source, response, ground_truth, extra_info))


def _format_exception(exc: BaseException) -> str:
    if isinstance(exc, _BadOutput):
        return str(exc)
    return f"raised {type(exc).__name__}: {exc}\n{traceback.format_exc()}"


# ------------------------------------------------------------------ worker processes


def _worker_main(conn, fns: list[RewardFunction]) -> None:
    """Loop of a reward worker process: receive (task_id, fn_index, payload), send back
    (task_id, ok, result_or_message)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's business
    try:
        for fn in fns:
            fn.load()
    except BaseException:
        conn.send(("load_error", traceback.format_exc()))
        return
    conn.send(("ready", None))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return  # the driver went away
        if message is None:
            return
        task_id, fn_index, payload = message
        try:
            reply = (task_id, True, _call_reward(fns[fn_index], payload))
        except BaseException as exc:  # SystemExit from user code too
            reply = (task_id, False, _format_exception(exc))
        try:
            conn.send(reply)
        except Exception:
            conn.send((task_id, False, f"could not send the result back:\n{traceback.format_exc()}"))


class _StderrTail:
    """The last bytes a worker process wrote to stderr (it is also passed on to ours)."""

    LIMIT = 8192

    def __init__(self):
        self.data = bytearray()
        self.done = threading.Event()

    def text(self) -> str:
        self.done.wait(timeout=2)  # let the pump read what the dead process left in the pipe
        return self.data.decode("utf-8", errors="replace").strip()


def _start_with_stderr_tee(process) -> _StderrTail:
    """Start `process` with its stderr through a pipe: copied to our stderr, the tail kept for errors."""
    tail = _StderrTail()
    try:
        sys.stderr.flush()
        read_end, write_end = os.pipe()
        saved = os.dup(2)
    except (OSError, ValueError):
        process.start()
        tail.done.set()
        return tail
    try:
        os.dup2(write_end, 2)  # the child inherits fd 2 at spawn
        process.start()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(write_end)

    def pump() -> None:
        try:
            while chunk := os.read(read_end, 4096):
                try:
                    os.write(2, chunk)
                except OSError:
                    pass
                tail.data += chunk
                del tail.data[:-_StderrTail.LIMIT]
        finally:
            os.close(read_end)
            tail.done.set()

    threading.Thread(target=pump, name="rlframe-reward-stderr", daemon=True).start()
    return tail


class _spawnable_main:
    """The spawn start method re-runs the driver's __main__ file in each worker; a driver read from
    stdin (`python - < x.py`, __file__ '<stdin>') has no such file, and the worker would die at start.
    The workers need nothing from __main__ (reward files are imported by path), so it is hidden then."""

    def __enter__(self):
        main = sys.modules.get("__main__")
        path = getattr(main, "__file__", None)
        self.hidden = None
        if main is not None and getattr(main, "__spec__", None) is None and path and not os.path.isfile(path):
            self.hidden = (main, path)
            del main.__file__
        return self

    def __exit__(self, *exc):
        if self.hidden:
            self.hidden[0].__file__ = self.hidden[1]


START_FAILURE_HINT = (
    "What to do: reward workers are started with the spawn method, which re-imports the driver's main "
    "script; run the driver as a script file whose top-level code is under `if __name__ == \"__main__\":`, "
    "make sure the worker can import your reward file's dependencies, or set reward.num_workers=0 to "
    "score inside the driver process (no timeouts then).")


class _Worker:
    def __init__(self, ctx, fns: list[RewardFunction], index: int):
        self.conn, child_conn = ctx.Pipe(duplex=True)
        self.process = ctx.Process(target=_worker_main, args=(child_conn, fns), daemon=True,
                                   name=f"rlframe-reward-worker-{index}")
        with _spawnable_main():
            self.stderr = _start_with_stderr_tee(self.process)
        child_conn.close()  # so that the worker's death reads as EOF here
        self.started_at = time.monotonic()
        self.ready = False
        self.task: int | None = None  # index of the task in flight
        self.deadline = math.inf

    def kill(self) -> None:
        try:
            self.process.kill()
            self.process.join(timeout=5)
        except Exception:  # already gone
            pass
        self.conn.close()

    def stop(self) -> None:
        try:
            self.conn.send(None)
        except Exception:
            pass
        self.process.join(timeout=2)
        if self.process.is_alive():
            self.kill()
        else:
            self.conn.close()


@dataclass
class _Task:
    spec_index: int
    rows: list[int]        # the batch rows this task scores (one row for a per-sample task)
    payload: Any
    timeout_s: float


# ------------------------------------------------------------------ the manager


def validate_reward_specs(specs: list[RewardSpec]) -> list[RewardFunction]:
    """Load every reward function in this (the driver) process, so that a bad file, a missing
    function or a bad weight is reported before any worker starts. Returns the loaded handles."""
    if not specs:
        raise RewardLoadError("no reward function configured: set `reward.functions`, e.g. "
                              "reward.functions=[{path: reward_fns/math.py}]")
    fns = []
    for i, spec in enumerate(specs):
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


def _truncate(text: str, limit: int = MAX_INPUT_CHARS_IN_MESSAGES) -> str:
    return text if len(text) <= limit else text[:limit] + f"... [{len(text) - limit} more chars]"


class RewardManager:
    """Scores batches of responses with one or more reward functions; see the module docstring."""

    def __init__(self, specs: list[RewardSpec], *, num_workers: int = 2, timeout_s: float = 10.0,
                 batch_timeout_s: float = 300.0, fallback_score: float = 0.0,
                 fail_fast: bool = False, mp_context: str = "spawn"):
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0 (0 = in-process), got {num_workers}")
        if timeout_s <= 0 or batch_timeout_s <= 0:
            raise ValueError("timeout_s and batch_timeout_s must be positive")
        self.specs = list(specs)
        self.fns = validate_reward_specs(self.specs)
        self.labels = _labels(self.specs)
        self.num_workers = num_workers
        self.timeout_s = float(timeout_s)
        self.batch_timeout_s = float(batch_timeout_s)
        self.fallback_score = float(fallback_score)
        self.fail_fast = fail_fast
        self._ctx = mp.get_context(mp_context)
        self._workers: list[_Worker] = []
        self._logged_first_failure: set[str] = set()
        self._start_workers()  # they import the reward files while the caller does other setup

    # ---------------------------------------------------------------- pool

    def _start_workers(self) -> None:
        if self.num_workers > 0 and not self._workers:
            self._workers = [_Worker(self._ctx, self.fns, i) for i in range(self.num_workers)]

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        i = self._workers.index(worker)
        self._workers[i] = _Worker(self._ctx, self.fns, i)

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
                outcomes[t] = ("ok", _call_reward(self.fns[task.spec_index], task.payload))
            except (Exception, SystemExit) as exc:
                outcomes[t] = ("error", _format_exception(exc))
                if self.fail_fast:
                    break
        return [o if o is not None else ("skipped", "not run (fail_fast)") for o in outcomes]

    def _run_in_pool(self, tasks: list[_Task]) -> list[tuple[str, Any]]:
        """Feed the tasks to the workers; enforce the per-task and per-batch deadlines."""
        self._start_workers()
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

    def _receive(self, worker: _Worker, outcomes: list) -> None:
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

        def fail(k: int, row: int, message: str, kind: str) -> None:
            nonlocal num_timeouts
            per_spec[k, row] = self.fallback_score
            failed_rows[k].add(row)
            num_timeouts += kind == "timeout"
            label = self.labels[k]
            full = (f"reward function {label} ({self.specs[k].path}:{self.specs[k].name}) failed "
                    f"on row {row} (data_source={data_sources[row]!r}, ground_truth="
                    f"{_truncate(repr(ground_truths[row]), 100)}, response="
                    f"{_truncate(repr(responses[row]))}): {message}")
            failures.append(full)
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
        return RewardResult(scores=scores, extras=extras, metrics=metrics, failures=failures)
