"""Export round trip: a checkpoint written by a world-size-2 FSDP actor, exported with
`python -m rlframe.export`, gives the same response log-probs (so the same logits) as the trainer's
sharded model on a fixed input."""

from __future__ import annotations

import subprocess
import sys

import torch

from conftest import local_ray
from rlframe.config import RLConfig
from rlframe.controller import ResourcePool, WorkerGroup
from rlframe.trainer import checkpoint as ckpt
from test_actor_data_parallel import synthetic_batch


def test_export_from_world_size_2_matches_trainer(tiny_model_dir, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlframe.trainer.worker_settings import actor_settings
    from rlframe.workers.engine.hf_model import forward_response_log_probs
    from rlframe.workers.roles.actor_rollout import ActorRolloutWorker

    cfg = RLConfig()
    cfg.rollout.engine, cfg.rollout.n, cfg.actor.world_size = "hf", 2, 2
    cfg.actor.ppo_mini_batch_size, cfg.actor.ppo_micro_batch_size_per_device = 4, 2
    cfg.actor.optim.lr = 1e-2
    batch = synthetic_batch(AutoConfig.from_pretrained(tiny_model_dir).vocab_size)
    with local_ray(2, runtime_env={"env_vars": {"RAY_USAGE_STATS_ENABLED": "0"}}):
        pool = ResourcePool([2], cpus_per_bundle=1, name="export")
        group = WorkerGroup(pool, {"actor_rollout": (ActorRolloutWorker,
                                                     {"settings": actor_settings(cfg, str(tiny_model_dir))})},
                            default_timeout_s=300)
        actor = group.role("actor_rollout")
        actor.update_actor(batch)
        tmp = ckpt.begin_save(tmp_path, 1)
        actor.save_checkpoint(str(tmp / "actor"))
        saved = ckpt.finish_save(tmp, 1, {"step": 1}, "", keep=0)
        trainer_log_probs = actor.compute_log_prob(batch).batch["old_log_probs"]
        group.shutdown()
        pool.remove()

    out = tmp_path / "hf"
    result = subprocess.run([sys.executable, "-m", "rlframe.export", str(saved.path), str(out)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    inputs = {k: batch.batch[k] for k in ("input_ids", "attention_mask", "position_ids")}
    with torch.no_grad():
        exported, _ = forward_response_log_probs(model, **inputs, response_width=batch.batch["responses"].size(1))
        before, _ = forward_response_log_probs(initial, **inputs, response_width=batch.batch["responses"].size(1))
    mask = batch.batch["response_mask"].bool()
    torch.testing.assert_close(exported[mask], trainer_log_probs[mask], rtol=0, atol=1e-5)
    assert (before[mask] - exported[mask]).abs().max() > 1e-3  # the update moved the weights
