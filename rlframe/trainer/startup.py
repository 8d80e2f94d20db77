"""The start-up profile: where a run's time goes before its first step, and how long its exit takes.

    STARTUP.begin()                          # main() is entered: `imports` = the process's age now
    with STARTUP.phase("ray_init"): ...      # one named part of the start, timed
    STARTUP.add("spawn/colocated", 3.2)      # a part measured elsewhere (a worker group, inside a worker)
    STARTUP.finish()                         # step 1 starts now: `total` = the process's age
    STARTUP.metrics()                        # {"timing/startup/<part>": seconds, ...}, logged at step 0
    STARTUP.line()                           # "start-up 21.3 s: imports 3.1, config 0.4, ray_init 4.2, ..."

The parts on the driver run one after the other, so they add up to `total` less what no part names
(`other`); the worker groups' own parts (`spawn/<group>`, `init/<group>`, and inside a group's init the
slowest rank's `process_group`, `model_load`, `engine_init`, `build/<role>`; `weight_sync_init`) lie inside
the driver's `workers` part and are not added again. `exit` (the shutdown of the scorer, tracker, workers and Ray)
is measured by `exit_phase()` and written with the profile to <run_dir>/startup.json.

Pure bookkeeping: no Ray, no torch; one profile per process (`STARTUP`).
"""

from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager
from pathlib import Path

PREFIX = "timing/startup/"
# The driver's parts in the order a run passes them (what `line` and `other` add up).
DRIVER_PARTS = ("imports", "config", "prepare", "ray_init", "cluster_check", "driver_setup", "workers", "restore",
                "validation")


def process_age_s() -> float:
    """Seconds since this process started (Linux: /proc; elsewhere since this module was imported)."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = float(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.perf_counter() - _IMPORTED


_IMPORTED = time.perf_counter()


class StartupProfile:
    def __init__(self) -> None:
        self.parts: dict[str, float] = {}
        self.total: float | None = None
        self.exit: float | None = None

    def reset(self) -> None:
        self.__init__()

    def begin(self) -> None:
        """The driver's code starts: what the interpreter and the entry module's imports took."""
        self.reset()
        self.parts["imports"] = process_age_s()

    def add(self, name: str, seconds: float) -> None:
        self.parts[name] = self.parts.get(name, 0.0) + float(seconds)

    @contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - start)

    def finish(self) -> None:
        """Step 1 starts now (the first call wins: a restart's second start is not the run's start-up)."""
        if self.total is None:
            self.total = process_age_s()

    def metrics(self) -> dict[str, float]:
        out = {PREFIX + name: seconds for name, seconds in self.parts.items()}
        if self.total is not None:
            out[PREFIX + "total"] = self.total
            out[PREFIX + "other"] = max(0.0, self.total - sum(self.parts.get(p, 0.0) for p in DRIVER_PARTS))
        return out

    def line(self) -> str:
        return describe(self.metrics())

    @contextmanager
    def exit_phase(self, run_dir: Path | None):
        """Time the shutdown; then <run_dir>/startup.json holds the profile and `exit`."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.exit = time.perf_counter() - start
            if run_dir is not None and Path(run_dir).is_dir():
                write_profile(Path(run_dir), {**self.metrics(), PREFIX + "exit": self.exit})


def describe(metrics: dict[str, float]) -> str:
    """One line from a step-0 record: the total, the driver's parts in order (the worker groups' parts in brackets)."""
    parts = {k.removeprefix(PREFIX): v for k, v in metrics.items() if k.startswith(PREFIX)}
    inner = {k: v for k, v in parts.items() if k not in (*DRIVER_PARTS, "total", "other", "exit")}
    shown = []
    for name in DRIVER_PARTS:
        if name in parts:
            text = f"{name} {parts[name]:.1f}"
            if name == "workers" and inner:
                text += " (" + ", ".join(f"{k} {v:.1f}" for k, v in inner.items()) + ")"
            shown.append(text)
    total = f"{parts['total']:.1f} s" if "total" in parts else "(no step started)"
    return f"start-up {total}: " + ", ".join(shown)


def write_profile(run_dir: Path, metrics: dict[str, float]) -> None:
    (run_dir / "startup.json").write_text(json.dumps({k.removeprefix(PREFIX): round(v, 3) for k, v in metrics.items()},
                                                     indent=1))


def worker_group_parts(group: str, spawn_s: float, init_s: float, per_rank: list[dict[str, float]]) -> dict[str, float]:
    """A worker group's parts: its spawn and init wall times, and the slowest rank's own parts of the init."""
    out = {f"spawn/{group}": spawn_s, f"init/{group}": init_s}
    for key in sorted({k for rank in per_rank for k in rank}):
        out[f"{key}/{group}"] = max(rank.get(key, 0.0) for rank in per_rank)
    return out


STARTUP = StartupProfile()
