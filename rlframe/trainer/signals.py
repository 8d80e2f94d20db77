"""SIGINT (Ctrl-C) and SIGTERM: a run stops at the next safe point, or at once on a second signal.

    with stop_signals():                    # rlframe/main.py, around the run (install() again after
        run(cfg)                            # ray.init, which replaces the SIGTERM handler)
    except Stopped as stop:                 # one line: step reached, last checkpoint, the resume command
        exit(stop.exit_code)                # 130 (SIGINT) / 143 (SIGTERM), the shell's 128 + signal number

The first signal prints a note and lets the current step finish; before the next step the run loop
(trainer/run_loop.py) saves a checkpoint of the finished step when checkpoints are on (trainer.save_every
> 0) and that step has none yet, then raises `Stopped`. A second signal raises `Stopped` at once wherever
the driver is (the previous checkpoint stays valid: saves are atomic); a third ends the process at once
(a shutdown that hangs). `Stopped` is a BaseException, so no `except Exception` on the way swallows it.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

SIGNALS = (signal.SIGINT, signal.SIGTERM)


@dataclass
class Progress:
    """What the run loop reports as it goes, for the closing line."""

    run_dir: Path | None = None
    step: int = 0  # the last finished step
    total_steps: int | None = None
    checkpoint: Path | None = None  # the newest checkpoint (saved or resumed from)
    save_every: int = 0


class Stopped(BaseException):
    """The run was stopped by a signal; `summary()` is its closing line, `exit_code` 128 + the signal."""

    def __init__(self, signum: int, at_once: bool):
        super().__init__(signal.Signals(signum).name)
        self.signum, self.at_once = signum, at_once

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    def summary(self) -> str:
        p = STOP.progress
        name = signal.Signals(self.signum).name
        how = (f"at once by a second {name} during step {p.step + 1}" if self.at_once else f"by {name}")
        of = f" of {p.total_steps}" if p.total_steps else ""
        line = f"stopped {how} after step {p.step}{of}; "
        if p.checkpoint is not None:
            return line + f"last checkpoint: {p.checkpoint}; resume: {resume_command(p.run_dir)}"
        why = "trainer.save_every=0" if not p.save_every else "none saved yet"
        return line + (f"no checkpoint ({why}): a rerun starts from step 0: "
                       f"{resume_command(p.run_dir, 'trainer.fresh_start=move_aside')}")


class StopRequests:
    """The process's one stop state: which signal came (if any), how often, and the run's progress."""

    def __init__(self):
        self.signum: int | None = None
        self.count = 0
        self.installed = False
        self.previous: dict[int, object] = {}
        self.progress = Progress()

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def handle(self, signum: int, frame) -> None:
        self.count += 1
        if self.count == 1:
            self.signum = signum
            _say(f"\n{signal.Signals(signum).name} received: stopping after step {self.progress.step + 1} "
                 "finishes (a checkpoint first when checkpoints are on); send it again to stop at once\n")
            return
        if self.count == 2:
            raise Stopped(self.signum or signum, at_once=True)
        _say(f"{signal.Signals(signum).name} again: exiting now\n")
        os._exit(128 + (self.signum or signum))

    def install(self) -> None:
        """Our handler for SIGINT and SIGTERM (again after anything that replaced it, such as ray.init).

        A signal the process was started ignoring stays ignored, as Python itself does for SIGINT (a
        shell starts background jobs so that the terminal's Ctrl-C does not reach them)."""
        for signum in SIGNALS:
            if not self.installed:
                self.previous[signum] = signal.getsignal(signum)
            if self.previous[signum] is not signal.SIG_IGN:
                signal.signal(signum, self.handle)
        self.installed = True

    def restore(self) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        self.__init__()

    def check(self) -> None:
        """At a safe point: raise Stopped when a signal came."""
        if self.signum is not None:
            raise Stopped(self.signum, at_once=False)


STOP = StopRequests()


@contextlib.contextmanager
def stop_signals() -> Iterator[StopRequests]:
    """Install the handlers for the block (main thread only), restore the previous ones after it."""
    STOP.install()
    try:
        yield STOP
    finally:
        STOP.restore()


def resume_command(run_dir: Path | None, *extra: str) -> str:
    """This process's command with trainer.run_dir pinned and trainer.resume left at auto (+ `extra`)."""
    args = [a for a in sys.argv[1:] if not a.lstrip("+").startswith(("trainer.run_dir=", "trainer.resume="))]
    if run_dir is not None:
        args.append(f"trainer.run_dir={run_dir}")
    args += [e for e in extra if e not in args]
    return " ".join(["python -m rlframe.main", *(shlex.quote(a) for a in args)])


def _say(text: str) -> None:
    """Write from a signal handler (print could re-enter a print the signal interrupted)."""
    with contextlib.suppress(OSError):
        os.write(sys.stdout.fileno(), text.encode())
