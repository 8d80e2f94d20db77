"""Fault injection (for tests) and on-demand stack dumps, inside worker processes.

Fault injection, explicit and off unless asked for:

    RLFRAME_FAULT_INJECT="update_actor:2"          # rank 0 kills itself (SIGKILL) in update_actor at step 2
    RLFRAME_FAULT_INJECT="generate_sequences:3:1"  # ... rank 1, in generate_sequences at step 3
    RLFRAME_FAULT_INJECT_ONCE=/tmp/fired           # optional marker: fire only if this file does not exist
                                                   # (created just before the kill), so a restarted run survives

Stack dumps: `install_stack_dump_handler()` makes SIGUSR1 write every thread's Python stack to
`stack_dump_path(pid)`; the driver sends the signal to a stuck worker and reads the file (the
fallback when `py-spy dump` may not attach).
"""

from __future__ import annotations

import faulthandler
import os
import signal
import tempfile
from pathlib import Path

FAULT_ENV = "RLFRAME_FAULT_INJECT"
FAULT_ONCE_ENV = "RLFRAME_FAULT_INJECT_ONCE"


def maybe_inject_fault(method: str, step: int, rank: int) -> None:
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    parts = spec.split(":")
    target_method, target_step = parts[0], int(parts[1])
    target_rank = int(parts[2]) if len(parts) > 2 else 0
    if (method, step, rank) != (target_method, target_step, target_rank):
        return
    marker = os.environ.get(FAULT_ONCE_ENV)
    if marker:
        if Path(marker).exists():
            return
        Path(marker).write_text(f"{method}:{step}:{rank} pid={os.getpid()}\n")
    print(f"{FAULT_ENV}: killing rank {rank} (pid {os.getpid()}) in {method} at step {step}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def stack_dump_path(pid: int) -> Path:
    return Path(tempfile.gettempdir()) / f"rlframe-stacks-{pid}.txt"


_dump_file = None


def install_stack_dump_handler() -> None:
    """SIGUSR1 -> all threads' stacks appended to stack_dump_path(os.getpid()). Idempotent."""
    global _dump_file
    if _dump_file is not None:
        return
    _dump_file = open(stack_dump_path(os.getpid()), "w")
    faulthandler.register(signal.SIGUSR1, file=_dump_file, all_threads=True, chain=False)
