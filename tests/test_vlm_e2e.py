"""Vision-language RL with real workers: one update at world size 1 vs 2 (FSDP2 over gloo, Ray actors)
on image rows, and `python -m rlframe.main recipe=grpo_vlm_shapes` for 2 steps as a user runs it.

The model is the tiny random-init Qwen2.5-VL (`model.path=tiny-qwen2.5-vl`, built into the cache at
run time from a config: rlframe/models/tiny_vlm.py); the data are the generated shapes pictures.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import ray
import torch

from conftest import read_metrics, run_main


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
    ray.init(num_cpus=4, include_dashboard=False, runtime_env={"env_vars": {"RAY_USAGE_STATS_ENABLED": "0"}})
    try:
        (m1, w1, lp1) = run_update(model_dir, batch, world_size=1, micro=8, tmp_path=tmp_path, packed="false")
        (m2, w2, lp2) = run_update(model_dir, batch, world_size=2, micro=2, tmp_path=tmp_path, packed="true")
    finally:
        ray.shutdown()
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


def test_grpo_vlm_shapes_two_steps(vlm_cache, tmp_path):
    cache, _ = vlm_cache
    run_dir = tmp_path / "run"
    os.environ["RLFRAME_CACHE"] = str(cache)
    # The math reward is all zeros for a random model (no advantage, no update): a reward that varies with
    # the response makes step 1's update real, so step 2's rollout runs on synced weights (vision tower too).
    reward = Path(__file__).parent / "length_reward.py"
    result = run_main(["recipe=grpo_vlm_shapes", "trainer.total_steps=2", "data.shapes.n_train=16",
                       f"reward.functions=[{{path:{reward}}}]", "actor.optim.lr=1e-3",
                       "data.shapes.n_val=4", "data.val_max_samples=4", "data.max_response_length=8",
                       "data.train_batch_size=2", "actor.ppo_mini_batch_size=2", "rollout.n=2",
                       "actor.ppo_micro_batch_size_per_device=4", "trainer.num_cpus=4",
                       f"trainer.run_dir={run_dir}"], cwd=tmp_path)
    assert result.returncode == 0, f"STDOUT:\n{result.stdout[-4000:]}\nSTDERR:\n{result.stderr[-6000:]}"
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == [0, 1, 2]
    assert "val/reward_mean" in metrics[0] and "val/reward_mean" in metrics[-1]
    for step in metrics[1:]:
        for key in ("actor/pg_loss", "actor/grad_norm", "critic/score/mean", "rollout/logprob_abs_diff",
                    "actor/kl_loss", "timing/weight_sync"):
            assert key in step and math.isfinite(step[key]), (step["step"], key)
        # HF rollout and trainer see the same images and 3-D positions: the text path's tolerance
        assert step["rollout/logprob_abs_diff"] < 1e-3
    assert metrics[1]["actor/grad_norm"] > 0 and metrics[2]["actor/kl_loss"] > 0  # step 1 moved the weights
    summary = json.loads((run_dir / "summary.json").read_text())
    export = run_dir / "hf_model"
    assert summary["hf_model"] == str(export) and (export / "preprocessor_config.json").is_file()
    from transformers import AutoModelForImageTextToText

    assert type(AutoModelForImageTextToText.from_pretrained(export)).__name__ == "Qwen2_5_VLForConditionalGeneration"
