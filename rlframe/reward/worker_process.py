"""Calling a user reward function (its output checked) and the worker processes that run it, killable on a timeout.

`RewardManager` (manager.py) starts `WorkerProcess`es, sends them (function index, payload) tasks over a pipe
and reads (status, value) answers.

Containment: a worker leads a process group of its own, and whatever a reward function forks stays in it:
the group is SIGKILLed when the worker stops, is replaced (a timeout) or loses the driver, so nothing a
reward starts outlives the run. A worker's stdout and stderr both go through a pipe: the driver passes on
at most `max_output_bytes` of it per worker per batch (then one line saying the rest is dropped) and keeps
the last bytes, so that a crash's last lines reach the error and a reward that prints megabytes cannot
flood the driver's log. A score must be finite in float32, the dtype rewards are trained in (1e39 is not).
"""

from __future__ import annotations

import math
import numbers
import os
import signal
import sys
import threading
import time
import traceback
from typing import Any

import numpy as np

from rlframe.reward.loader import BATCH, SEQUENTIAL, RewardFunction

MAX_INPUT_CHARS_IN_MESSAGES = 300
MAX_OUTPUT_BYTES = 64 << 10  # a worker's stdout + stderr passed on to the driver's log per batch
FLOAT32_MAX = float(np.finfo(np.float32).max)


def truncate(text: str, limit: int = MAX_INPUT_CHARS_IN_MESSAGES) -> str:
    return text if len(text) <= limit else text[:limit] + f"... [{len(text) - limit} more chars]"


class _BadOutput(ValueError):
    pass


def _as_score(value: Any, what: str) -> float:
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):  # numpy / torch scalars
        value = value.item()
    if isinstance(value, (bool, np.bool_)) or isinstance(value, numbers.Real):
        score = float(value)
        if not math.isfinite(score):
            raise _BadOutput(f"{what} is {score}, not a finite number")
        if abs(score) > FLOAT32_MAX:
            raise _BadOutput(f"{what} is {score:g}, beyond float32 (the dtype rewards are trained in, where it "
                             f"would be {'-' if score < 0 else ''}inf)")
        return score
    raise _BadOutput(f"{what} must be a finite number, got {type(value).__name__}: "
                     f"{truncate(repr(value), 100)}")


def _as_extra(value: Any) -> float | str | None:
    """Extras travel back as floats (numbers, bools), strings or None."""
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        value = value.item()
    if isinstance(value, (bool, np.bool_)) or isinstance(value, numbers.Real):
        return float(value)
    if value is None or isinstance(value, str):
        return value
    return truncate(repr(value), 200)


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


def call_reward(fn: RewardFunction, payload: Any) -> Any:
    """Call the user's function on one task's payload and check what it returns."""
    if fn.kind == BATCH:
        return _check_batch_output(fn.score_inputs(payload), len(payload))
    if fn.kind == SEQUENTIAL:
        out = fn.score_inputs(payload)
        return _check_sample_output(out, "overall" if isinstance(out, dict) and "score" not in out else "score")
    data_source, response, ground_truth, extra_info = payload
    return _check_sample_output(fn.score_sample(data_source, response, ground_truth, extra_info))


def format_exception(exc: BaseException) -> str:
    if isinstance(exc, _BadOutput):
        return str(exc)
    return f"raised {type(exc).__name__}: {exc}\n{traceback.format_exc()}"


# ------------------------------------------------------------------ worker processes


def _worker_main(conn, fns: list[RewardFunction]) -> None:
    """Loop of a reward worker process: receive (task_id, fn_index, payload), send back
    (task_id, ok, result_or_message)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's business
    os.setpgid(0, 0)  # a process group of our own: what the reward functions fork joins it
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
            _end_group()  # the driver went away
        if message is None:
            _end_group()
        task_id, fn_index, payload = message
        try:
            reply = (task_id, True, call_reward(fns[fn_index], payload))
        except BaseException as exc:  # SystemExit from user code too
            reply = (task_id, False, format_exception(exc))
        try:
            conn.send(reply)
        except Exception:
            conn.send((task_id, False, f"could not send the result back:\n{traceback.format_exc()}"))


def _end_group() -> None:
    """The worker's last act: SIGKILL its process group, itself and whatever its reward functions forked."""
    try:
        os.killpg(0, signal.SIGKILL)
    finally:
        os._exit(0)


class _Output:
    """What a worker process writes to stdout and stderr: passed on to the driver's stderr up to `limit`
    bytes per batch (`new_batch`), then dropped with one notice; the last bytes are kept for errors."""

    TAIL = 8192

    def __init__(self, name: str, limit: int):
        self.name, self.limit = name, limit
        self.data = bytearray()
        self.done = threading.Event()
        self.passed = 0  # bytes passed on in this batch
        self.dropped = 0

    def new_batch(self) -> None:
        self.passed = 0

    def take(self, chunk: bytes) -> None:
        room = self.limit - self.passed
        shown = chunk[:max(room, 0)]
        if shown:
            _write_stderr(shown)
        if len(chunk) > room and room >= 0:
            _write_stderr(f"\n[{self.name}: printed more than {self.limit} bytes in this batch; the rest of its "
                          f"output in this batch is dropped (reward.max_output_bytes)]\n".encode())
        self.passed += len(chunk)
        self.dropped += len(chunk) - len(shown)
        self.data += chunk
        del self.data[:-self.TAIL]

    def text(self) -> str:
        self.done.wait(timeout=2)  # let the pump read what the dead process left in the pipe
        return self.data.decode("utf-8", errors="replace").strip()


def _write_stderr(data: bytes) -> None:
    try:
        os.write(2, data)
    except OSError:
        pass


def _start_with_output_pipe(process, output: _Output) -> None:
    """Start `process` with its stdout and stderr through one pipe, read by a pump thread into `output`."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        read_end, write_end = os.pipe()
        saved = (os.dup(1), os.dup(2))
    except (OSError, ValueError):
        process.start()
        output.done.set()
        return
    try:
        os.dup2(write_end, 1)  # the child inherits fds 1 and 2 at spawn
        os.dup2(write_end, 2)
        process.start()
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])
        os.close(write_end)

    def pump() -> None:
        try:
            while chunk := os.read(read_end, 65536):
                output.take(chunk)
        finally:
            os.close(read_end)
            output.done.set()

    threading.Thread(target=pump, name="rlframe-reward-output", daemon=True).start()


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


class WorkerProcess:
    def __init__(self, ctx, fns: list[RewardFunction], index: int, max_output_bytes: int = MAX_OUTPUT_BYTES):
        self.conn, child_conn = ctx.Pipe(duplex=True)
        self.process = ctx.Process(target=_worker_main, args=(child_conn, fns), daemon=True,
                                   name=f"rlframe-reward-worker-{index}")
        self.output = _Output(f"reward worker {index}", max_output_bytes)
        with _spawnable_main():
            _start_with_output_pipe(self.process, self.output)
        child_conn.close()  # so that the worker's death reads as EOF here
        self.started_at = time.monotonic()
        self.ready = False
        self.task: int | None = None  # index of the task in flight
        self.deadline = math.inf

    @property
    def stderr(self) -> _Output:  # (its stdout and stderr together)
        return self.output

    def kill_group(self) -> None:
        """SIGKILL the worker's process group: what its reward functions forked (the worker too)."""
        if self.process.pid is not None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def kill(self) -> None:
        self.kill_group()
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
        self.kill_group()  # what it forked, had it not ended its group itself
        if self.process.is_alive():
            self.kill()
        else:
            self.conn.close()
