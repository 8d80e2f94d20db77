"""Who owns a run directory, and what a new run may do with what an earlier run left in it.

    plan = claim_run_dir(cfg, run_dir)       # rlframe/main.py, before anything is written in run_dir
    ...                                       # the run (RunLoop.plan_run reads the plan: planned(run_dir))
    release_run_dir(run_dir)                  # (or at exit; `with claim(cfg, run_dir):` does both)

1. The lock. `<run_dir>/.rlframe.lock` is held with `fcntl.lockf` for the life of the run and `owner.json`
   says by whom (pid, host, start time, command). A second run in the directory is refused, naming the
   first. The kernel drops the lock when its process ends however it ends (SIGKILL and crashes included),
   so a lock left by a dead run is free: the next run takes it over with a note naming the dead one. (A
   POSIX record lock is not inherited by forked children, so a reward worker outliving the driver does not
   keep the directory locked.)
2. The earlier run's output (`plan_start`). A run continues the directory's checkpoints (trainer.resume=auto
   finds the newest complete one), or it starts fresh; starting fresh where an earlier run left steps
   (checkpoints, metrics.jsonl lines) is refused unless trainer.fresh_start=move_aside, which first moves
   that output into `<run_dir>/previous/<UTC time>/`. Checkpoints that exist but none of which is usable are
   an error naming each folder and what is wrong with it (never a silent start from step 0).
3. The resumed settings (`resume_config_changes`). The checkpoint's config.yaml is compared with this run's
   config: a change to what the data stream is made of (the rows, their order, the batch, samples per
   prompt, seeds: DATA_STREAM) would re-interpret the saved sampler position and is refused unless named in
   trainer.resume_allow_changes; any other change (total_steps, lr, loggers, ...) is listed in a note.

Every refusal is a `RunDirError` whose text is the one-screen message (main prints it as `error: ...`).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import fcntl
import json
import os
import shlex
import socket
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from rlframe.trainer import checkpoint

LOCK_FILE = ".rlframe.lock"
OWNER_FILE = "owner.json"
PREVIOUS_DIR = "previous"
# What a run writes in its directory (moved aside together by trainer.fresh_start=move_aside). The
# generated data sets under data/ are left: the same settings regenerate the same rows.
RUN_OUTPUTS = ("checkpoints", "metrics.jsonl", "timeline.jsonl", "gates.jsonl", "*_samples.jsonl", "summary.json",
               "report.html", "hf_model", "config.yaml", "tensorboard", "wandb", "eval_checkpoints*", "data/pairs.jsonl",
               "logs", "*.log")
FRESH_START_MODES = ("refuse", "move_aside")


class RunDirError(RuntimeError):
    """The run directory cannot be used as asked; the text says why and how to fix it."""


# ------------------------------------------------------------------ 1. the lock


@dataclass
class Owner:
    """Who holds (or last held) a run directory, as owner.json records it."""

    pid: int
    host: str
    started: str  # UTC, "2026-12-01 14:02:03 UTC"
    command: str
    ended: str | None = None  # set when the run released the directory itself

    @classmethod
    def of_this_process(cls) -> Owner:
        return cls(pid=os.getpid(), host=socket.gethostname(), started=_utc_now(), command=current_command())

    @classmethod
    def read(cls, run_dir: Path) -> Owner | None:
        try:
            data = json.loads((Path(run_dir) / OWNER_FILE).read_text())
            return cls(**{k: data.get(k) for k in ("pid", "host", "started", "command", "ended")})
        except (OSError, ValueError, TypeError):
            return None

    def describe(self) -> str:
        return f"pid {self.pid} on host {self.host}, started {self.started} ({self.command})"


_HELD: dict[str, RunDirLock] = {}  # run directories this process holds (a POSIX lock does not stop its own process)


class RunDirLock:
    """The exclusive claim on one run directory; `acquire` raises RunDirError when another run holds it."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir).resolve()
        self.fd: int | None = None

    def acquire(self) -> str | None:
        """Take the lock and write owner.json; returns a note when a dead run's lock was taken over."""
        key = str(self.run_dir)
        if key in _HELD:
            raise RunDirError(busy_message(self.run_dir, Owner.read(self.run_dir)))
        self.run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise RunDirError(busy_message(self.run_dir, _read_owner_soon(self.run_dir))) from None
        self.fd = fd
        _HELD[key] = self
        previous = Owner.read(self.run_dir)
        _write_json(self.run_dir / OWNER_FILE, vars(Owner.of_this_process()))
        if previous is not None and previous.ended is None and previous.pid != os.getpid():
            return (f"took over {self.run_dir} from {previous.describe()}, which ended without releasing it "
                    "(killed or crashed); its checkpoints are checked below")
        return None

    def release(self) -> None:
        """Mark owner.json ended and drop the lock (also what the kernel does if this process dies)."""
        if self.fd is None:
            return
        owner = Owner.read(self.run_dir)
        if owner is not None and owner.pid == os.getpid():
            owner.ended = _utc_now()
            with contextlib.suppress(OSError):
                _write_json(self.run_dir / OWNER_FILE, vars(owner))
        fcntl.lockf(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        self.fd = None
        _HELD.pop(str(self.run_dir), None)


def busy_message(run_dir: Path, owner: Owner | None) -> str:
    who = owner.describe() if owner is not None else "a process whose owner.json could not be read"
    stop = (f"kill {owner.pid}" + ("" if owner.host == socket.gethostname() else f" on host {owner.host}")
            if owner is not None else f"fuser {run_dir / LOCK_FILE} names it")
    return (f"trainer.run_dir={run_dir} is in use by another run: {who}.\n"
            "Two runs in one directory overwrite each other's checkpoints, config.yaml and metrics.jsonl.\n"
            f"Fix: wait for that run to end (or stop it: {stop}), or give this run its own directory: "
            "trainer.run_dir=<another folder>")


def _read_owner_soon(run_dir: Path) -> Owner | None:
    """owner.json of the run that holds the lock (it writes it just after locking: wait a moment for it)."""
    for _ in range(20):
        owner = Owner.read(run_dir)
        if owner is not None and owner.ended is None:
            return owner
        time.sleep(0.05)
    return Owner.read(run_dir)


# ------------------------------------------------------------------ 2. the earlier run's output


def earlier_steps(run_dir: Path) -> list[str]:
    """What an earlier run left that a fresh start would mix with: its checkpoint folders and logged steps
    (empty when it stopped before its first step: a config.yaml and generated data alone do not count)."""
    run_dir = Path(run_dir)
    found = []
    folder = checkpoint.checkpoints_dir(run_dir)
    names = sorted((p.name for p in folder.iterdir() if p.is_dir() and (p.name.startswith(("step_", ".tmp-step_")))),
                   key=_step_order) if folder.is_dir() else []
    if names:
        found.append(f"checkpoints {', '.join(names)} in {folder}")
    steps = _logged_steps(run_dir / "metrics.jsonl")
    if steps:
        found.append(f"metrics.jsonl with steps {steps[0]}..{steps[-1]} ({len(steps)} lines)")
    if (run_dir / "summary.json").exists():
        found.append("summary.json (a finished run)")
    return found


def move_aside(run_dir: Path) -> Path:
    """Move the earlier run's output (RUN_OUTPUTS) into <run_dir>/previous/<UTC time>/; returns that folder."""
    run_dir = Path(run_dir)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    target = run_dir / PREVIOUS_DIR / stamp
    suffix = 1
    while target.exists():
        target, suffix = run_dir / PREVIOUS_DIR / f"{stamp}-{suffix}", suffix + 1
    for pattern in RUN_OUTPUTS:
        for path in sorted(run_dir.glob(pattern)):
            destination = target / path.relative_to(run_dir)
            destination.parent.mkdir(parents=True, exist_ok=True)
            os.replace(path, destination)
    return target


def fresh_start_refused(run_dir: Path, left: list[str], why: str) -> RunDirError:
    return RunDirError(
        f"trainer.run_dir={run_dir} already holds an earlier run's output and this run would start fresh ({why}):\n"
        + "".join(f"  - {item}\n" for item in left)
        + "Starting over there would mix both runs' metrics and checkpoints (retention would delete the new ones).\n"
        "Fix: trainer.resume=auto to continue that run, trainer.fresh_start=move_aside to move its output into "
        f"{Path(run_dir) / PREVIOUS_DIR}/<time>/ first, or another trainer.run_dir")


def none_usable(run_dir: Path, problems: list[tuple[checkpoint.Checkpoint, str]]) -> RunDirError:
    return RunDirError(
        f"trainer.resume=auto: {checkpoint.checkpoints_dir(run_dir)} holds checkpoints but none is usable:\n"
        + "".join(f"  - {ckpt.path.name}: {problem}\n" for ckpt, problem in problems)
        + "Fix: trainer.resume=<a complete step_N folder> (e.g. a copy from elsewhere), or "
        "trainer.fresh_start=move_aside to move them (and the run's logs) aside and start from step 0")


# ------------------------------------------------------------------ where this run starts


@dataclass
class StartPlan:
    """Where a run starts: the checkpoint it continues (None: step 0), its lineage, and the notes to print."""

    resume_from: checkpoint.Checkpoint | None
    run_id: str | None  # the lineage its checkpoints carry (retention prunes only these)
    notes: list[str] = field(default_factory=list)


def plan_start(run_dir: Path, cfg) -> StartPlan:
    """trainer.resume and trainer.fresh_start against what run_dir holds -> where this run starts.

    auto: the newest complete checkpoint (newer broken ones are reported and will be rewritten); none at all
    and no logged steps: a fresh start; checkpoints but none complete: an error. disable or a checkpoint from
    elsewhere: a fresh start of this directory, refused when it holds an earlier run's steps unless
    fresh_start=move_aside. A checkpoint of this directory with complete newer ones beside it is refused
    (continuing it would overwrite them)."""
    run_dir = Path(run_dir).resolve()
    t = cfg.trainer
    notes: list[str] = []
    if t.resume == "auto":
        existing = checkpoint.list_checkpoints(checkpoint.checkpoints_dir(run_dir))
        ckpt = checkpoint.find_latest_complete(run_dir) if existing else None
        if existing and ckpt is None:
            if t.fresh_start != "move_aside":
                raise none_usable(run_dir, [(c, checkpoint.verify(c.path)) for c in existing])
            notes.append(f"no usable checkpoint; moved the earlier run's output to {move_aside(run_dir)} "
                         "(trainer.fresh_start=move_aside)")
        elif ckpt is None:
            notes += _fresh_start(run_dir, t.fresh_start, "trainer.resume=auto found no checkpoint")
    elif t.resume == "disable":
        ckpt = None
        notes += _fresh_start(run_dir, t.fresh_start, "trainer.resume=disable")
    else:
        ckpt = _explicit_checkpoint(t.resume, run_dir)
        if ckpt.path.resolve().parent == checkpoint.checkpoints_dir(run_dir):
            newer = [c.path.name for c in checkpoint.list_checkpoints(ckpt.path.parent)
                     if c.step > ckpt.step and checkpoint.verify(c.path, hashes=False) is None]
            if newer:
                raise RunDirError(
                    f"trainer.resume={t.resume}: {run_dir} also holds the later checkpoints {', '.join(newer)}, "
                    "which the resumed run would overwrite when it reaches their steps.\n"
                    "Fix: trainer.resume=auto to continue from the newest, or move the later ones out of "
                    f"{ckpt.path.parent} yourself first")
        else:  # a checkpoint from elsewhere starts this directory anew
            notes += _fresh_start(run_dir, t.fresh_start, f"trainer.resume={t.resume} is not in it")
    if ckpt is None:
        return StartPlan(None, new_run_id(), notes)
    notes += resume_config_changes(ckpt.path, cfg)
    return StartPlan(ckpt, checkpoint.read_run_id(ckpt.path), notes)


def _fresh_start(run_dir: Path, mode: str, why: str) -> list[str]:
    left = earlier_steps(run_dir)
    if not left:
        return []
    if mode != "move_aside":
        raise fresh_start_refused(run_dir, left, why)
    return [f"trainer.fresh_start=move_aside: moved the earlier run's output to {move_aside(run_dir)}"]


def _explicit_checkpoint(resume: str, run_dir: Path) -> checkpoint.Checkpoint:
    try:
        return checkpoint.resolve_resume(resume, run_dir)
    except checkpoint.CheckpointError as error:
        raise RunDirError(str(error)) from None


def new_run_id() -> str:
    """A fresh lineage: the UTC start time and a random suffix (readable in manifest.json)."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ-") + uuid.uuid4().hex[:6]


# ------------------------------------------------------------------ 3. the resumed settings

# What the data stream is made of: a change re-interprets the saved sampler position (other rows, another
# order, another batch or number of samples per prompt, other per-sample seeds). A key or a section prefix.
DATA_STREAM = (
    "stage", "data", "rollout.n", "trainer.seed",
    "pairs", "rft",
    *(f"{stage}.{key}" for stage in ("sft", "dpo", "rm", "pt") for key in ("batch_size", "max_length")),
    "sft.response_key", "sft.messages_key", "sft.loss_on", "dpo.chosen_key", "dpo.rejected_key", "dpo.pairs_file",
    "pt.text_key", "pt.val_fraction", "pt.generated_documents",
)
# data keys that touch only validation or generation length (not which training prompts come when)
NOT_DATA_STREAM = ("data.val_files", "data.val_max_samples", "data.max_response_length", "rft.val_every")
# Keys about this start itself, never compared.
START_KEYS = ("trainer.resume", "trainer.resume_allow_changes", "trainer.fresh_start", "trainer.run_dir")


def resume_config_changes(ckpt_path: Path, cfg) -> list[str]:
    """Compare the checkpoint's config.yaml with `cfg`: refuse unconfirmed data-stream changes, note the rest."""
    saved_file = Path(ckpt_path) / "config.yaml"
    if not saved_file.is_file():
        return [f"{ckpt_path} has no config.yaml: the settings could not be compared"]
    saved = flatten(OmegaConf.to_container(OmegaConf.load(saved_file)))
    current = flatten(OmegaConf.to_container(OmegaConf.structured(cfg)))
    changes = [(key, saved[key], current[key]) for key in sorted(saved.keys() & current.keys())
               if saved[key] != current[key] and not _matches(key, START_KEYS)]
    allowed = list(cfg.trainer.resume_allow_changes)
    refused = [c for c in changes if is_data_stream(c[0]) and not _matches(c[0], allowed)]
    if refused:
        keys = ",".join(key for key, _, _ in refused)
        raise RunDirError(
            f"resuming from {ckpt_path} with other data-stream settings than it was saved with:\n"
            + "".join(f"  - {key}: {_show(old)} -> {_show(new)}\n" for key, old, new in refused)
            + "The saved sampler position would then name other prompts (or batches, samples, seeds) than the "
            "ones the run trained on.\n"
            f"Fix: the saved values back, or confirm the change with trainer.resume_allow_changes=[{keys}], or start "
            "fresh in another trainer.run_dir")
    if not changes:
        return []
    shown = [f"{key} {_show(old)} -> {_show(new)}" for key, old, new in changes]
    return ["resumed with changed settings: " + "; ".join(shown[:12])
            + (f"; and {len(shown) - 12} more" if len(shown) > 12 else "")]


def is_data_stream(key: str) -> bool:
    return _matches(key, DATA_STREAM) and not _matches(key, NOT_DATA_STREAM)


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists are values (compared whole)."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def _matches(key: str, patterns) -> bool:
    return any(key == p or key.startswith(p + ".") for p in patterns)


def _show(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else value
    return text if len(text) <= 60 else text[:57] + "..."


# ------------------------------------------------------------------ the claim


_PLANS: dict[str, StartPlan] = {}  # run directory -> the plan claim() made (RunLoop.plan_run reads it)


def claim_run_dir(cfg, run_dir: Path) -> StartPlan:
    """Lock run_dir for this run, settle where it starts (plan_start) and print the notes.

    Call it before anything is written in run_dir (config.yaml included) and before Ray starts, so that a
    refusal is a one-screen error. Held until release_run_dir(run_dir) or the end of the process (atexit;
    after SIGKILL the kernel drops the lock). The run's trainer reads the plan through `planned(run_dir)`."""
    run_dir = Path(run_dir).resolve()
    if cfg.trainer.fresh_start not in FRESH_START_MODES:  # (also a config check; here for direct callers)
        raise RunDirError(f"trainer.fresh_start={cfg.trainer.fresh_start} is not one of {', '.join(FRESH_START_MODES)}")
    lock = RunDirLock(run_dir)
    note = lock.acquire()
    atexit.register(lock.release)
    try:
        if note:
            print(f"note: {note}", flush=True)
        plan = plan_start(run_dir, cfg)
    except BaseException:
        lock.release()
        raise
    for line in plan.notes:
        print(f"note: {line}", flush=True)
    _PLANS[str(run_dir)] = plan
    return plan


def release_run_dir(run_dir: Path) -> None:
    """Give run_dir up (owner.json marked ended); nothing when this process does not hold it."""
    key = str(Path(run_dir).resolve())
    _PLANS.pop(key, None)
    if key in _HELD:
        _HELD[key].release()


@contextlib.contextmanager
def claim(cfg, run_dir: Path) -> Iterator[StartPlan]:
    """claim_run_dir for the block, released after it."""
    plan = claim_run_dir(cfg, run_dir)
    try:
        yield plan
    finally:
        release_run_dir(run_dir)


def planned(run_dir: Path) -> StartPlan | None:
    """The plan claim_run_dir made for run_dir in this process (None: unclaimed, e.g. a trainer a test built)."""
    return _PLANS.get(str(Path(run_dir).resolve()))


# ------------------------------------------------------------------ helpers


def current_command() -> str:
    """This process's command line as a user would type it (python -m rlframe.main ...)."""
    argv = list(sys.argv)
    if argv and argv[0].endswith(("rlframe/main.py", "rlframe/__main__.py")) or (argv and argv[0] == "-m"):
        argv = ["-m", "rlframe.main", *argv[1:]]
    return " ".join(["python", *(shlex.quote(a) for a in argv)]) if argv else "python"


def _utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def _step_order(name: str) -> int:
    try:
        return int(name.rsplit("_", 1)[1])
    except (IndexError, ValueError):
        return -1


def _logged_steps(path: Path) -> list[int]:
    if not path.is_file():
        return []
    steps = []
    for line in path.read_text().splitlines():
        try:
            steps.append(int(json.loads(line)["step"]))
        except (ValueError, KeyError, TypeError):
            continue
    return steps
