"""The actor's update gives the same result at data-parallel world size 1 and 2 (FSDP2 over gloo),
and with Ulysses sequence parallelism over the 2 ranks.

A fixed synthetic rollout batch goes through `compute_log_prob` and `update_actor` in a real worker
group; the log-probs, the loss, the gradient norm and the updated weights must agree: the loss
normalisers are global over ranks and micro-batches, so splitting the batch (or each row's tokens)
differently must not change the update.
"""

from __future__ import annotations

import pytest
import torch

from conftest import local_ray
from rlframe.config import RLConfig
from rlframe.controller import ResourcePool, WorkerGroup
from rlframe.protocol import DataProto


@pytest.fixture(scope="module")
def ray_session():
    with local_ray(4, runtime_env={"env_vars": {"RAY_USAGE_STATS_ENABLED": "0"}}):
        yield


def synthetic_batch(vocab: int, n: int = 8, prompt: int = 6, response: int = 5) -> DataProto:
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, vocab, (n, prompt), generator=g)
    prompt_mask = torch.ones(n, prompt, dtype=torch.long)
    prompt_mask[::3, :2] = 0  # some left padding
    responses = torch.randint(3, vocab, (n, response), generator=g)
    response_mask = torch.ones(n, response)
    response_mask[1::2, 3:] = 0  # some short responses
    attention_mask = torch.cat([prompt_mask, response_mask.long()], dim=1)
    return DataProto.from_dict(tensors={
        "prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
        "attention_mask": attention_mask, "position_ids": (attention_mask.cumsum(1) - 1).clamp(min=0),
        "response_mask": response_mask,
        "advantages": torch.randn(n, 1, generator=g).expand(n, response).contiguous() * response_mask,
        "old_log_probs": -torch.rand(n, response, generator=g) * 5,
        "ref_log_prob": -torch.rand(n, response, generator=g) * 5,
    }, meta_info={"step": 1})


def run_update(model_dir, world_size: int, micro: int, tmp_path, sequence_parallel: int = 1, packed: str = "auto"):
    from rlframe.trainer.worker_settings import actor_settings
    from rlframe.workers.roles.actor_rollout import ActorRolloutWorker

    cfg = RLConfig()
    cfg.rollout.engine = "hf"
    cfg.rollout.n = 2
    cfg.actor.world_size = world_size
    cfg.actor.ppo_mini_batch_size = 4  # x n=2 -> 8 sequences: the whole batch, one optimiser step
    cfg.actor.ppo_micro_batch_size_per_device = micro
    cfg.actor.optim.lr = 1e-3
    cfg.actor.shuffle = False
    cfg.algorithm.kl_loss_coef = 0.1
    cfg.actor.ulysses_sequence_parallel_size = sequence_parallel
    cfg.actor.use_remove_padding = packed
    pool = ResourcePool([world_size], cpus_per_bundle=1, name=f"dp{world_size}")
    group = WorkerGroup(pool, {"actor_rollout": (ActorRolloutWorker, {"settings": actor_settings(cfg, str(model_dir))})},
                        default_timeout_s=300)
    try:
        actor = group.role("actor_rollout")
        from transformers import AutoConfig

        vocab = AutoConfig.from_pretrained(model_dir).vocab_size
        batch = synthetic_batch(vocab)
        log_probs = actor.compute_log_prob(batch).batch["old_log_probs"] * batch.batch["response_mask"]
        result = actor.update_actor(batch)
        out = tmp_path / f"ws{world_size}_micro{micro}_sp{sequence_parallel}_{packed}"
        actor.save_hf(str(out))
    finally:
        group.shutdown()
        pool.remove()
    from safetensors.torch import load_file

    return result.meta_info["metrics"], load_file(str(out / "model.safetensors")), log_probs


def assert_same_update(first, second):
    (m1, w1, lp1), (m2, w2, lp2) = first, second
    torch.testing.assert_close(lp1, lp2, rtol=1e-4, atol=1e-5)
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm"):
        assert m1[key] == pytest.approx(m2[key], rel=1e-4, abs=1e-6), key
    assert m1["actor/grad_norm"] > 0
    assert w1.keys() == w2.keys()
    for name in w1:
        torch.testing.assert_close(w1[name], w2[name], rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_update_same_at_world_size_1_and_2(ray_session, tiny_model_dir, tmp_path):
    # padded forward at world size 1, packed (VARLEN_SDPA) at world size 2
    assert_same_update(run_update(tiny_model_dir, world_size=1, micro=8, tmp_path=tmp_path, packed="false"),
                       run_update(tiny_model_dir, world_size=2, micro=2, tmp_path=tmp_path))


def test_ulysses_sequence_parallel_same_as_world_size_1(ray_session, tiny_model_dir, tmp_path):
    # both ranks share every row (each runs half of its tokens; all-to-all around attention)
    assert_same_update(run_update(tiny_model_dir, world_size=1, micro=8, tmp_path=tmp_path),
                       run_update(tiny_model_dir, world_size=2, micro=4, tmp_path=tmp_path, sequence_parallel=2))
