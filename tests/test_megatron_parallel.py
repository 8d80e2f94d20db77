"""Megatron's sequence parallelism and our context parallelism in the Megatron-core engine, on CPU over gloo.

The tiny random Llama of conftest.py, 8 sequences of 11 columns (so every micro-batch is padded inside the
engine: to a multiple of TP under sequence parallelism, of 2 x CP under context parallelism), against the
FSDP engine on the same HF weights and batch with the tolerances of tests/test_megatron.py
(`assert_same_as_fsdp`: log-probs and entropy atol 1e-5 / rtol 1e-4, losses and grad norm rel 1e-4,
updated weights rtol 1e-4, atol 2e-5 under TP as there):

- `megatron.sequence_parallel=true` at TP=2 (2 ranks, 2 micro-batches): megatron-core's sequence
  parallelism (reduce-scatter / all-gather around the TP linears, the norms' gradients all-reduced over
  TP) gives FSDP's log-probs and update, hence the update of TP=2 without it (test_megatron.py);
- `megatron.context_parallel_size=2` (2 ranks, 2 micro-batches): each sequence in 4 chunks, rank r holding
  chunks r and 3 - r, keys / values all-gathered, per-token log-probs gathered: FSDP's log-probs and update;
- the chunk layout and the config validation of the new keys;
- slow: the critic under both (2 ranks); on 4 ranks TP=2 x CP=2, TP=2 + SP x CP=2, TP=2 + SP x PP=2 and
  CP=2 x PP=2 (all FSDP's update); the same with model.gradient_checkpointing (TP=2 + SP, CP=2);
  `rlframe.main` for 2 GRPO steps with TP=2 + SP and with CP=2.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from test_megatron import (actor_config, assert_same_as_fsdp, grpo_two_steps, megatron_cfg, problems,  # noqa: E402
                           update_on_ranks)
from test_megatron import fsdp_critic_reference, fsdp_reference  # noqa: E402,F401  (module fixtures, by name)


def test_cp_chunk_layout():
    from rlframe.workers.engine.megatron.attention import cp_positions

    assert cp_positions(8, 2, 0).tolist() == [0, 1, 6, 7] and cp_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert sorted(torch.cat([cp_positions(12, 3, r) for r in range(3)]).tolist()) == list(range(12))
    from rlframe.workers.engine.megatron.attention import attention_mask_for

    mask = torch.ones(3, 12, dtype=torch.long)
    mask[0, :3] = 0  # left padding
    mask[1, 9:] = 0  # right padding
    # the whole mask, built independently: causal and not padding, or the diagonal
    allowed = torch.ones(12, 12, dtype=torch.bool).tril().unsqueeze(0) & mask.bool().unsqueeze(1)
    whole = ~(allowed | torch.eye(12, dtype=torch.bool).unsqueeze(0)).unsqueeze(1)
    assert torch.equal(attention_mask_for(mask), whole)
    for rank in range(2):  # a rank's query rows of the causal + padding mask, by global column
        rows = cp_positions(12, 2, rank)
        assert torch.equal(attention_mask_for(mask, rows), whole[:, :, rows, :])


def test_validation_of_sequence_and_context_parallel(tiny_model_dir):
    from rlframe.config import validate_config

    cfg = megatron_cfg(tiny_model_dir, tp=1)
    cfg.megatron.sequence_parallel = True
    assert "megatron.sequence_parallel: needs megatron.tensor_model_parallel_size > 1" in problems(cfg)
    cfg = megatron_cfg(tiny_model_dir, world_size=2, tp=1, cp=2)
    validate_config(cfg)  # CP=2 on 2 ranks runs
    cfg = megatron_cfg(tiny_model_dir, world_size=2, tp=1, pp=2, cp=2)
    assert "actor.world_size: 2 is not divisible by TP x PP x CP = 1 x 2 x 2 = 4" in problems(cfg)
    from rlframe.main import compose_config
    from rlframe.trainer.worker_settings import actor_settings

    cfg = compose_config(["recipe=grpo_math_megatron", f"model.path={tiny_model_dir}", "megatron.sequence_parallel=true",
                          "megatron.context_parallel_size=2", "megatron.expert_model_parallel_size=2"])
    engine = actor_settings(cfg, str(tiny_model_dir)).engine.section  # (the keys reach the engine)
    assert engine.sequence_parallel and engine.context_parallel_size == 2 and engine.expert_model_parallel_size == 2


def parallel_update(tiny_model_dir, tmp_path, name: str, recompute: bool = False, **megatron):
    cfg = actor_config(tiny_model_dir, 2, 2, tp=megatron.pop("tp", 1))
    cfg.model.gradient_checkpointing = recompute
    for key, value in megatron.items():
        setattr(cfg.megatron, key, value)
    return update_on_ranks(cfg, tiny_model_dir, name, tmp_path / name)


def test_sequence_parallel_tp2_equals_fsdp(ray_session, tiny_model_dir, tmp_path, request):
    ours = parallel_update(tiny_model_dir, tmp_path, "megatron_tp2_sp", tp=2, sequence_parallel=True)
    assert_same_as_fsdp(request.getfixturevalue("fsdp_reference"), ours, weight_atol=2e-5)


def test_context_parallel_cp2_equals_fsdp(ray_session, tiny_model_dir, tmp_path, request):
    ours = parallel_update(tiny_model_dir, tmp_path, "megatron_cp2", context_parallel_size=2)
    assert_same_as_fsdp(request.getfixturevalue("fsdp_reference"), ours, weight_atol=2e-5)


@pytest.mark.slow  # (~15 s each on a quiet machine)
@pytest.mark.parametrize("parallel", [{"tp": 2, "sequence_parallel": True}, {"context_parallel_size": 2}],
                         ids=["tp2_sp", "cp2"])
def test_recompute_under_sequence_and_context_parallel_equals_fsdp(ray_session, tiny_model_dir, tmp_path, request,
                                                                    parallel):
    """model.gradient_checkpointing (whole layers recomputed in the backward, their collectives with them)."""
    ours = parallel_update(tiny_model_dir, tmp_path, "megatron_recompute", recompute=True, **parallel)
    assert_same_as_fsdp(request.getfixturevalue("fsdp_reference"), ours, weight_atol=2e-5)


@pytest.mark.slow  # (~15 s each on a quiet machine)
@pytest.mark.parametrize("parallel", [{"tensor_model_parallel_size": 2, "sequence_parallel": True},
                                      {"context_parallel_size": 2}], ids=["tp2_sp", "cp2"])
def test_critic_two_ranks_equals_fsdp(ray_session, tiny_model_dir, request, parallel):
    """The critic's value head under sequence parallelism (its input gathered along the sequence) and under
    context parallelism (the values of each rank's chunks gathered): the FSDP critic's update."""
    import dataclasses

    from test_megatron import assert_same_critic_update, critic_batch, critic_settings_for

    from rlframe.controller import ResourcePool, WorkerGroup
    from rlframe.workers.roles.critic import CriticWorker

    settings = critic_settings_for(tiny_model_dir, "megatron", world_size=2, micro=1)
    engine = dataclasses.replace(settings.engine, section=dataclasses.replace(settings.engine.section, **parallel))
    pool = ResourcePool([2], cpus_per_bundle=1, name="megatron_critic_parallel")
    group = WorkerGroup(pool, {"critic": (CriticWorker, {"settings": dataclasses.replace(settings, engine=engine)})},
                        default_timeout_s=300)
    try:
        critic = group.role("critic")
        metrics = critic.update_critic(critic_batch()).meta_info["metrics"]
        values = critic.compute_values(critic_batch()).batch["values"]
    finally:
        group.shutdown()
        pool.remove()
    assert_same_critic_update(request.getfixturevalue("fsdp_critic_reference"), metrics, values)


@pytest.mark.slow  # (4 ranks on the 2 cores: ~1-2 min each)
@pytest.mark.parametrize("parallel", [
    {"tp": 2, "context_parallel_size": 2},
    {"tp": 2, "sequence_parallel": True, "context_parallel_size": 2},
    {"tp": 2, "sequence_parallel": True, "pipeline_model_parallel_size": 2},
    {"context_parallel_size": 2, "pipeline_model_parallel_size": 2},
], ids=["tp2_cp2", "tp2_sp_cp2", "tp2_sp_pp2", "cp2_pp2"])
def test_four_rank_combinations_equal_fsdp(ray_session, tiny_model_dir, tmp_path, request, parallel):
    """Sequence / context parallelism combined with TP and the pipeline (4 ranks): FSDP's update."""
    cfg = actor_config(tiny_model_dir, 4, 2, tp=parallel.pop("tp", 1))
    for key, value in parallel.items():
        setattr(cfg.megatron, key, value)
    ours = update_on_ranks(cfg, tiny_model_dir, "megatron_four_ranks", tmp_path / "four")
    assert_same_as_fsdp(request.getfixturevalue("fsdp_reference"), ours, weight_atol=2e-5)


@pytest.mark.slow  # (a 2-step run: ~2-3 min on the 2 cores)
@pytest.mark.parametrize("tp,parallel", [(2, "megatron.sequence_parallel=true"), (1, "megatron.context_parallel_size=2")],
                         ids=["tp2_sp", "cp2"])
def test_grpo_two_steps_with_sequence_or_context_parallel(tmp_path, tiny_model_dir, tp, parallel):
    """`python -m rlframe.main recipe=grpo_math_megatron` with TP=2 + SP and with CP=2 (actor and reference
    policy; colocated HF rollout): the rollout's log-probs agree with the trainer's (< 1e-4) after each sync."""
    grpo_two_steps(tmp_path, tiny_model_dir, "colocated", tp, 1, parallel)
