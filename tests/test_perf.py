"""perf/mfu and per-phase throughput (rlframe/trainer/perf.py) on hand-computed numbers."""

from __future__ import annotations

import pytest
import torch

from rlframe.memory_plan import ModelShape
from rlframe.trainer.perf import (forward_flops, generation_flops, gpu_peak_tflops, multiplying_params,
                                  peak_memory_metrics, step_perf)

# 2 layers, d = heads * head_dim = 4 * 8 = 32; untied: N = params - vocab * hidden = 10_000 - 100 * 16 = 8_400
SHAPE = ModelShape(params=10_000, layers=2, hidden=16, intermediate=32, vocab=100, heads=4, kv_heads=4, head_dim=8)


def test_forward_flops_by_hand():
    assert multiplying_params(SHAPE) == 8_400
    tied = ModelShape(**{**SHAPE.__dict__, "tied": True})
    assert multiplying_params(tied) == 10_000  # the tied LM head's matmul counts, no lookup to drop
    # two sequences of 3 and 5 tokens: 2 * 8400 * 8 + 2 * 2 * 32 * (9 + 25)
    assert forward_flops(SHAPE, torch.tensor([3, 5])) == 2 * 8_400 * 8 + 2 * 2 * 32 * 34


def test_step_perf_by_hand():
    attention = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 1, 1, 1]])  # lengths 3 and 5 (left/right padding)
    response = torch.tensor([[1.0, 0.0], [1.0, 1.0]])  # 3 generated tokens
    phases = {"rollout": 2.0, "ref_log_prob": 0.5, "update": 4.0, "reward": 0.1, "weight_sync": 0.2}
    metrics = step_perf(SHAPE, attention, response, phases, step_seconds=10.0, forward_passes=1, trained_passes=1,
                        peak_tflops=1e-6, devices=2, samples_per_prompt=2)
    # prompts 2 and 3 tokens, responses 1 and 2: decode 2N * 3 + 2 L d ((3^2 - 2^2) + (5^2 - 3^2)),
    # one prefill per prompt shared by 2 samples: (2N * 5 + 2 L d (4 + 9)) / 2
    generation = 2 * 8_400 * 3 + 2 * 2 * 32 * (5 + 16) + (2 * 8_400 * 5 + 2 * 2 * 32 * 13) / 2
    assert generation_flops(SHAPE, torch.tensor([2, 3]), torch.tensor([1, 2]), 2) == pytest.approx(generation)
    flops = generation + (2 * 8_400 * 8 + 2 * 2 * 32 * 34) * (1 + 3)  # + ref + update (3x)
    assert metrics["perf/model_tflops"] == pytest.approx(flops / 10.0 / 1e12)
    assert metrics["perf/mfu"] == pytest.approx(flops / 10.0 / 1e12 / (1e-6 * 2))
    assert metrics["perf/tokens_per_s/rollout"] == pytest.approx(3 / 2.0)
    assert metrics["perf/tokens_per_s/update"] == pytest.approx(8 / 4.0)
    assert metrics["perf/tokens_per_s/ref_log_prob"] == pytest.approx(8 / 0.5)
    assert "perf/tokens_per_s/reward" not in metrics and "perf/tokens_per_s/weight_sync" not in metrics


def test_unknown_gpu_has_no_datasheet_peak():
    assert gpu_peak_tflops("NVIDIA H200") == 989.4 and gpu_peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert gpu_peak_tflops("Some Future GPU") is None


def test_peak_memory_metrics_per_method():
    cpu = {"rss/actor_rollout.update_actor": 9.5, "rss/actor_rollout.generate_sequences": 7.0,
           "rss/ref.compute_ref_log_prob": 6.5, "rss/actor_rollout.compute_ref_log_prob": 8.0}
    assert peak_memory_metrics(cpu) == {"perf/peak_mem_gib/update_actor": 9.5,
                                        "perf/peak_mem_gib/generate_sequences": 7.0,
                                        "perf/peak_mem_gib/compute_ref_log_prob": 8.0}
    gpu = {**cpu, "device/actor_rollout.update_actor": 30.0}  # on GPU: device memory, not host RSS
    assert peak_memory_metrics(gpu) == {"perf/peak_mem_gib/update_actor": 30.0}

