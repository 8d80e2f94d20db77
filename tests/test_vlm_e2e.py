"""Vision-language RL with real workers: one update at world size 1 vs 2 (FSDP2 over gloo, Ray actors)
on image rows (the recipe's 2-step run as a user runs it is in tests/test_recipes.py).

The model is the tiny random-init Qwen2.5-VL (`model.path=tiny-qwen2.5-vl`, built into the cache at
run time from a config: rlframe/models/tiny_vlm.py); the data are the generated shapes pictures.
"""

from __future__ import annotations

import os

import pytest
import torch

from conftest import local_ray


@pytest.fixture(scope="module")
def vlm_cache(tmp_path_factory):
    """A private RLFRAME_CACHE holding the tiny VLM (built once for the module)."""
    from rlframe.models.provision import resolve_model_path

    cache = tmp_path_factory.mktemp("rlframe_cache")
    previous = os.environ.get("RLFRAME_CACHE")
    os.environ["RLFRAME_CACHE"] = str(cache)
    path = resolve_model_path("tiny-qwen2.5-vl")
    yield cache, path
    if previous is None:
        os.environ.pop("RLFRAME_CACHE", None)
    else:
        os.environ["RLFRAME_CACHE"] = previous


def image_batch(model_dir, tmp_path):
    """8 rollout-like rows: 4 shapes prompts x 2 random responses, with advantages and old log-probs."""
    from transformers import AutoTokenizer

    from rlframe.data.dataset import RLDataset, collate_prompts
    from rlframe.data.shapes import generate_shapes_dataset
    from rlframe.protocol import build_rollout_batch

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    train, _ = generate_shapes_dataset(tmp_path / "shapes", n_train=8, n_val=2)
    dataset = RLDataset([str(train)], tokenizer, max_prompt_length=128)
    prompts = collate_prompts([dataset[i] for i in range(4)], tokenizer.pad_token_id).repeat(2, interleave=True)
    g = torch.Generator().manual_seed(0)
    lengths = [5, 3, 6, 6, 2, 6, 4, 1]
    responses = [torch.randint(20, 300, (n,), generator=g).tolist() for n in lengths]
    batch = build_rollout_batch(prompts, responses, [[0.0] * n for n in lengths], 6, tokenizer.pad_token_id)
    mask = batch.batch["response_mask"]
    batch.batch["advantages"] = torch.randn(8, 1, generator=g).expand(8, 6).contiguous() * mask
    batch.batch["old_log_probs"] = -torch.rand(8, 6, generator=g) * 5
    batch.batch["ref_log_prob"] = -torch.rand(8, 6, generator=g) * 5
    batch.non_tensor_batch["multi_modal_inputs"] = prompts.non_tensor_batch["multi_modal_inputs"]
    batch.meta_info["step"] = 1
    return batch


def run_update(model_dir, batch, world_size: int, micro: int, tmp_path, packed: str):
    from rlframe.config import RLConfig
    from rlframe.controller import ResourcePool, WorkerGroup
    from rlframe.trainer.worker_settings import actor_settings
    from rlframe.workers.roles.actor_rollout import ActorRolloutWorker

    cfg = RLConfig()
    cfg.rollout.engine = "hf"
    cfg.rollout.n = 2
    cfg.actor.world_size = world_size
    cfg.actor.ppo_mini_batch_size = 4
    cfg.actor.ppo_micro_batch_size_per_device = micro
    cfg.actor.optim.lr = 1e-3
    cfg.actor.shuffle = False
    cfg.algorithm.kl_loss_coef = 0.1
    cfg.actor.use_remove_padding = packed
    pool = ResourcePool([world_size], cpus_per_bundle=1, name=f"vlm{world_size}")
    group = WorkerGroup(pool, {"actor_rollout": (ActorRolloutWorker, {"settings": actor_settings(cfg, str(model_dir))})},
                        default_timeout_s=300)
    try:
        actor = group.role("actor_rollout")
        log_probs = actor.compute_log_prob(batch).batch["old_log_probs"] * batch.batch["response_mask"]
        result = actor.update_actor(batch)
        out = tmp_path / f"ws{world_size}_{packed}"
        actor.save_hf(str(out))
    finally:
        group.shutdown()
        pool.remove()
    from safetensors.torch import load_file

    return result.meta_info["metrics"], load_file(str(out / "model.safetensors")), log_probs


def test_vlm_update_same_at_world_size_1_and_2(vlm_cache, tmp_path):
    _, model_dir = vlm_cache
    batch = image_batch(model_dir, tmp_path)
    with local_ray(4, runtime_env={"env_vars": {"RAY_USAGE_STATS_ENABLED": "0"}}):
        (m1, w1, lp1) = run_update(model_dir, batch, world_size=1, micro=8, tmp_path=tmp_path, packed="false")
        (m2, w2, lp2) = run_update(model_dir, batch, world_size=2, micro=2, tmp_path=tmp_path, packed="true")
    torch.testing.assert_close(lp1, lp2, rtol=1e-4, atol=1e-5)
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm"):
        assert m1[key] == pytest.approx(m2[key], rel=1e-4, abs=1e-6), key
    assert m1["actor/grad_norm"] > 0
    assert w1.keys() == w2.keys() and any(name.startswith("model.visual.") for name in w1)
    for name in w1:
        torch.testing.assert_close(w1[name], w2[name], rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
    from transformers import AutoModelForImageTextToText

    before = AutoModelForImageTextToText.from_pretrained(model_dir).state_dict()
    moved = [n for n in w1 if n.startswith("model.visual.") and not torch.equal(before[n], w1[n])]
    assert moved  # the vision tower trains too (actor.freeze_vision_tower=false)


# `python -m rlframe.main recipe=grpo_vlm_shapes` for 2 steps (synced weights, the export): tests/test_recipes.py.
