"""Sharded checkpoints (trainer.checkpoint_format=sharded, torch.distributed.checkpoint): every rank
writes its own shards, nothing is gathered; the state resumes exactly, at the same or another world
size, and `rlframe.export` turns it into the same HF folder as a full checkpoint."""

from __future__ import annotations

import dataclasses

import torch
from safetensors.torch import load_file

from conftest import plain_actor
from test_actor_data_parallel import ray_session, synthetic_batch  # noqa: F401  (fixture)
from test_checkpoint import _batch, _policy, _update


def _sharded(actor):
    actor.engine.settings = dataclasses.replace(actor.engine.settings, checkpoint_format="sharded")
    return actor


def test_sharded_round_trip_resumes_bit_identically(tiny_model_dir, tmp_path):
    torch.manual_seed(0)
    first = _sharded(_policy(tiny_model_dir))
    _update(first, _batch(tiny_model_dir, 1))
    first.engine.save_state(str(tmp_path / "actor"), tokenizer_source=str(tiny_model_dir))
    metrics_a = _update(first, _batch(tiny_model_dir, 2))

    files = {p.name for p in (tmp_path / "actor").iterdir()}
    assert "sharded" in files and "model.safetensors" not in files and "optimizer.pt" not in files
    assert {"config.json", "tokenizer.json", "rank_0.pt"} <= files
    assert (tmp_path / "actor" / "sharded" / ".metadata").exists()

    second = _sharded(_policy(tiny_model_dir))
    torch.manual_seed(123)
    second.engine.load_state(str(tmp_path / "actor"))
    assert second.engine.optimizer_steps == 1
    metrics_b = _update(second, _batch(tiny_model_dir, 2))
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/lr"):
        assert metrics_a[key] == metrics_b[key], key  # Adam moments restored: the second update is the same
    for (name, a), b in zip(first.engine.model.state_dict().items(), second.engine.model.state_dict().values()):
        assert torch.equal(a, b), name


def test_two_ranks_write_shards_that_resume_on_one_and_export(ray_session, tiny_model_dir, tmp_path):  # noqa: F811
    from transformers import AutoConfig

    from rlframe.config import RLConfig
    from rlframe.controller import ResourcePool, WorkerGroup
    from rlframe.export import export_actor_folder
    from rlframe.trainer.worker_settings import actor_settings
    from rlframe.workers.roles.actor_rollout import ActorRolloutWorker

    cfg = RLConfig()
    cfg.rollout.engine, cfg.rollout.n, cfg.actor.world_size = "hf", 2, 2
    cfg.actor.ppo_mini_batch_size, cfg.actor.ppo_micro_batch_size_per_device = 4, 2
    cfg.actor.optim.lr, cfg.trainer.checkpoint_format = 1e-3, "sharded"
    pool = ResourcePool([2], cpus_per_bundle=1, name="sharded_ckpt")
    group = WorkerGroup(pool, {"actor_rollout": (ActorRolloutWorker, {"settings": actor_settings(cfg, str(tiny_model_dir))})},
                        default_timeout_s=300)
    batch = synthetic_batch(AutoConfig.from_pretrained(tiny_model_dir).vocab_size)
    try:
        actor = group.role("actor_rollout")
        actor.update_actor(batch)
        actor.save_checkpoint(str(tmp_path / "sharded"))
        actor.save_hf(str(tmp_path / "full"))  # the same weights, gathered: the reference
    finally:
        group.shutdown()
        pool.remove()
    shards = sorted(p.name for p in (tmp_path / "sharded" / "sharded").glob("*.distcp"))
    assert len(shards) == 2, shards  # one file per rank: nothing went through rank 0
    full = load_file(str(tmp_path / "full" / "model.safetensors"))

    # resume at world size 1 (DCP reshards): the weights are the 2-rank run's, and Adam's state is there
    single = plain_actor(tiny_model_dir)
    single.engine.load_state(str(tmp_path / "sharded"))
    state = single.engine.model.state_dict()
    for name, tensor in full.items():
        assert torch.equal(state[name], tensor), name
    assert single.engine.optimizer_steps == 1
    assert all(len(s) > 0 for s in single.engine.optimizer.state.values())

    exported = load_file(str(export_actor_folder(tmp_path / "sharded", tmp_path / "hf") / "model.safetensors"))
    assert exported.keys() == full.keys()
    for name, tensor in full.items():
        assert torch.equal(exported[name], tensor), name
