"""GRPO throughput: rlframe vs TRL's GRPOTrainer on the same workload, side by side.

    python examples/benchmark/grpo_vs_trl.py                 # both, 3 steps each, the embedded default
    python examples/benchmark/grpo_vs_trl.py --only rlframe  # one side
    python examples/benchmark/grpo_vs_trl.py --mode mfu      # rlframe's training FLOP/s vs the measured matmul peak

Same model (SmolLM2-135M-Instruct), same arithmetic prompts, same samples per prompt, same
maximum lengths, learning rate, KL coefficient, temperature and number of steps. Each framework
runs in its own process tree; peak resident memory is the largest sum of RSS over that tree
(sampled every 0.5 s). Needs `pip install trl` for the TRL side.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def sample_peak_rss(proc: subprocess.Popen, stop: threading.Event, out: dict) -> None:
    import psutil

    peak = 0
    while not stop.is_set():
        try:
            root = psutil.Process(proc.pid)
            total = sum(p.memory_info().rss for p in [root, *root.children(recursive=True)] if p.is_running())
            peak = max(peak, total)
        except psutil.Error:
            pass
        time.sleep(0.5)
    out["peak_rss_gib"] = peak / 2**30


def run_measured(cmd: list[str], cwd: Path, log_path: Path) -> float:
    stop, mem = threading.Event(), {}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
        sampler = threading.Thread(target=sample_peak_rss, args=(proc, stop, mem), daemon=True)
        sampler.start()
        code = proc.wait()
        stop.set()
        sampler.join()
    if code != 0:
        sys.exit(f"{cmd[:4]} failed (exit {code}); see {log_path}")
    return mem.get("peak_rss_gib", float("nan"))


# ---------------------------------------------------------------------------------- rlframe
def bench_rlframe(args, workdir: Path) -> dict:
    run_dir = workdir / "rlframe_run"
    cmd = [sys.executable, "-m", "rlframe.main", "recipe=grpo_math", f"trainer.run_dir={run_dir}",
           f"trainer.total_steps={args.steps}", f"data.train_batch_size={args.prompts}",
           f"actor.ppo_mini_batch_size={args.prompts}", f"rollout.n={args.n}",
           f"data.max_response_length={args.max_response}", f"actor.optim.lr={args.lr}",
           f"algorithm.kl_loss_coef={args.kl}", f"rollout.temperature={args.temperature}",
           "trainer.val_before_train=false", "trainer.val_at_end=false", "trainer.export_hf=false",
           *args.rlframe_override]
    peak = run_measured(cmd, REPO_ROOT, workdir / "rlframe.log")
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if s["step"] >= 1]
    timed = steps[1:] if len(steps) > 1 else steps  # the first step includes warm-up
    phases = sorted({k for s in timed for k in s if k.startswith("timing/") and k != "timing/step"})
    seq_per_step = args.prompts * args.n
    return {
        "sec_per_step": statistics.median(s["timing/step"] for s in timed),
        "gen_tokens_per_s": statistics.median(s["response_length/mean"] * seq_per_step / s["timing/step"] for s in timed),
        "trained_tokens_per_s": statistics.median(s["perf/actor_train_tokens_per_s"] for s in timed),
        "samples_per_s": statistics.median(seq_per_step / s["timing/step"] for s in timed),
        "peak_rss_gib": peak,
        "phases": {p.removeprefix("timing/"): statistics.median(s.get(p, 0.0) for s in timed) for p in phases},
        "reward_mean": [round(s["critic/score/mean"], 3) for s in steps],
    }


# ---------------------------------------------------------------------------------- TRL
def trl_worker(args) -> None:
    """Runs inside its own process: TRL's GRPOTrainer on the same data, prints per-step JSON."""
    import importlib.util

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlframe.data.arithmetic import generate_arithmetic_dataset
    from rlframe.data.dataset import read_rows
    from rlframe.models.provision import resolve_model_path

    torch.set_num_threads(os.cpu_count())
    spec = importlib.util.spec_from_file_location("user_math_reward", REPO_ROOT / "reward_fns" / "math.py")
    reward_module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reward_module)

    def math_reward(prompts, completions, ground_truth, **kwargs):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [reward_module.compute_score("arithmetic", t, g)["score"] for t, g in zip(texts, ground_truth)]

    train_path, _ = generate_arithmetic_dataset(Path(args.workdir) / "data", n_train=2000, n_val=64, seed=0,
                                                max_operand=10)
    rows = read_rows(train_path)
    dataset = Dataset.from_list([{"prompt": r["prompt"], "ground_truth": r["reward_model"]["ground_truth"]} for r in rows])
    model_path = resolve_model_path("smollm2-135m-instruct")
    seqs = args.prompts * args.n
    config = GRPOConfig(
        output_dir=str(Path(args.workdir) / "trl_out"), max_steps=args.steps, learning_rate=args.lr, beta=args.kl,
        num_generations=args.n, per_device_train_batch_size=seqs, gradient_accumulation_steps=1,
        max_completion_length=args.max_response, temperature=args.temperature, logging_steps=1,
        bf16=False, fp16=False, use_cpu=True, report_to=[], save_strategy="no", seed=0, num_iterations=1,
        loss_type="dapo", dataloader_num_workers=0, gradient_checkpointing=False)
    times: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.start = time.perf_counter()

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter() - self.start)

    logs: list[dict] = []

    class LogCollector(TrainerCallback):
        def on_log(self, _args, _state, _control, logs_=None, **kwargs):
            logs.append(dict(kwargs.get("logs") or logs_ or {}))

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    trainer = GRPOTrainer(model=model, reward_funcs=math_reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[StepTimer(), LogCollector()])
    trainer.train()
    print("TRL_RESULT " + json.dumps({"times": times, "logs": logs}), flush=True)


def bench_trl(args, workdir: Path) -> dict:
    cmd = [sys.executable, __file__, "--trl-worker", "--workdir", str(workdir), "--steps", str(args.steps),
           "--prompts", str(args.prompts), "--n", str(args.n), "--max-response", str(args.max_response),
           "--lr", str(args.lr), "--kl", str(args.kl), "--temperature", str(args.temperature)]
    peak = run_measured(cmd, REPO_ROOT, workdir / "trl.log")
    line = next(l for l in (workdir / "trl.log").read_text().splitlines() if l.startswith("TRL_RESULT "))
    result = json.loads(line.removeprefix("TRL_RESULT "))
    times = result["times"][1:] if len(result["times"]) > 1 else result["times"]
    step_logs = [l for l in result["logs"] if "completions/mean_length" in l]
    seqs = args.prompts * args.n
    lengths = [l["completions/mean_length"] for l in step_logs][-len(times):] or [float("nan")]
    sec = statistics.median(times)
    return {"sec_per_step": sec, "gen_tokens_per_s": statistics.median(lengths) * seqs / sec,
            "trained_tokens_per_s": float("nan"), "samples_per_s": seqs / sec, "peak_rss_gib": peak,
            "reward_mean": [round(l.get("reward", float("nan")), 3) for l in step_logs]}


# ---------------------------------------------------------------------------------- MFU
def measure_matmul_peak_gflops(size: int = 2048, reps: int = 10) -> float:
    import torch

    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.mm(a, b)
    start = time.perf_counter()
    for _ in range(reps):
        torch.mm(a, b)
    return 2 * size**3 * reps / (time.perf_counter() - start) / 1e9


def report_mfu(rl: dict) -> None:
    params = 134.5e6  # SmolLM2-135M
    achieved = 6 * params * rl["trained_tokens_per_s"] / 1e9  # forward + backward, the 6N rule
    peak = measure_matmul_peak_gflops()
    print(f"training: {rl['trained_tokens_per_s']:.1f} tokens/s -> {achieved:.1f} GFLOP/s (6N rule); "
          f"fp32 matmul peak here {peak:.1f} GFLOP/s; MFU {achieved / peak:.1%}")


def print_table(results: dict[str, dict]) -> None:
    keys = ["sec_per_step", "samples_per_s", "gen_tokens_per_s", "trained_tokens_per_s", "peak_rss_gib"]
    names = list(results)
    print(f"{'metric':<24}" + "".join(f"{n:>14}" for n in names) + ("      rlframe/TRL" if len(names) == 2 else ""))
    for key in keys:
        row = f"{key:<24}" + "".join(f"{results[n][key]:>14.2f}" for n in names)
        if len(names) == 2 and results["trl"][key]:
            row += f"{results['rlframe'][key] / results['trl'][key]:>17.2f}"
        print(row)
    if "rlframe" in results:
        print("rlframe phases (median s):", {k: round(v, 2) for k, v in results["rlframe"]["phases"].items()})
    for name in names:
        print(f"{name} reward per step: {results[name]['reward_mean']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-response", type=int, default=48)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--kl", type=float, default=0.001)
    parser.add_argument("--temperature", type=float, default=0.5)
    parser.add_argument("--only", choices=["rlframe", "trl"])
    parser.add_argument("--rlframe-override", action="append", default=[], metavar="KEY=VALUE",
                        help="extra rlframe config override (repeatable), e.g. actor.use_remove_padding=false")
    parser.add_argument("--mode", choices=["throughput", "mfu"], default="throughput")
    parser.add_argument("--workdir")
    parser.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_worker:
        return trl_worker(args)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="rlframe_bench_"))
    workdir.mkdir(parents=True, exist_ok=True)
    results = {}
    if args.only in (None, "rlframe"):
        results["rlframe"] = bench_rlframe(args, workdir)
    if args.mode == "mfu":
        return report_mfu(results["rlframe"])
    if args.only in (None, "trl"):
        results["trl"] = bench_trl(args, workdir)
    print_table(results)
    (workdir / "results.json").write_text(json.dumps(results, indent=2))
    print(f"logs and results: {workdir}")


if __name__ == "__main__":
    main()
