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
- the chunk layout and the config validation of the new keys.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from test_megatron import (actor_config, assert_same_as_fsdp, megatron_cfg, problems, start_actor,  # noqa: E402
                           tiny_batch, update)
from test_megatron import fsdp_reference  # noqa: E402,F401  (the module fixture, by name)


def test_cp_chunk_layout():
    from rlframe.workers.engine.megatron import cp_positions

    assert cp_positions(8, 2, 0).tolist() == [0, 1, 6, 7] and cp_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert sorted(torch.cat([cp_positions(12, 3, r) for r in range(3)]).tolist()) == list(range(12))


def test_validation_of_sequence_and_context_parallel(tiny_model_dir):
    from rlframe.config import validate_config

    cfg = megatron_cfg(tiny_model_dir, tp=1)
    cfg.megatron.sequence_parallel = True
    assert "megatron.sequence_parallel: needs megatron.tensor_model_parallel_size > 1" in problems(cfg)
    cfg = megatron_cfg(tiny_model_dir, world_size=2, tp=1, cp=2)
    validate_config(cfg)  # CP=2 on 2 ranks runs
    cfg = megatron_cfg(tiny_model_dir, world_size=2, tp=1, pp=2, cp=2)
    assert "actor.world_size: 2 is not divisible by TP x PP x CP = 1 x 2 x 2 = 4" in problems(cfg)


def parallel_update(tiny_model_dir, tmp_path, name: str, **megatron):
    cfg = actor_config(tiny_model_dir, 2, 2, tp=megatron.pop("tp", 1))
    for key, value in megatron.items():
        setattr(cfg.megatron, key, value)
    pool, group, actor = start_actor(cfg, tiny_model_dir, name)
    try:
        return update(actor, tiny_batch(tiny_model_dir), tmp_path / name)
    finally:
        group.shutdown()
        pool.remove()


def test_sequence_parallel_tp2_equals_fsdp(ray_session, tiny_model_dir, tmp_path, request):
    ours = parallel_update(tiny_model_dir, tmp_path, "megatron_tp2_sp", tp=2, sequence_parallel=True)
    assert_same_as_fsdp(request.getfixturevalue("fsdp_reference"), ours, weight_atol=2e-5)


def test_context_parallel_cp2_equals_fsdp(ray_session, tiny_model_dir, tmp_path, request):
    ours = parallel_update(tiny_model_dir, tmp_path, "megatron_cp2", context_parallel_size=2)
    assert_same_as_fsdp(request.getfixturevalue("fsdp_reference"), ours, weight_atol=2e-5)
