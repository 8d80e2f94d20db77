"""LoRA vs full fine-tuning on the actor: weight-sync seconds and bytes, generation speed, trainer memory.

    python examples/benchmark/lora_weight_sync.py                      # SmolLM2-135M, vLLM if installed
    python examples/benchmark/lora_weight_sync.py --engine hf --rank 16

For each mode — full (no LoRA: every weight), merged (LoRA: W + alpha/r B A under the base names)
and adapter (LoRA: A and B only, the engine applies them) — the actor role runs in this process as a
plain object with its colocated rollout engine: one update on a synthetic batch, then N weight syncs
(seconds, bytes moved), one generation of the same prompts (tokens/s, engine vs trainer log-prob gap)
and the trainer's trainable parameters, gradient and optimizer-state bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT / "tests"))


def synthetic_rollout(vocab: int, n: int, prompt: int, response: int):
    from test_actor_data_parallel import synthetic_batch

    return synthetic_batch(vocab, n=n, prompt=prompt, response=response)


def optimizer_bytes(optimizer) -> int:
    return sum(v.numel() * v.element_size() for state in optimizer.state.values() for v in state.values()
               if hasattr(v, "numel"))


def bench_mode(model_path: str, mode: str, engine: str, rank: int, syncs: int, prompts: int, new_tokens: int) -> dict:
    import torch

    from rlframe.protocol import DataProto
    from rlframe.workers.roles.actor_rollout import ActorRolloutWorker
    from rlframe.workers.settings import (ActorSettings, DeviceRequest, EngineSettings, ForwardSettings, LoraSettings,
                                         OptimSettings, PolicyLossSettings, RolloutSettings, SamplingSettings,
                                         UpdateLoop)

    lora = LoraSettings(rank=rank, alpha=2.0 * rank) if mode != "full" else LoraSettings()
    device = DeviceRequest(device="cpu", dtype="float32", attn_implementation="sdpa", rollout_engine=engine)
    settings = ActorSettings(
        engine=EngineSettings(model_path=model_path, device=device, optim=OptimSettings(lr=1e-4), lora=lora),
        loop=UpdateLoop(mini_batch_size=prompts, micro_batch_size=prompts), loss=PolicyLossSettings(),
        log_prob=ForwardSettings(micro_batch_size=prompts),
        rollout=RolloutSettings(model_path=model_path, device=device, max_model_len=256,
                                train=SamplingSettings(max_new_tokens=new_tokens),
                                lora=lora if mode == "adapter" else None))
    actor = ActorRolloutWorker(settings)
    batch = synthetic_rollout(actor.engine.model.config.vocab_size, prompts, 24, 16)
    actor.update_actor(batch)
    timings = [actor.sync_weights() for _ in range(syncs)]
    width = batch.batch["prompts"].size(1)
    prompt_batch = DataProto.from_dict(tensors={"input_ids": batch.batch["prompts"],
                                                "attention_mask": batch.batch["attention_mask"][:, :width],
                                                "position_ids": batch.batch["position_ids"][:, :width]})
    actor.generate_sequences(prompt_batch)  # warm-up (vLLM compiles/caches on the first call)
    start = time.perf_counter()
    out = actor.generate_sequences(prompt_batch)
    seconds = time.perf_counter() - start
    mask = out.batch["response_mask"]
    trainer = actor.compute_log_prob(out).batch["old_log_probs"]
    gap = float(((trainer - out.batch["rollout_log_probs"]).abs() * mask).sum() / mask.sum())
    model = actor.engine.model
    trainable = [p for p in model.parameters() if p.requires_grad]
    return {"mode": mode, "engine": engine,
            "sync_s": sorted(t["timing/weight_sync_s"] for t in timings)[len(timings) // 2],
            "sync_mb": timings[0]["weight_sync/bytes"] / 2**20,
            "gen_tokens_per_s": float(mask.sum()) / seconds, "logprob_abs_diff": gap,
            "trainable_params_m": sum(p.numel() for p in trainable) / 1e6,
            "grad_mb": sum(p.numel() * p.element_size() for p in trainable) / 2**20,
            "optimizer_mb": optimizer_bytes(actor.engine.optimizer) / 2**20,
            "params_mb": sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20,
            "torch_threads": torch.get_num_threads()}


def main() -> None:
    import torch.distributed as dist

    from rlframe.device import vllm_available
    from rlframe.models.provision import resolve_model_path

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--engine", default="vllm" if vllm_available() else "hf", choices=["vllm", "hf"])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--syncs", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--modes", default="full,merged,adapter")
    parser.add_argument("--mode", help=argparse.SUPPRESS)  # internal: one mode in a child process
    args = parser.parse_args()
    model_path = resolve_model_path(args.model)
    if args.mode:  # one mode per process: engines and their memory do not outlive it
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29561", rank=0, world_size=1)
        print("RESULT " + json.dumps(bench_mode(model_path, args.mode, args.engine, args.rank, args.syncs,
                                                args.prompts, args.new_tokens)), flush=True)
        return
    import subprocess

    rows = []
    for mode in args.modes.split(","):
        cmd = [sys.executable, __file__, "--mode", mode, "--engine", args.engine, "--rank", str(args.rank),
               "--syncs", str(args.syncs), "--prompts", str(args.prompts), "--new-tokens", str(args.new_tokens),
               "--model", args.model]
        result = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO_ROOT)
        line = next((l for l in result.stdout.splitlines() if l.startswith("RESULT ")), None)
        if line is None:
            sys.exit(f"{mode} failed:\n{result.stderr[-3000:]}")
        rows.append(json.loads(line[len("RESULT "):]))
        print(rows[-1], flush=True)
    print(f"\n| mode ({args.engine}, rank {args.rank}) | sync s | sync MB | gen tok/s | logprob gap | trainable M | "
          "grads MB | Adam state MB |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['sync_s']:.3f} | {r['sync_mb']:.1f} | {r['gen_tokens_per_s']:.0f} | "
              f"{r['logprob_abs_diff']:.1e} | {r['trainable_params_m']:.2f} | {r['grad_mb']:.1f} | {r['optimizer_mb']:.1f} |")


if __name__ == "__main__":
    main()
