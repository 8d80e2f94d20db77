"""Exact resume, end to end: a run killed with SIGKILL (driver, Ray and workers) after the step that
follows a checkpoint, resumed with trainer.resume=auto, ends bit-identical to an uninterrupted run.

With both rollout engines: HF generate draws from the torch RNG that the checkpoint saves and
restores; vLLM keeps its generator state inside the engine (not checkpointed), so every training
sample carries its own seed, derived from (trainer.seed, step, prompt uid, sample index)
(`rollout.seed_each_sample`, rlframe/rng.py) -- the resumed run samples the same tokens. The vLLM run
also writes sharded checkpoints (trainer.checkpoint_format=sharded, torch.distributed.checkpoint).
Timing figures (timing/*, perf/*, weight_sync/seconds) are excluded from the comparison; every other
metric and every weight must be equal bit for bit (fp32 on CPU, same world size, same order of
operations).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from safetensors.torch import load_file

from rlframe.export import export_checkpoint

from conftest import TINY_RUN_OVERRIDES, read_metrics, run_main, vllm_installed

REWARD = os.path.join(os.path.dirname(__file__), "length_reward.py")
TOTAL = 5


def overrides(model_dir, run_dir, engine, *extra):
    engine, checkpoint_format = engine
    return ["recipe=grpo_math", *TINY_RUN_OVERRIDES, f"model.path={model_dir}", f"trainer.run_dir={run_dir}",
            f"rollout.engine={engine}", checkpoint_format,
            f"trainer.total_steps={TOTAL}", "trainer.save_every=2", "trainer.max_checkpoints_to_keep=0",
            "trainer.val_before_train=false", "actor.optim.lr=1e-3", f"reward.functions=[{{path:{REWARD}}}]",
            "trainer.export_hf=true", *extra]


def comparable(metrics: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if not k.startswith(("timing/", "perf/")) and k != "weight_sync/seconds"}
            for m in metrics]


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the driver's session (it was started in its own) and every process it started (Ray)."""
    family = psutil.Process(proc.pid).children(recursive=True)
    os.killpg(proc.pid, signal.SIGKILL)
    for child in family:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait(timeout=30)
    psutil.wait_procs(family, timeout=30)


# The HF/full variant is slow-marked (CI time): the default engine's variant runs in CI, and the full
# format's engine-level round trip is tests/test_checkpoint.py's.
@pytest.mark.parametrize("engine, checkpoint_format", [
    pytest.param("hf", "full", marks=pytest.mark.slow),
    pytest.param("vllm", "sharded", marks=pytest.mark.skipif(not vllm_installed(), reason="vLLM is not installed"))])
def test_sigkill_and_resume_is_bit_identical(tmp_path, tiny_model_dir, engine, checkpoint_format):
    engine = [engine, f"trainer.checkpoint_format={checkpoint_format}"]
    # 1. the reference: N steps uninterrupted
    ref_dir = tmp_path / "reference"
    result = run_main(overrides(tiny_model_dir, ref_dir, engine), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]

    # 2. the same run, killed with SIGKILL as soon as step 3 (after checkpoint step_2) is logged
    run_dir = tmp_path / "killed"
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1"}
    with open(tmp_path / "killed.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "rlframe.main", *overrides(tiny_model_dir, run_dir, engine)],
                                cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline and proc.poll() is None:
                metrics_file = run_dir / "metrics.jsonl"
                if metrics_file.exists() and '"step": 3' in metrics_file.read_text():
                    break
                time.sleep(0.02)
            assert proc.poll() is None, "the run ended before it could be killed:\n" + (tmp_path / "killed.log").read_text()[-3000:]
            kill_tree(proc)
        finally:
            if proc.poll() is None:
                kill_tree(proc)
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert "step_2" in checkpoints and f"step_{TOTAL}" not in checkpoints, checkpoints
    assert not (run_dir / "summary.json").exists()

    # 3. resume: trainer.resume=auto picks the newest complete checkpoint
    resumed = run_main(overrides(tiny_model_dir, run_dir, engine, "trainer.resume=auto"), cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    newest = max(int(name.split("_")[1]) for name in checkpoints)
    assert f"resumed from {run_dir / 'checkpoints' / f'step_{newest}'} (step {newest})" in resumed.stdout
    assert newest < TOTAL

    # 4. identical per-step metrics (each step logged once) and identical final weights
    ref_metrics, got_metrics = read_metrics(ref_dir), read_metrics(run_dir)
    assert [m["step"] for m in got_metrics] == list(range(1, TOTAL + 1))
    assert comparable(got_metrics) == comparable(ref_metrics)
    assert all(m["actor/grad_norm"] > 0 for m in ref_metrics), "the test needs real updates"
    # (through rlframe.export: the same reader for gathered and sharded checkpoints)
    ref_weights = load_file(str(export_checkpoint(ref_dir / "checkpoints" / f"step_{TOTAL}", tmp_path / "ref_hf")
                                / "model.safetensors"))
    got_weights = load_file(str(export_checkpoint(run_dir / "checkpoints" / f"step_{TOTAL}", tmp_path / "got_hf")
                                / "model.safetensors"))
    assert ref_weights.keys() == got_weights.keys()
    for name in ref_weights:
        assert ref_weights[name].equal(got_weights[name]), name
    initial = load_file(str(tiny_model_dir / "model.safetensors"))
    assert not initial["model.embed_tokens.weight"].equal(got_weights["model.embed_tokens.weight"])
