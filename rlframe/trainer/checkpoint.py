"""Checkpoints of a run: atomic folders, a `latest` pointer, retention, and finding one to resume.

    <run_dir>/checkpoints/
        step_4/                      a complete checkpoint (it has a manifest.json)
            actor/model.safetensors  full (unsharded) weights, HF names  } written by the
            actor/optimizer.pt       full optimizer state (tensors only)  } actor workers
            actor/config.json ...    HF config + tokenizer (the folder loads in transformers)
            actor/rank_<r>.pt        LR scheduler, step counters, RNG states of rank r
            driver_state.json        step, sampler position, driver RNG, validation history
            config.yaml              the resolved config of the run
            manifest.json            every file above with its size and sha256; written last
        step_6/
        latest                       "step_6", replaced (os.replace) after step_6 is complete

A checkpoint is written into `.tmp-step_N/` and renamed to `step_N/` only when every file is on
disk and the manifest lists them, so a crash mid-save never leaves a folder that looks complete.
On resume every file is checked against the manifest (size and sha256): a truncated or corrupt
newest checkpoint is reported and the previous complete one is used instead (none at all: the run
refuses to start, rlframe/trainer/run_dir.py).

Each manifest names its run's lineage (`run_id`: set by a fresh start, inherited by every resume).
Retention (trainer.max_checkpoints_to_keep) deletes only older checkpoints of the lineage being
written, never the one just written, so `latest` always names a folder that exists.

Nothing here is loaded with pickle: weights are safetensors, other tensors go through
`torch.load(weights_only=True)`, the driver state is JSON.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from rlframe.rng import capture_rng_state, restore_rng_state  # noqa: F401  (re-exported)

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
DRIVER_STATE = "driver_state.json"
LATEST = "latest"
_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(RuntimeError):
    """No usable checkpoint where one was asked for (trainer.resume=<path>)."""


@dataclass
class Checkpoint:
    path: Path
    step: int


def checkpoints_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


# ------------------------------------------------------------------ writing


def begin_save(run_dir: Path, step: int) -> Path:
    """A fresh temporary folder for checkpoint `step` (a stale one from a crashed save is removed)."""
    tmp = checkpoints_dir(run_dir) / f".tmp-step_{step}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def finish_save(tmp: Path, step: int, driver_state: dict, config_yaml: str, keep: int,
                run_id: str | None = None) -> Checkpoint:
    """Add the driver state and manifest to `tmp`, rename it to `step_N`, point `latest` at it, prune.

    The workers have already written their files into `tmp`. `run_id`: the lineage (see prune).
    """
    (tmp / DRIVER_STATE).write_text(json.dumps(driver_state))
    (tmp / "config.yaml").write_text(config_yaml)
    files = {}
    for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
        _fsync(path)
        files[str(path.relative_to(tmp))] = {"bytes": path.stat().st_size, "sha256": _sha256(path)}
    manifest = tmp / MANIFEST
    manifest.write_text(json.dumps({"step": step, "complete": True, "run_id": run_id, "files": files}, indent=1))
    _fsync(manifest)
    final = tmp.parent / f"step_{step}"
    replaced = tmp.parent / f".replaced-step_{step}"
    if final.exists():  # a re-run of the same step (after a restart, or over a broken one): the new one wins
        shutil.rmtree(replaced, ignore_errors=True)
        os.replace(final, replaced)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    shutil.rmtree(replaced, ignore_errors=True)
    pointer = final.parent / f".{LATEST}.tmp"
    pointer.write_text(final.name + "\n")
    os.replace(pointer, final.parent / LATEST)
    prune(final.parent, keep, run_id=run_id, just_written=final)
    return Checkpoint(final, step)


def prune(directory: Path, keep: int, run_id: str | None = None, just_written: Path | None = None) -> list[Path]:
    """Delete the oldest checkpoints of lineage `run_id` beyond the newest `keep` (keep=0: keep all).

    Only folders whose manifest names `run_id` are candidates (another run's checkpoints, and broken
    folders whose lineage cannot be read, are left alone), and `just_written` is never deleted.
    Returns what was deleted."""
    if keep <= 0:
        return []
    mine = [c for c in list_checkpoints(directory) if _lineage(c.path) == (run_id,)]
    kept = 1 if just_written is not None else 0
    removed = []
    for ckpt in mine:
        if just_written is not None and ckpt.path.resolve() == Path(just_written).resolve():
            continue
        if kept < keep:
            kept += 1
            continue
        shutil.rmtree(ckpt.path, ignore_errors=True)
        removed.append(ckpt.path)
    return removed


def read_run_id(path: Path) -> str | None:
    """The lineage a checkpoint belongs to (None: written before lineages existed)."""
    lineage = _lineage(Path(path))
    return lineage[0] if lineage else None


def _lineage(path: Path) -> tuple[str | None] | tuple[()]:
    """(run_id,) from the manifest of `path`; () when the manifest cannot be read (lineage unknown)."""
    try:
        return (json.loads((path / MANIFEST).read_text()).get("run_id"),)
    except (OSError, ValueError, AttributeError):
        return ()


# ------------------------------------------------------------------ finding / checking


def list_checkpoints(directory: Path) -> list[Checkpoint]:
    """Every `step_N` folder (complete or not), newest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [Checkpoint(p, int(m.group(1))) for p in directory.iterdir()
             if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return sorted(found, key=lambda c: c.step, reverse=True)


def verify(path: Path, hashes: bool = True) -> str | None:
    """None when the checkpoint at `path` is complete and intact, else what is wrong with it."""
    path = Path(path)
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        return f"{manifest_path.name} is missing (the save did not finish)"
    try:
        manifest = json.loads(manifest_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        return f"{MANIFEST} is unreadable ({error})"
    if not manifest.get("complete"):
        return f"{MANIFEST} does not mark the checkpoint complete"
    for name, expected in manifest["files"].items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        size = file.stat().st_size
        if size != expected["bytes"]:
            return f"{name} has {size} bytes, the manifest says {expected['bytes']} (truncated?)"
        if hashes and _sha256(file) != expected["sha256"]:
            return f"{name} does not match its sha256 in the manifest (corrupt)"
    return None


def find_latest_complete(run_dir: Path) -> Checkpoint | None:
    """The newest complete checkpoint of the run; each newer broken one is reported and skipped."""
    found = list_checkpoints(checkpoints_dir(run_dir))
    for index, ckpt in enumerate(found):
        problem = verify(ckpt.path)
        if problem is None:
            return ckpt
        then = ("falling back to the previous complete checkpoint" if index + 1 < len(found)
                else "and there is no older checkpoint")
        message = f"checkpoint {ckpt.path} is not usable: {problem}; {then}"
        logger.warning(message)
        print(f"WARNING: {message}", flush=True)
    return None


def resolve_resume(resume: str, run_dir: Path) -> Checkpoint | None:
    """trainer.resume -> the checkpoint to start from (None: a fresh start)."""
    if resume == "disable":
        return None
    if resume == "auto":
        return find_latest_complete(run_dir)
    path = Path(resume)
    problem = verify(path)
    if problem is not None:
        raise CheckpointError(f"trainer.resume={resume}: {problem}. Fix: point it at a complete step_N "
                              "folder, or use trainer.resume=auto")
    state = read_driver_state(path)
    return Checkpoint(path, int(state["step"]))


def read_driver_state(path: Path) -> dict:
    return json.loads((Path(path) / DRIVER_STATE).read_text())


# ------------------------------------------------------------------ metrics


STEP_LOGS = ("metrics.jsonl", "timeline.jsonl")  # one JSON object per line, each with its "step"


def trim_metrics_log(run_dir: Path, step: int) -> int:
    """Drop the lines of metrics.jsonl and timeline.jsonl of steps after `step` (logged by a run that died
    before saving them), and a last line cut by the crash. The resumed run logs those steps again, so
    each file ends up with each step once. `step` -1: every line (a start from scratch logs step 0, the
    validation before training, again). Returns the number of metrics.jsonl lines dropped."""
    dropped = {}
    for name in STEP_LOGS:
        path = Path(run_dir) / name
        if not path.exists():
            continue
        lines = path.read_text().splitlines()
        kept = [line for line in lines if _step_of(line) is not None and _step_of(line) <= step]
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, path)
        dropped[name] = len(lines) - len(kept)
    return dropped.get("metrics.jsonl", 0)


def _step_of(line: str) -> int | None:
    """The step of one log line; None for a blank line or one a crash cut short."""
    try:
        return int(json.loads(line).get("step", 0)) if line.strip() else None
    except (json.JSONDecodeError, AttributeError, TypeError, ValueError):
        return None


# ------------------------------------------------------------------ helpers


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ------------------------------------------------------------------ the trainer's checkpoints


def should_save(step: int, total_steps: int, save_every: int) -> bool:
    """Every `save_every` steps and at the last step; never when save_every is 0."""
    return save_every > 0 and (step % save_every == 0 or step == total_steps)


def save_checkpoint(workers, run_dir: Path, step: int, driver_state: dict, config_yaml: str, keep: int,
                    timeout_s: float, run_id: str | None = None) -> Checkpoint:
    """The workers write their state (actor, critic), the driver its own; then the folder appears atomically.

    `workers`: what `rlframe.trainer.launch.start_workers` returned; `run_id`: the run's lineage.
    """
    import time

    start = time.perf_counter()
    tmp = begin_save(run_dir, step)
    workers.actor_rollout.save_checkpoint(str(tmp / "actor"), _timeout=timeout_s)
    if workers.critic is not None:
        workers.critic.save_checkpoint(str(tmp / "critic"), _timeout=timeout_s)
    ckpt = finish_save(tmp, step, {**driver_state, "step": step, "rng": capture_rng_state()}, config_yaml, keep=keep,
                       run_id=run_id)
    print(f"checkpoint {ckpt.path} saved in {time.perf_counter() - start:.2f}s", flush=True)
    return ckpt


def restore_checkpoint(workers, ckpt: Checkpoint, timeout_s: float) -> dict:
    """Load `ckpt` into the workers and restore the driver's RNG; returns the saved driver state."""
    import time

    start = time.perf_counter()
    workers.actor_rollout.load_checkpoint(str(ckpt.path / "actor"), _timeout=timeout_s)
    if workers.critic is not None:
        workers.critic.load_checkpoint(str(ckpt.path / "critic"), _timeout=timeout_s)
    state = read_driver_state(ckpt.path)
    restore_rng_state(state["rng"])
    print(f"resumed from {ckpt.path} (step {ckpt.step}) in {time.perf_counter() - start:.2f}s", flush=True)
    return state
