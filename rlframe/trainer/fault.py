"""What the driver does when a worker fails: name the phase, dump stuck workers' stacks, restart.

- `annotate(error, phase, step, workers)`: a WorkerError / WorkerDied / WorkerTimeout gains the step
  and the phase of the loop it happened in (the controller already names role, rank, node, pid,
  method); `workers` is what `launch.start_workers` returned, asked for the group of the failing role.
- `dump_stacks(group, role, ranks)`: the Python stacks of workers past a deadline, by
  `py-spy dump --pid` when it can attach, else by SIGUSR1 (the workers install a faulthandler for
  it, see workers/faults.py). Only workers on this node can be reached this way.
- `RESTARTABLE`: the errors after which `trainer.max_restarts` tears the worker groups down and
  resumes from the latest checkpoint (a dead or stuck process; a Python exception in user code or
  a non-finite loss would recur, so it stops the run).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from rlframe.controller import WorkerDied, WorkerError, WorkerTimeout

logger = logging.getLogger(__name__)

RESTARTABLE = (WorkerDied, WorkerTimeout)


def annotate(error: WorkerError, phase: str, step: int | None, workers=None) -> WorkerError:
    """Prefix the error with where in the loop it happened; a timeout also gets the stuck stacks."""
    where = f"step {step}, phase '{phase}'" if step else f"phase '{phase}'"
    if getattr(error, "phase", None) is None:
        error.phase = phase
        error.step = step
        error.summary = f"[{where}] {error.summary}"
        if isinstance(error, WorkerTimeout) and workers is not None and error.role:
            stacks = dump_stacks(workers.group_of(error.role), error.role, error.ranks)
            if stacks:
                error.summary += "\n--- stacks of the ranks still running ---\n" + stacks
    return error


def dump_stacks(group, role: str, ranks: list[int], timeout_s: float = 20.0) -> str:
    """The current Python stacks of `ranks` (those running on this node), as text."""
    import ray

    here = ray.util.get_node_ip_address()
    parts = []
    for rank in ranks:
        info = group.rank_info(rank)
        header = f"== {info.describe(role)}"
        if info.pid is None or (info.node_ip and info.node_ip != here):
            parts.append(f"{header}: on another node; run `py-spy dump --pid {info.pid}` there")
            continue
        parts.append(f"{header}\n{_py_spy(info.pid, timeout_s) or _faulthandler(info.pid) or '(no stack available)'}")
    text = "\n".join(parts)
    logger.error("stacks of stuck workers:\n%s", text)
    return text


def _py_spy(pid: int, timeout_s: float) -> str | None:
    exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(exe).exists():
        return None
    try:
        out = subprocess.run([exe, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else None


def _faulthandler(pid: int, wait_s: float = 2.0) -> str | None:
    from rlframe.workers.faults import stack_dump_path

    path = stack_dump_path(pid)
    if not path.exists():
        return None
    before = path.stat().st_size
    try:
        os.kill(pid, signal.SIGUSR1)
    except OSError:
        return None
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and path.stat().st_size == before:
        time.sleep(0.1)
    time.sleep(0.2)  # let the handler finish writing
    with open(path) as f:
        f.seek(before)
        return f.read().strip() or None
