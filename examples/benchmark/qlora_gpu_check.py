"""Check LoRA / QLoRA on the actor's engine without Ray or vLLM, and print figures (one prepared script).

    python examples/benchmark/qlora_gpu_check.py                        # CUDA: QLoRA (NF4 base) on a ~0.5B model
    python examples/benchmark/qlora_gpu_check.py --no-4bit              # CUDA: LoRA over the bf16 base (FSDP2)
    python examples/benchmark/qlora_gpu_check.py --size tiny --device cpu --no-4bit   # CPU smoke test

On a random-init Qwen2-shaped model saved to a temporary folder, with the FSDP engine built as the
actor builds it (`build_engine`, `model.lora` settings):
1. the reference log-probs (adapters disabled) equal those of the same base built without LoRA;
2. a few GRPO-style updates move only adapter parameters; the optimizer holds only them;
3. the merged weights (`iter_full_weights`: dequantized NF4 + alpha/r B A) loaded into a plain bf16
   model reproduce the adapted model's log-probs (gap printed; NF4 dequantization is exact, so the
   gap is bf16 rounding);
4. figures: seconds per update, tokens/s, peak GPU memory, trainable parameters.
Needs a CUDA GPU and bitsandbytes for the 4-bit base (`pip install -e ".[gpu]"`); with CPU or
without bitsandbytes the engine stops with the error naming model.lora.load_in_4bit.
Figures are printed and written as JSON to $OUT/qlora_gpu_check.json when $OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_check import SIZES, build_model_dir, synthetic_batch  # noqa: E402


def build_actor_engine(model_dir: str, device: str, lora, lr: float = 1e-4):
    from rlframe.workers.engine import build_engine
    from rlframe.workers.settings import DeviceRequest, EngineSettings, OptimSettings

    request = DeviceRequest(device=device, dtype="auto", attn_implementation="sdpa", rollout_engine="hf")
    settings = EngineSettings(model_path=model_dir, device=request, use_remove_padding="true",
                              optim=OptimSettings(lr=lr) if lora.enabled else None, lora=lora)
    return build_engine(settings, request.profile(), name="actor")


def response_log_probs(engine, batch) -> torch.Tensor:
    from rlframe.workers.settings import ForwardSettings

    return engine.forward(batch, ForwardSettings(micro_batch_size=8))["log_probs"]


def main() -> None:
    from rlframe.workers.objectives import PolicyObjective
    from rlframe.workers.settings import LoraSettings, PolicyLossSettings, UpdateLoop

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="0.5b", choices=sorted(SIZES))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-4bit", action="store_true", help="LoRA over the full-precision base instead of NF4")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    if not dist.is_initialized():
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo", init_method="tcp://127.0.0.1:29571",
                                rank=0, world_size=1)
    model_dir, n_params = build_model_dir(args.size)
    vocab = SIZES[args.size]["vocab_size"]
    lora = LoraSettings(rank=args.rank, alpha=2.0 * args.rank, load_in_4bit=not args.no_4bit)
    batch = synthetic_batch(vocab, args.batch, 96, 64)
    mask = batch.batch["response_mask"].bool()
    figures = {"size": args.size, "params": n_params, "device": args.device, "load_in_4bit": lora.load_in_4bit,
               "rank": args.rank}
    checks: dict[str, bool] = {}  # recorded, printed with the figures, asserted at the end

    engine = build_actor_engine(model_dir, args.device, lora)
    if lora.load_in_4bit:
        # the reference must be the SAME (quantized) base: compare with the engine's own disabled adapters before
        # training, then after training (B = 0 at the start, so they must also equal the adapted model's then)
        with engine.adapters_disabled():
            ref_start = response_log_probs(engine, batch)
        checks["adapted_equals_base_at_start"] = torch.equal(response_log_probs(engine, batch), ref_start)
    else:
        base = build_actor_engine(model_dir, args.device, LoraSettings())  # the same base, frozen, no adapters
        ref_start = response_log_probs(base, batch)
        with engine.adapters_disabled():
            checks["ref_equals_base_model_exactly"] = torch.equal(response_log_probs(engine, batch), ref_start)
        del base
    trainable = {n for n, p in engine.model.named_parameters() if p.requires_grad}
    checks["only_adapters_trainable"] = bool(trainable) and all(".lora_" in n for n in trainable)
    figures["trainable_params"] = sum(p.numel() for p in engine.model.parameters() if p.requires_grad)
    frozen_before = {n: p.detach().clone() for n, p in engine.model.named_parameters() if not p.requires_grad}

    batch.batch["old_log_probs"] = response_log_probs(engine, batch)
    loop = UpdateLoop(mini_batch_size=args.batch, micro_batch_size=args.batch // 2, shuffle=False)
    objective = PolicyObjective(PolicyLossSettings(use_kl_loss=True, kl_loss_coef=0.01), on_policy=False)
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for step in range(args.steps):
        start = time.perf_counter()
        metrics = engine.train_step(batch, loop, objective, seed=step)
        if args.device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    figures["seconds_per_update"] = sorted(times)[len(times) // 2]
    figures["train_tokens_per_s"] = metrics["perf/actor_train_tokens_per_s"]
    if args.device == "cuda":
        figures["peak_gpu_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    checks["base_unchanged_by_updates"] = all(torch.equal(p, frozen_before[n])
                                              for n, p in engine.model.named_parameters() if not p.requires_grad)
    with engine.adapters_disabled():
        checks["ref_unchanged_by_updates"] = torch.equal(response_log_probs(engine, batch), ref_start)
    adapted = response_log_probs(engine, batch)
    figures["adapted_vs_ref_gap"] = float((adapted - ref_start)[mask].abs().mean())

    from transformers import AutoModelForCausalLM

    from rlframe.workers.engine.hf_model import forward_response_log_probs

    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    merged = dict(engine.iter_full_weights(dtype=dtype))
    plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa").to(args.device)
    missing, unexpected = plain.load_state_dict(merged, strict=False)
    checks["merged_names_are_the_base_names"] = not unexpected and not [k for k in missing if k != "lm_head.weight"]
    inputs = {k: batch.batch[k].to(args.device) for k in ("input_ids", "attention_mask", "position_ids")}
    with torch.no_grad():
        merged_lp, _ = forward_response_log_probs(plain.eval(), **inputs, response_width=batch.batch["responses"].size(1))
    gap = (merged_lp.float().cpu() - adapted)[mask].abs()
    figures["merged_vs_adapted_gap_mean"], figures["merged_vs_adapted_gap_max"] = float(gap.mean()), float(gap.max())
    checks["adapters_moved_the_policy"] = figures["adapted_vs_ref_gap"] > 1e-4
    figures["checks"] = checks
    print(json.dumps(figures, indent=1))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "qlora_gpu_check.json").write_text(json.dumps(figures, indent=1))
    failed = [name for name, ok in checks.items() if not ok]
    assert not failed, f"failed checks: {failed}"


if __name__ == "__main__":
    main()
