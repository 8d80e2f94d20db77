"""Check the GPU path of the actor without Ray or vLLM, and print figures (one prepared script).

    python examples/benchmark/gpu_check.py                 # CUDA: ~0.5B Qwen2-shaped random model
    python examples/benchmark/gpu_check.py --size tiny --device cpu   # the same script on a CPU (smoke test)

1. correctness: response log-probs of the sharded bf16 actor (FSDP2 mixed precision, SDPA or
   flash-attn) vs an fp32 copy on small inputs; packed (varlen) vs padded forward;
2. speed: `update` on a synthetic rollout batch, a few steps: tokens/s and model FLOPs utilisation
   against the bf16 (GPU) / fp32 (CPU) matmul peak measured here; peak device memory;
3. offload: the same update with parameters and optimizer state offloaded to the host (GPU):
   seconds and peak memory next to the resident run;
4. checkpoints: sharded (torch.distributed.checkpoint) save and load of the actor, seconds, and the
   weights after the load equal to those saved.
Figures are printed and written as JSON to $OUT/gpu_check.json when $OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

SIZES = {  # Qwen2-shaped configs
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936),
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1024),
}


def build_model_dir(size: str) -> tuple[str, int]:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**SIZES[size], max_position_embeddings=4096, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    out = tempfile.mkdtemp(prefix=f"gpu_check_{size}_")
    model.save_pretrained(out, safe_serialization=True)
    return out, sum(p.numel() for p in model.parameters())


def synthetic_batch(vocab: int, batch: int, prompt: int, response: int):
    from rlframe.protocol import DataProto

    g = torch.Generator().manual_seed(0)
    prompt_mask = torch.ones(batch, prompt, dtype=torch.long)
    prompt_mask[::2, : prompt // 3] = 0
    response_mask = torch.ones(batch, response)
    response_mask[1::2, response // 2:] = 0
    attention_mask = torch.cat([prompt_mask, response_mask.long()], 1)
    ids = torch.randint(0, vocab, (batch, prompt + response), generator=g)
    return DataProto.from_dict(tensors={
        "input_ids": ids, "responses": ids[:, prompt:], "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(1) - 1).clamp(min=0), "response_mask": response_mask,
        "advantages": torch.randn(batch, 1, generator=g).expand(batch, response) * response_mask,
        "old_log_probs": -torch.rand(batch, response, generator=g), "ref_log_prob": -torch.rand(batch, response, generator=g),
    })


def matmul_peak_tflops(device: str, dtype: torch.dtype, size: int = 8192 if torch.cuda.is_available() else 1024) -> float:
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(device)
    reps = 20 if device == "cuda" else 3
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(device)
    return 2 * size**3 * reps / (time.perf_counter() - start) / 1e12


def peak_memory_gib(device: str) -> float | None:
    if device != "cuda":
        import psutil

        return psutil.Process().memory_info().rss / 2**30  # resident memory now (CPU smoke test)
    return torch.cuda.max_memory_allocated() / 2**30


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", choices=list(SIZES), default="0.5b")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--response", type=int, default=512)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()

    from rlframe.device import detect_profile
    from rlframe.workers.engine import build_engine
    from rlframe.workers.objectives import PolicyObjective
    from rlframe.workers.settings import (DeviceRequest, EngineSettings, ForwardSettings, OptimSettings,
                                         PolicyLossSettings, UpdateLoop)

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    # the workers' group: CUDA tensors over NCCL, CPU tensors (offloaded gradients' norm) over gloo
    dist.init_process_group("cpu:gloo,cuda:nccl" if args.device == "cuda" else "gloo", rank=0, world_size=1)
    if args.device == "cuda":
        torch.cuda.set_device(0)
    model_dir, n_params = build_model_dir(args.size)
    profile = detect_profile(args.device, "auto", "auto", "hf")
    figures: dict = {"device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
                     "params": n_params, "dtype": str(profile.dtype), "attention": profile.attn_implementation}

    # 1. correctness on small inputs: sharded (bf16 on GPU) vs fp32 reference, packed vs padded
    small = synthetic_batch(SIZES[args.size]["vocab_size"], batch=4, prompt=32, response=32)
    def engine(device: DeviceRequest, train: bool, packed: str):
        settings = EngineSettings(model_path=model_dir, device=device, use_remove_padding=packed,
                                  optim=OptimSettings(lr=1e-6) if train else None)
        return build_engine(settings, device.profile())

    actor = engine(DeviceRequest(args.device, "auto", "auto", "hf"), train=True, packed="false")
    reference = engine(DeviceRequest("cpu", "float32", "sdpa", "hf"), train=False, packed="false")
    mask = small.batch["response_mask"]
    forward = ForwardSettings(micro_batch_size=4)
    lp_actor = actor.forward(small, forward)["log_probs"]
    lp_ref = reference.forward(small, forward)["log_probs"]
    figures["logprob_max_abs_diff_vs_fp32"] = float(((lp_actor.float().cpu() - lp_ref) * mask).abs().max())
    actor.packed = True
    lp_packed = actor.forward(small, forward)["log_probs"]
    actor.packed = profile.is_gpu
    figures["packed_vs_padded_max_abs_diff"] = float(((lp_packed.cpu() - lp_actor.cpu()) * mask).abs().max())
    del reference
    loop = UpdateLoop(mini_batch_size=args.batch, micro_batch_size=4, shuffle=False)

    # 2. speed: a few PPO updates on a full-size synthetic batch
    batch = synthetic_batch(SIZES[args.size]["vocab_size"], args.batch, args.prompt, args.response)
    tokens = int(batch.batch["attention_mask"].sum())
    times = []
    for step in range(args.steps):
        sync(args.device)
        start = time.perf_counter()
        actor.train_step(batch, loop, PolicyObjective(PolicyLossSettings(), on_policy=False), seed=step)
        sync(args.device)
        times.append(time.perf_counter() - start)
    best = min(times[1:] or times)
    figures["update_tokens_per_s"] = tokens / best
    achieved = 6 * n_params * tokens / best / 1e12
    peak = matmul_peak_tflops(args.device, profile.dtype)
    figures.update(achieved_tflops=achieved, matmul_peak_tflops=peak, mfu=achieved / peak,
                   update_seconds=best, peak_memory_gib=peak_memory_gib(args.device))

    # 3. the same update with the parameters and the optimizer state on the host between phases
    if args.device == "cuda":
        del actor
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        offloaded = build_engine(EngineSettings(model_path=model_dir, device=DeviceRequest(args.device, "auto", "auto", "hf"),
                                                optim=OptimSettings(lr=1e-6), offload_params=True, offload_optimizer=True),
                                 profile)
        sync(args.device)
        start = time.perf_counter()
        offloaded.reload()
        offloaded.train_step(batch, loop, PolicyObjective(PolicyLossSettings(), on_policy=False), seed=0)
        offloaded.offload()
        sync(args.device)
        figures.update(offload_update_seconds=time.perf_counter() - start, offload_peak_memory_gib=peak_memory_gib(args.device))
        actor = offloaded

    # 4. a sharded checkpoint of the actor: save, load into a fresh engine, compare
    import dataclasses

    with tempfile.TemporaryDirectory(prefix="gpu_check_ckpt_") as folder:
        actor.settings = dataclasses.replace(actor.settings, checkpoint_format="sharded")
        start = time.perf_counter()
        actor.save_state(folder, tokenizer_source=None)
        figures["sharded_save_seconds"] = time.perf_counter() - start
        fresh = engine(DeviceRequest(args.device, "auto", "auto", "hf"), train=True, packed="false")
        start = time.perf_counter()
        fresh.load_state(folder)
        figures["sharded_load_seconds"] = time.perf_counter() - start
        saved = dict(actor.iter_full_weights())
        loaded = dict(fresh.iter_full_weights())
        figures["sharded_roundtrip_exact"] = all(torch.equal(saved[k].cpu(), loaded[k].cpu()) for k in saved)
    for key, value in figures.items():
        print(f"{key:>32}: {value}")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_check.json").write_text(json.dumps(figures, indent=2))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
