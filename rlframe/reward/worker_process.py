"""Calling a user reward function (its output checked) and the worker processes that run it, killable on a timeout.

`RewardManager` (manager.py) starts `WorkerProcess`es, sends them (function index, payload) tasks over a pipe
and reads (status, value) answers; a worker's stderr is teed so that a crash's last lines reach the error.
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
            reply = (task_id, True, call_reward(fns[fn_index], payload))
        except BaseException as exc:  # SystemExit from user code too
            reply = (task_id, False, format_exception(exc))
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


class WorkerProcess:
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
