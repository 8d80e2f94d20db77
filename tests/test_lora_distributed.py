"""LoRA under FSDP2 sharding (world size 2 over gloo) and Ulysses sequence parallelism, in a real
worker group: the update, the reference log-probs (adapters disabled), the merged weights and the
adapter checkpoint agree with world size 1.

The loss normalisers are global, so splitting the batch over ranks (or each row's tokens over a
sequence-parallel group) must not change the adapters' update; sharded A and B are gathered for
the merge and for the checkpoint.
"""

from __future__ import annotations

import pytest
import torch

from conftest import local_ray
from rlframe.config import RLConfig, apply_algorithm_defaults
from rlframe.controller import ResourcePool, WorkerGroup
from test_actor_data_parallel import synthetic_batch


@pytest.fixture(scope="module")
def ray_session():
    with local_ray(4, runtime_env={"env_vars": {"RAY_USAGE_STATS_ENABLED": "0"}}):
        yield


def run_lora_update(model_dir, tmp_path, world_size: int, micro: int, sequence_parallel: int = 1):
    """Two LoRA updates on a fixed batch; returns the log-probs, reference log-probs, metrics, the
    merged weights (save_hf) and whether reloading the saved adapter checkpoint restored the model."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from rlframe.trainer import checkpoint as ckpt
    from rlframe.trainer.worker_settings import actor_settings
    from rlframe.workers.roles.actor_rollout import ActorRolloutWorker

    cfg = RLConfig()
    cfg.rollout.engine, cfg.rollout.n = "hf", 2
    cfg.actor.world_size = world_size
    cfg.actor.ppo_mini_batch_size, cfg.actor.ppo_micro_batch_size_per_device = 4, micro
    cfg.actor.optim.lr, cfg.actor.shuffle = 1e-2, False
    cfg.algorithm.kl_loss_coef = 0.1
    cfg.actor.ulysses_sequence_parallel_size = sequence_parallel
    cfg.model.lora.rank, cfg.model.lora.alpha = 4, 8.0
    apply_algorithm_defaults(cfg)  # "auto" policy-loss options -> the loss's defaults, as main.py does
    batch = synthetic_batch(AutoConfig.from_pretrained(model_dir).vocab_size)
    pool = ResourcePool([world_size], cpus_per_bundle=1, name=f"lora{world_size}_{sequence_parallel}")
    group = WorkerGroup(pool, {"actor_rollout": (ActorRolloutWorker, {"settings": actor_settings(cfg, str(model_dir))})},
                        default_timeout_s=300)
    out = tmp_path / f"ws{world_size}_sp{sequence_parallel}"
    try:
        actor = group.role("actor_rollout")
        metrics = actor.update_actor(batch).meta_info["metrics"]
        actor.update_actor(batch)
        log_probs = actor.compute_log_prob(batch).batch["old_log_probs"]
        ref_log_probs = actor.compute_ref_log_prob(batch).batch["ref_log_prob"]
        tmp = ckpt.begin_save(out, 2)
        actor.save_checkpoint(str(tmp / "actor"))
        saved = ckpt.finish_save(tmp, 2, {"step": 2}, "", keep=0)
        actor.save_hf(str(out / "hf"))
        actor.update_actor(batch)  # move away, then come back from the checkpoint
        actor.load_checkpoint(str(saved.path / "actor"))
        restored = torch.equal(actor.compute_log_prob(batch).batch["old_log_probs"], log_probs)
    finally:
        group.shutdown()
        pool.remove()
    mask = batch.batch["response_mask"]
    return {"log_probs": log_probs * mask, "ref": ref_log_probs * mask, "metrics": metrics, "restored": restored,
            "merged": load_file(str(out / "hf" / "model.safetensors"))}


def assert_same(first: dict, second: dict) -> None:
    torch.testing.assert_close(first["log_probs"], second["log_probs"], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(first["ref"], second["ref"], rtol=1e-4, atol=1e-5)
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm"):
        assert first["metrics"][key] == pytest.approx(second["metrics"][key], rel=1e-4, abs=1e-6), key
    assert first["merged"].keys() == second["merged"].keys()
    for name in first["merged"]:
        torch.testing.assert_close(first["merged"][name], second["merged"][name], rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"{name}: {m}")
    assert first["restored"] and second["restored"]


@pytest.fixture(scope="module")
def world_size_1(ray_session, tiny_model_dir, tmp_path_factory):
    return run_lora_update(tiny_model_dir, tmp_path_factory.mktemp("lora_ws1"), world_size=1, micro=8)


def test_lora_fsdp2_world_size_2_same_as_1(world_size_1, tiny_model_dir, tmp_path):
    sharded = run_lora_update(tiny_model_dir, tmp_path, world_size=2, micro=2)
    assert_same(world_size_1, sharded)
    assert (sharded["log_probs"] - sharded["ref"]).abs().max() > 1e-3  # the adapters moved the policy


def test_lora_ulysses_sequence_parallel_same_as_world_size_1(world_size_1, tiny_model_dir, tmp_path):
    assert_same(world_size_1, run_lora_update(tiny_model_dir, tmp_path, world_size=2, micro=4, sequence_parallel=2))
