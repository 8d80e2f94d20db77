"""Launch, stop and resume runs as their own processes; the board keeps only a small registry of them.

    launcher = Launcher(workspace)
    launcher.launch(args, run_dir)     # python -m rlframe.main ARGS, in its own session, log to <ws>/logs/
    launcher.stop(run_dir)             # SIGTERM: the driver stops at the next safe point, keeping a checkpoint
    launcher.resume(run_dir)           # the same arguments into the same folder (trainer.resume=auto continues)

A run is its own process group (start_new_session): it survives the board and a closed browser tab, and
the board survives a crashed run. The driver turns SIGTERM into a clean stop (rlframe/trainer/signals.py):
the current step finishes, a checkpoint of it is saved when checkpoints are on, and it exits 143. Resuming
relaunches the recorded arguments into the same run folder: trainer.resume=auto continues from the newest
complete checkpoint (rlframe/trainer/run_dir.py); when the stopped run left logged steps but no checkpoint,
the relaunch adds trainer.fresh_start=move_aside, which moves that output into <run>/previous/<time>/
(nothing is deleted). A launch into a folder another run holds is refused before anything starts.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from rlframe.board.forms import command_line
from rlframe.board.preview import run_dir_problem
from rlframe.board.security import BoardError, checked_argv

REGISTRY = "board_runs.json"


@dataclass
class Launched:
    """What the board recorded of one launch (the registry keeps the last launch of each run folder)."""

    run_dir: str
    args: list[str]
    command: str
    log: str
    pid: int
    started: float
    entry: str = "rlframe.main"


class Launcher:
    """The board's processes: rlframe's entry points with checked arguments, never a shell."""

    def __init__(self, workspace: Path):
        self.workspace = Path(workspace).resolve()
        self.logs = self.workspace / "logs"
        self.procs: dict[str, subprocess.Popen] = {}
        self.lock = threading.Lock()

    # ---------------------------------------------------------------- the registry
    def registry(self) -> dict[str, Launched]:
        try:
            data = json.loads((self.workspace / REGISTRY).read_text())
        except (OSError, ValueError):
            return {}
        return {k: Launched(**v) for k, v in data.items()}

    def _record(self, launched: Launched) -> None:
        entries = {k: asdict(v) for k, v in self.registry().items()}
        entries[launched.run_dir] = asdict(launched)
        tmp = self.workspace / f".{REGISTRY}.tmp"
        tmp.write_text(json.dumps(entries, indent=1))
        os.replace(tmp, self.workspace / REGISTRY)

    def exit_codes(self) -> dict[str, int | None]:
        """{run folder: exit status} of the processes this board started (None while running)."""
        return {run_dir: proc.poll() for run_dir, proc in self.procs.items()}

    def alive(self, run_dir: str | Path) -> bool:
        proc = self.procs.get(str(Path(run_dir).resolve()))
        return proc is not None and proc.poll() is None

    def exit_code(self, run_dir: str | Path) -> int | None:
        proc = self.procs.get(str(Path(run_dir).resolve()))
        return None if proc is None else proc.poll()

    def log_of(self, run_dir: str | Path) -> Path | None:
        entry = self.registry().get(str(Path(run_dir).resolve()))
        if entry is not None:
            return Path(entry.log)
        driver = Path(run_dir) / "logs" / "driver.log"
        return driver if driver.exists() else None

    # ---------------------------------------------------------------- start, stop, resume
    def start(self, entry: str, args: list[str], log: Path, cwd: Path | None = None) -> subprocess.Popen:
        """Start an entry point (checked) with stdout+stderr to `log` (appended)."""
        argv = checked_argv(entry, args)
        log.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "RAY_USAGE_STATS_ENABLED": "0"}
        with open(log, "ab") as out:
            out.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} {command_line(args, entry)}\n".encode())
            out.flush()
            # its own session: it outlives the board, and a Ctrl-C in the board's terminal does not reach it
            # (the board stops it with SIGTERM)
            return subprocess.Popen(argv, cwd=cwd or Path.cwd(), env=env, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)

    def launch(self, args: list[str], run_dir: str | Path) -> Launched:
        """`python -m rlframe.main ARGS` into run_dir; BoardError when another run holds the folder."""
        run_dir = Path(run_dir).resolve()
        with self.lock:
            busy = run_dir_problem(run_dir)
            running = self.procs.get(str(run_dir))
            if busy or (running is not None and running.poll() is None):
                raise BoardError(busy or f"trainer.run_dir={run_dir} is in use by the run this board started "
                                          f"(pid {running.pid}). Fix: wait for it, stop it, or pick another run name")
            log = self.logs / f"{run_dir.name}.log"
            proc = self.start("rlframe.main", args, log)
            self.procs[str(run_dir)] = proc
            launched = Launched(str(run_dir), list(args), command_line(args), str(log), proc.pid, time.time())
            self._record(launched)
            return launched

    def stop(self, run_dir: str | Path) -> str:
        """SIGTERM to the run's driver (the clean stop); a second call sends it again (stop at once)."""
        run_dir = Path(run_dir).resolve()
        proc = self.procs.get(str(run_dir))
        pid = proc.pid if proc is not None and proc.poll() is None else self._owner_pid(run_dir)
        if pid is None:
            raise BoardError(f"{run_dir.name} is not running: nothing to stop")
        os.kill(pid, signal.SIGTERM)
        return (f"SIGTERM sent to pid {pid}: the run finishes its current step, saves a checkpoint (when "
                "trainer.save_every > 0) and stops; press stop again to stop at once")

    def _owner_pid(self, run_dir: Path) -> int | None:
        """The pid owner.json names, when that run still holds the folder (a run from a terminal, or an
        earlier board)."""
        if not run_dir_problem(run_dir):
            return None
        try:
            return int(json.loads((run_dir / "owner.json").read_text())["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def resume_args(self, run_dir: Path) -> list[str]:
        """The recorded arguments, with trainer.run_dir pinned (and fresh_start=move_aside when there is no
        checkpoint but logged steps, as the stopped run's own closing line advises)."""
        from rlframe.trainer.checkpoint import find_latest_complete
        from rlframe.trainer.run_dir import earlier_steps

        entry = self.registry().get(str(run_dir))
        if entry is None:
            raise BoardError(f"{run_dir.name} was not launched from this board workspace, so its arguments are not "
                             "recorded. Fix: resume it from the command line its stop message printed")
        args = [a for a in entry.args if not a.lstrip("+").startswith(("trainer.resume=", "trainer.fresh_start="))]
        if find_latest_complete(run_dir) is None and earlier_steps(run_dir):
            args.append("trainer.fresh_start=move_aside")
        return args

    def resume(self, run_dir: str | Path) -> Launched:
        run_dir = Path(run_dir).resolve()
        if (run_dir / "summary.json").exists():
            raise BoardError(f"{run_dir.name} finished: there is nothing to resume. Fix: raise trainer.total_steps "
                             "in a new launch into the same folder to train further")
        return self.launch(self.resume_args(run_dir), run_dir)

    def wait(self, run_dir: str | Path, timeout: float) -> int | None:
        proc = self.procs.get(str(Path(run_dir).resolve()))
        try:
            return None if proc is None else proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
