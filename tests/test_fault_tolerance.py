"""A worker process killed mid-step (SIGKILL, via RLFRAME_FAULT_INJECT, see workers/faults.py):

1. without restarts the driver stops within seconds, naming role, rank, node, step and phase;
2. the newest checkpoint is then truncated: auto-resume says so and falls back to the previous one;
3. with trainer.max_restarts=1 the same fault is survived: new worker groups, resume from the
   latest checkpoint, and the run finishes (here at world size 2, resuming a world-size-1 checkpoint).
"""

from __future__ import annotations

import json
import os
import time

from conftest import TINY_RUN_OVERRIDES, read_metrics, run_main
from test_checkpoint_resume import REWARD


def _args(model_dir, run_dir, *extra):
    return ["recipe=grpo_math", *TINY_RUN_OVERRIDES, f"model.path={model_dir}", f"trainer.run_dir={run_dir}", "rollout.engine=hf",
            "trainer.total_steps=4", "trainer.save_every=1", "trainer.max_checkpoints_to_keep=3",
            "trainer.val_before_train=false", "trainer.export_hf=false", f"reward.functions=[{{path:{REWARD}}}]",
            *extra]


def test_dead_worker_is_reported_then_survived_with_restarts(tmp_path, tiny_model_dir, monkeypatch):
    run_dir = tmp_path / "run"
    marker = tmp_path / "fired-1"
    monkeypatch.setenv("RLFRAME_FAULT_INJECT", "update_actor:3")
    monkeypatch.setenv("RLFRAME_FAULT_INJECT_ONCE", str(marker))
    result = run_main(_args(tiny_model_dir, run_dir), cwd=tmp_path)
    ended = time.time()
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert marker.exists(), output[-3000:]
    assert "worker process died while running actor_rollout.update_actor" in output
    assert "[step 3, phase 'update']" in output and "role='actor_rollout' rank=0 node=" in output
    assert ended - marker.stat().st_mtime < 30, "the driver took too long to notice the dead worker"
    assert [m["step"] for m in read_metrics(run_dir)] == [1, 2]

    # the newest checkpoint (step_2) is damaged: resume must say so and use step_1
    weights = run_dir / "checkpoints" / "step_2" / "actor" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])

    monkeypatch.setenv("RLFRAME_FAULT_INJECT_ONCE", str(tmp_path / "fired-2"))
    result = run_main(_args(tiny_model_dir, run_dir, "trainer.max_restarts=1", "actor.world_size=2",
                            "actor.ppo_micro_batch_size_per_device=2"), cwd=tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-5000:]
    assert "step_2 is not usable: actor/model.safetensors has" in output and "truncated" in output
    assert "falling back to the previous complete checkpoint" in output
    assert f"resumed from {run_dir / 'checkpoints' / 'step_1'} (step 1)" in output
    assert "restart 1/1 after: [step 3, phase 'update'] worker process died" in output
    assert f"resumed from {run_dir / 'checkpoints' / 'step_2'} (step 2)" in output
    assert [m["step"] for m in read_metrics(run_dir)] == [1, 2, 3, 4]
    assert (run_dir / "summary.json").exists()
    assert os.path.isdir(run_dir / "checkpoints" / "step_4")


def test_a_restart_before_the_first_checkpoint_logs_each_step_once(tmp_path, tiny_model_dir, monkeypatch):
    """A worker dies at step 2, before the first checkpoint (step 3): the restart trains from step 0 again, and
    metrics.jsonl / timeline.jsonl hold each step once (they held step 0 and step 1 twice: issue 44)."""
    run_dir = tmp_path / "run"
    monkeypatch.setenv("RLFRAME_FAULT_INJECT", "update_actor:2")
    monkeypatch.setenv("RLFRAME_FAULT_INJECT_ONCE", str(tmp_path / "fired"))
    result = run_main(_args(tiny_model_dir, run_dir, "trainer.total_steps=3", "trainer.save_every=3",
                            "trainer.max_restarts=1", "trainer.val_before_train=true"), cwd=tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-5000:]
    assert "restart 1/1 after: [step 2, phase 'update'] worker process died" in output
    assert [m["step"] for m in read_metrics(run_dir)] == [0, 1, 2, 3]
    timeline = [json.loads(line) for line in (run_dir / "timeline.jsonl").read_text().splitlines()]
    assert [row["step"] for row in timeline if row["phase"] == "step"] == [1, 2, 3]
