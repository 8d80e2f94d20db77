"""A run directory has one owner (rlframe/trainer/run_dir.py) and retention never deletes what a run just wrote
(rlframe/trainer/checkpoint.py), on real folders and a real second process; no Ray, no model.

Issue 33, item 1 and 2: before, a run started at step 0 in a folder holding step_4/step_5 deleted its own new
checkpoints (retention kept the highest step numbers) and left `latest` naming a missing folder; a second run
with the default resume=auto and no checkpoints appended to metrics.jsonl ([1,2,1,2]); all checkpoints corrupt
restarted at step 0 and exited 0; a resume with another data.train_batch_size carried on; two processes ran in
one directory at once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from omegaconf import OmegaConf

from rlframe.config import RLConfig
from rlframe.trainer import checkpoint as ckpt
from rlframe.trainer import run_dir as rd


def _cfg(**trainer):
    cfg = RLConfig()
    for key, value in trainer.items():
        setattr(cfg.trainer, key, value)
    return cfg


def _save(run_dir, step, run_id, keep=2, cfg=None):
    """A checkpoint as the run loop writes one (the workers' files are stand-ins)."""
    tmp = ckpt.begin_save(run_dir, step)
    (tmp / "actor").mkdir()
    (tmp / "actor" / "model.safetensors").write_bytes(b"w" * 100)
    yaml = OmegaConf.to_yaml(OmegaConf.structured(cfg or _cfg()))
    return ckpt.finish_save(tmp, step, {"step": step}, yaml, keep=keep, run_id=run_id)


def _log_steps(run_dir, steps):
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.writelines(json.dumps({"step": step, "x": 1.0}) + "\n" for step in steps)


def _steps(folder):
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("step_"))


def test_retention_prunes_only_this_lineage_and_never_the_checkpoint_just_written(tmp_path):
    for step in (4, 5):
        _save(tmp_path, step, run_id="old")
    folder = ckpt.checkpoints_dir(tmp_path)
    for step in (1, 2, 3):  # a new lineage starting at step 0 in the same folder (keep 2)
        saved = _save(tmp_path, step, run_id="new")
        assert saved.path.is_dir(), f"step_{step} was deleted as soon as it was written"
        assert (folder / (folder / "latest").read_text().strip()).is_dir(), "latest names a missing folder"
    assert _steps(folder) == ["step_2", "step_3", "step_4", "step_5"]  # the old run's two are not ours to prune
    assert (folder / "latest").read_text().strip() == "step_3"
    assert ckpt.read_run_id(folder / "step_3") == "new" and ckpt.read_run_id(folder / "step_5") == "old"
    # a folder whose lineage cannot be read is left alone; keep=1 keeps only the newest of the lineage
    (folder / "step_4" / "manifest.json").unlink()
    _save(tmp_path, 6, run_id="old", keep=1)
    assert _steps(folder) == ["step_2", "step_3", "step_4", "step_6"]
    # re-saving an existing step replaces it (a restart), still never deleting it
    _save(tmp_path, 6, run_id="old", keep=1)
    assert (folder / "step_6" / "manifest.json").is_file() and not list(folder.glob(".replaced-*"))


def test_fresh_start_in_a_used_directory_is_refused_unless_moved_aside(tmp_path):
    _save(tmp_path, 4, run_id="old")
    _save(tmp_path, 5, run_id="old")
    _log_steps(tmp_path, range(6))
    (tmp_path / "summary.json").write_text("{}")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.parquet").write_text("rows")  # generated data stays: it regenerates the same
    with pytest.raises(rd.RunDirError) as refused:
        rd.plan_start(tmp_path, _cfg(resume="disable"))
    message = str(refused.value)
    for part in ("trainer.resume=disable", "step_4, step_5", "metrics.jsonl with steps 0..5", "summary.json",
                 "Fix: trainer.resume=auto", "trainer.fresh_start=move_aside", "another trainer.run_dir"):
        assert part in message, (part, message)
    assert len(message.splitlines()) < 12
    plan = rd.plan_start(tmp_path, _cfg(resume="disable", fresh_start="move_aside"))
    assert plan.resume_from is None and plan.run_id and "moved the earlier run's output" in plan.notes[0]
    [previous] = list((tmp_path / "previous").iterdir())
    assert _steps(previous / "checkpoints") == ["step_4", "step_5"]
    assert (previous / "metrics.jsonl").is_file() and (previous / "summary.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "previous"]
    assert (tmp_path / "data" / "train.parquet").is_file()
    assert rd.earlier_steps(tmp_path) == []  # now a fresh directory
    # a second move keeps the first (a new dated folder)
    _log_steps(tmp_path, [1])
    rd.plan_start(tmp_path, _cfg(resume="disable", fresh_start="move_aside"))
    assert len(list((tmp_path / "previous").iterdir())) == 2


def test_second_run_with_resume_auto_and_no_checkpoint_is_refused(tmp_path):
    """save_every=0 (the default): the first run left only its logs; appending would give steps [1,2,1,2]."""
    (tmp_path / "config.yaml").write_text("a: 1\n")
    assert rd.plan_start(tmp_path, _cfg()).resume_from is None  # a run that stopped before step 1: reusable
    _log_steps(tmp_path, [0, 1, 2])
    with pytest.raises(rd.RunDirError, match=r"trainer.resume=auto found no checkpoint(.|\n)*steps 0..2"):
        rd.plan_start(tmp_path, _cfg())


def test_checkpoints_exist_but_none_is_usable_is_an_error_naming_each(tmp_path, capsys):
    for step in (1, 2, 3):
        _save(tmp_path, step, run_id="r", keep=0)
    folder = ckpt.checkpoints_dir(tmp_path)
    (folder / "step_1" / "manifest.json").unlink()
    (folder / "step_2" / "actor" / "model.safetensors").write_bytes(b"w" * 10)
    (folder / "step_3" / "actor" / "model.safetensors").write_bytes(b"X" * 100)
    with pytest.raises(rd.RunDirError) as refused:
        rd.plan_start(tmp_path, _cfg())
    message = str(refused.value)
    assert "none is usable" in message
    assert "step_3: actor/model.safetensors does not match its sha256" in message
    assert "step_2: actor/model.safetensors has 10 bytes, the manifest says 100" in message
    assert "step_1: manifest.json is missing" in message
    assert "trainer.fresh_start=move_aside" in message
    out = capsys.readouterr().out
    assert "step_1 is not usable: manifest.json is missing (the save did not finish); and there is no older" in out
    plan = rd.plan_start(tmp_path, _cfg(fresh_start="move_aside"))
    assert plan.resume_from is None and not folder.exists()


def test_resume_with_a_changed_data_stream_is_refused_unless_confirmed(tmp_path):
    saved = _save(tmp_path, 2, run_id="r", cfg=_cfg(total_steps=4))
    cfg = _cfg(total_steps=8)
    cfg.data.train_batch_size, cfg.rollout.n, cfg.actor.optim.lr = 16, 3, 5e-4
    with pytest.raises(rd.RunDirError) as refused:
        rd.plan_start(tmp_path, cfg)
    message = str(refused.value)
    assert "data.train_batch_size: 8 -> 16" in message and f"rollout.n: {RLConfig().rollout.n} -> 3" in message
    assert "trainer.resume_allow_changes=[data.train_batch_size,rollout.n]" in message
    assert "total_steps" not in message and "lr" not in message.split("Fix")[0]
    cfg.trainer.resume_allow_changes = ["data.train_batch_size", "rollout.n"]
    plan = rd.plan_start(tmp_path, cfg)
    assert plan.resume_from.path == saved.path and plan.run_id == "r"  # the lineage continues
    [note] = plan.notes
    assert "trainer.total_steps 4 -> 8" in note and "actor.optim.lr" in note and "data.train_batch_size 8 -> 16" in note
    # harmless changes alone: a note, no refusal; the same config: nothing to say
    assert rd.plan_start(tmp_path, _cfg(total_steps=4, loggers=["console"])).notes
    assert rd.plan_start(tmp_path, _cfg(total_steps=4)).notes == []
    assert rd.is_data_stream("data.arithmetic.seed") and rd.is_data_stream("trainer.seed")
    assert rd.is_data_stream("sft.batch_size") and not rd.is_data_stream("data.val_max_samples")
    assert not rd.is_data_stream("trainer.total_steps")


def test_resume_from_an_older_checkpoint_beside_newer_ones_is_refused(tmp_path):
    older = _save(tmp_path, 2, run_id="r", keep=0)
    _save(tmp_path, 4, run_id="r", keep=0)
    with pytest.raises(rd.RunDirError, match="later checkpoints step_4"):
        rd.plan_start(tmp_path, _cfg(resume=str(older.path)))
    # a checkpoint from another directory starts this one anew: refused only when this one holds steps
    other = tmp_path / "other"
    plan = rd.plan_start(other, _cfg(resume=str(older.path)))
    assert plan.resume_from.step == 2 and plan.run_id == "r"


LOCKER = """
import sys, time
from rlframe.trainer.run_dir import RunDirLock
RunDirLock(sys.argv[1]).acquire()
print("locked", flush=True)
time.sleep(60)
"""


def test_a_second_owner_is_refused_naming_the_first_and_a_dead_ones_lock_is_taken_over(tmp_path):
    first = subprocess.Popen([sys.executable, "-c", LOCKER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert first.stdout.readline().strip() == "locked"
        lock = rd.RunDirLock(tmp_path)
        with pytest.raises(rd.RunDirError) as refused:
            lock.acquire()
        message = str(refused.value)
        assert f"is in use by another run: pid {first.pid} on host " in message
        assert "started 20" in message and " UTC" in message
        assert f"kill {first.pid}" in message and "trainer.run_dir=<another folder>" in message
        first.send_signal(signal.SIGKILL)  # a crash or SIGKILL: the kernel drops the lock with the process
        first.wait(timeout=10)
        note = lock.acquire()
        assert note and f"from pid {first.pid}" in note and "ended without releasing it" in note
        owner = json.loads((tmp_path / "owner.json").read_text())
        assert owner["pid"] == os.getpid() and owner["ended"] is None
        with pytest.raises(rd.RunDirError, match=f"pid {os.getpid()}"):  # this process, twice
            rd.RunDirLock(tmp_path).acquire()
        lock.release()
        assert json.loads((tmp_path / "owner.json").read_text())["ended"]
        again = rd.RunDirLock(tmp_path)
        assert again.acquire() is None  # a clean release leaves nothing to report
        again.release()
    finally:
        if first.poll() is None:
            first.kill()
        time.sleep(0)
