"""Model FLOPs utilisation (MFU) and per-phase throughput of a training step.

Forward FLOPs of one sequence of n tokens through a decoder-only transformer (the accounting of
PaLM, Chowdhery et al. 2022, appendix B, with causal attention):

    F(n) = 2 * N * n + 2 * L * d * n^2

N: the parameters that multiply (all but the input embedding lookup; a tied LM head counts once),
L layers, d = heads * head_dim; token i attends to i tokens (QK^T and AV: 4 * d * i per layer).
The backward pass costs twice the forward, so a trained token costs 3x. A step's model FLOPs:
generation (the response tokens, each attending to its prompt and the response so far, plus one
prefill per prompt: its `samples_per_prompt` samples share it through the prefix cache), each
log-prob pass (old, reference, values: forward over prompt + response), the actor update (3x), the
critic update (3x). MFU = step FLOPs / step seconds / (peak FLOP/s x devices).
Peak: the datasheet dense bf16 rate of known GPUs, or the fp32 matmul rate measured on this machine
(CPU; all its cores are one "device"; measured when the run starts, so a machine busy with other
work at that moment reads a low peak and a high MFU).
"""

from __future__ import annotations

import time

import torch

from rlframe.memory_plan import ModelShape

# Dense bf16 tensor-core peaks (TFLOP/s, no sparsity) from the vendors' datasheets.
GPU_BF16_PEAK_TFLOPS = {"H200": 989.4, "H100": 989.4, "H800": 989.4, "H20": 148.0, "B200": 2250.0,
                        "A100": 312.0, "A800": 312.0, "L40S": 362.0, "A10G": 70.0, "L4": 121.0}


# The driver's phases that run the model over the batch (rollout*: generated tokens; others: all tokens).
MODEL_PHASES = ("rollout", "rollout_greedy", "old_log_prob", "ref_log_prob", "values", "update", "update_critic")


def gpu_peak_tflops(device_name: str) -> float | None:
    for model, peak in GPU_BF16_PEAK_TFLOPS.items():
        if model in device_name:
            return peak
    return None


def measured_matmul_tflops(size: int = 2048, trials: int = 5) -> float:
    """fp32 matmul rate of this process on the CPU (all its threads): the best of a few trials, so
    that other work on the machine at that moment lowers it less."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    best = float("inf")
    for _ in range(trials):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e12


def multiplying_params(shape: ModelShape) -> int:
    return shape.params - (0 if shape.tied else shape.vocab * shape.hidden)


def forward_flops(shape: ModelShape, lengths: torch.Tensor) -> float:
    """F summed over sequences of the given lengths (real tokens, padding excluded)."""
    n = lengths.double()
    attention_width = shape.heads * shape.head_dim
    return float(2 * multiplying_params(shape) * n.sum() + 2 * shape.layers * attention_width * (n * n).sum())


def generation_flops(shape: ModelShape, prompt_lengths: torch.Tensor, response_lengths: torch.Tensor,
                     samples_per_prompt: int) -> float:
    """Decoding the responses (each token attends to its prompt and the response so far) plus one
    prefill per prompt, shared by its samples."""
    a, r = prompt_lengths.double(), response_lengths.double()
    attention_width = shape.heads * shape.head_dim
    decode = 2 * multiplying_params(shape) * r.sum() + 2 * shape.layers * attention_width * ((a + r) ** 2 - a**2).sum()
    return float(decode) + forward_flops(shape, prompt_lengths) / max(samples_per_prompt, 1)


def step_flops(shape: ModelShape, prompt_lengths: torch.Tensor, response_lengths: torch.Tensor,
               samples_per_prompt: int, forward_passes: int, trained_passes: int) -> float:
    """Generation + `forward_passes` log-prob passes + `trained_passes` updates (3x) over the batch."""
    return (generation_flops(shape, prompt_lengths, response_lengths, samples_per_prompt)
            + forward_flops(shape, prompt_lengths + response_lengths) * (forward_passes + 3 * trained_passes))


def step_perf(shape: ModelShape, attention_mask: torch.Tensor, response_mask: torch.Tensor,
              phase_seconds: dict[str, float], step_seconds: float, forward_passes: int, trained_passes: int,
              peak_tflops: float | None, devices: int, samples_per_prompt: int = 1) -> dict[str, float]:
    """perf/mfu, perf/model_tflops and perf/tokens_per_s/<phase> of one step."""
    lengths = attention_mask.sum(-1)
    response_lengths = response_mask.sum(-1).round().long()
    tokens, generated = float(lengths.sum()), float(response_mask.sum())
    flops = step_flops(shape, lengths - response_lengths, response_lengths, samples_per_prompt, forward_passes,
                       trained_passes)
    metrics = {"perf/model_tflops": flops / max(step_seconds, 1e-9) / 1e12}
    if peak_tflops:
        metrics["perf/mfu"] = metrics["perf/model_tflops"] / (peak_tflops * devices)
    for phase, seconds in phase_seconds.items():
        if seconds > 0 and phase in MODEL_PHASES:
            metrics[f"perf/tokens_per_s/{phase}"] = (generated if phase.startswith("rollout") else tokens) / seconds
    return metrics


def device_peak(cfg) -> tuple[float | None, int]:
    """(peak TFLOP/s of one device, devices of the run): trainer.device_peak_tflops, else the datasheet
    figure of this machine's GPU, else (CPU) the measured matmul rate with one device per node."""
    from rlframe.config import devices_needed
    from rlframe.memory_plan import plans_gpu

    if plans_gpu(cfg):
        peak = cfg.trainer.device_peak_tflops
        if peak is None and torch.cuda.is_available():
            peak = gpu_peak_tflops(torch.cuda.get_device_name(0))
        return peak, devices_needed(cfg)
    return cfg.trainer.device_peak_tflops or measured_matmul_tflops(), cfg.trainer.nnodes


def peak_memory_metrics(peaks: dict[str, float]) -> dict[str, float]:
    """Worker calls' peak memory -> perf/peak_mem_gib/<method>: on GPU the device's peak allocated
    memory, on CPU the process's peak RSS, the largest over roles and ranks that ran that method this
    step (e.g. generate_sequences, compute_log_prob, compute_ref_log_prob, update_actor)."""
    metrics: dict[str, float] = {}
    kind = "device/" if any(k.startswith("device/") for k in peaks) else "rss/"
    for key, value in peaks.items():
        if key.startswith(kind):
            method = key.removeprefix(kind).split(".", 1)[-1]
            name = f"perf/peak_mem_gib/{method}"
            metrics[name] = max(value, metrics.get(name, 0.0))
    return metrics

