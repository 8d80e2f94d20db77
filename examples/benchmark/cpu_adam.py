"""DeepSpeedCPUAdam vs torch's AdamW: one optimizer step on CPU tensors, the same parameters.

    python examples/benchmark/cpu_adam.py                      # SmolLM2-135M's parameter shapes
    python examples/benchmark/cpu_adam.py --hidden 896 --layers 24 --intermediate 4864 --vocab 151936  # Qwen2-0.5B

What optimizer offload (ZeRO-Offload, `deepspeed.adam_offload`) runs every step: the AdamW update of
every fp32 parameter on the CPU. Each variant steps the same parameters with the same gradients;
steps are interleaved (A, B, C, A, B, C, ...) so that other load on the machine hits all of them
alike, and the median is reported. After the timed steps the variants' parameters are compared, so
a fast but wrong kernel shows up here too.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def llama_shapes(hidden: int, layers: int, intermediate: int, vocab: int, kv_hidden: int) -> list[tuple[int, ...]]:
    """The parameter shapes of a Llama-style decoder with tied embeddings."""
    per_layer = [(hidden, hidden), (kv_hidden, hidden), (kv_hidden, hidden), (hidden, hidden),
                 (intermediate, hidden), (intermediate, hidden), (hidden, intermediate), (hidden,), (hidden,)]
    return [(vocab, hidden)] + per_layer * layers + [(hidden,)]


def make_optimizers(params_per_variant: dict[str, list[torch.nn.Parameter]], lr: float):
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    kwargs = {"lr": lr, "betas": (0.9, 0.999), "weight_decay": 0.01}
    return {
        # what torch picks for CPU tensors when not told: the per-tensor loop (the FSDP engine's AdamW)
        "torch AdamW (default)": torch.optim.AdamW(params_per_variant["torch AdamW (default)"], **kwargs),
        "torch AdamW (foreach)": torch.optim.AdamW(params_per_variant["torch AdamW (foreach)"], foreach=True, **kwargs),
        "torch AdamW (fused)": torch.optim.AdamW(params_per_variant["torch AdamW (fused)"], fused=True, **kwargs),
        "DeepSpeedCPUAdam": DeepSpeedCPUAdam(params_per_variant["DeepSpeedCPUAdam"], adamw_mode=True, **kwargs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--kv-hidden", type=int, default=192)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per variant (after one warm-up step)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from rlframe.workers.engine.deepspeed import CPU_ADAM_OP, _import_deepspeed, build_ops
    from rlframe.device import DeviceProfile

    _import_deepspeed(DeviceProfile("cpu", torch.float32, "gloo", "sdpa", "hf", False))
    build_ops([CPU_ADAM_OP])  # compiled once per machine (`make deepspeed-ops` does it ahead)

    shapes = llama_shapes(args.hidden, args.layers, args.intermediate, args.vocab, args.kv_hidden)
    g = torch.Generator().manual_seed(0)
    start = [torch.randn(shape, generator=g) * 0.02 for shape in shapes]
    numel = sum(t.numel() for t in start)
    names = ["torch AdamW (default)", "torch AdamW (foreach)", "torch AdamW (fused)", "DeepSpeedCPUAdam"]
    params = {name: [torch.nn.Parameter(t.clone()) for t in start] for name in names}
    for name in names:  # gradients: the same values for every variant
        for p, t in zip(params[name], start):
            p.grad = torch.full_like(t, 1e-3) + t * 0.1
    optimizers = make_optimizers(params, lr=1e-5)
    print(f"{numel / 1e6:.1f}M fp32 parameters in {len(shapes)} tensors, {args.threads} threads, "
          f"torch {torch.__version__}")
    times: dict[str, list[float]] = {name: [] for name in names}
    for step in range(args.steps + 1):
        for name in names:
            begin = time.perf_counter()
            optimizers[name].step()
            if step > 0:  # the first step allocates the moments
                times[name].append(time.perf_counter() - begin)
    baseline = statistics.median(times["torch AdamW (default)"])
    for name in names:
        median = statistics.median(times[name])
        print(f"{name:24s} median {median * 1e3:8.1f} ms/step  (min {min(times[name]) * 1e3:7.1f}, "
              f"{numel / median / 1e6:6.0f} M params/s, x{baseline / median:4.2f} vs default AdamW)")
    reference = params["torch AdamW (default)"]
    for name in names[1:]:
        worst = max((a - b).abs().max().item() for a, b in zip(params[name], reference))
        print(f"max |{name} - default AdamW| after {args.steps + 1} steps: {worst:.2e}")


if __name__ == "__main__":
    main()
