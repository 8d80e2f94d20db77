"""How rlframe's GRPO step grows: with the batch, with the response length, with trainer ranks.

    python examples/benchmark/scaling.py                     # all three sweeps, 3 steps per point
    python examples/benchmark/scaling.py --sweep batch       # one sweep: batch | length | world
    python examples/benchmark/scaling.py --steps 2 --engine hf
    python examples/benchmark/scaling.py --batch-sizes 4,8,16     # a shorter batch sweep

Sweeps (recipe grpo_math, the embedded default model, 8 samples per prompt unless said):
  batch:  4, 8, 16, 32 prompts x 8 samples, responses <= 48 tokens
  length: responses <= 48, 128, 256 tokens, 4 prompts x 8 samples
  world:  actor.world_size 1 vs 2 (on the same machine), 4 prompts x 8 samples
For each point: median seconds per step over the measured steps (the first step, which includes warm-up,
is not measured), the median seconds of each phase, seconds per sample, generated tokens per second and
the run's peak RSS. The last column compares the step's growth with the growth of the tokens it
processes (samples x mean prompt + response length, measured) against the sweep's first point (1.00 = time grew exactly as the work did; < 1 = better than linear, e.g. a fixed
cost amortised; > 1 = worse, e.g. attention's quadratic term or memory pressure).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grpo_vs_trl import REPO_ROOT, run_measured  # noqa: E402

BASE = {"rollout.n": 8, "data.train_batch_size": 4, "actor.ppo_mini_batch_size": 4, "data.max_response_length": 48,
        "actor.world_size": 1}


def sweeps(batch_sizes: list[int]) -> dict[str, list[dict]]:
    return {"batch": [{"data.train_batch_size": p, "actor.ppo_mini_batch_size": p} for p in batch_sizes],
            "length": [{"data.max_response_length": length} for length in (48, 128, 256)],
            "world": [{"actor.world_size": w} for w in (1, 2)]}


def run_point(overrides: dict, args, run_dir: Path) -> dict:
    settings = {**BASE, **overrides}
    cmd = [sys.executable, "-m", "rlframe.main", "recipe=grpo_math", f"trainer.run_dir={run_dir}",
           f"trainer.total_steps={args.steps}", f"rollout.engine={args.engine}", "trainer.val_before_train=false",
           "trainer.val_at_end=false", "trainer.export_hf=false", *[f"{k}={v}" for k, v in settings.items()]]
    code, peak = run_measured(cmd, REPO_ROOT, run_dir.parent / f"{run_dir.name}.log")
    if code != 0:
        return {"failed": f"exit {code}, see {run_dir.parent / f'{run_dir.name}.log'}"}
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = [s for s in steps if s["step"] >= 2] or [s for s in steps if s["step"] >= 1]
    samples = settings["data.train_batch_size"] * settings["rollout.n"]
    phases = ("rollout", "ref_log_prob", "update", "weight_sync")
    step = statistics.median(s["timing/step"] for s in timed)
    return {"s/step": step, **{p: statistics.median(s.get(f"timing/{p}", 0.0) for s in timed) for p in phases},
            "s/sample": step / samples,
            "gen tok/s": statistics.median(s["response_length/mean"] * samples / s["timing/step"] for s in timed),
            # prompt + response tokens through the update (its tokens/s x its seconds)
            "tokens/step": statistics.median(s["perf/tokens_per_s/update"] * s["timing/update"] for s in timed),
            "peak GiB": peak}


def print_sweep(name: str, points: list[dict], results: list[dict]) -> None:
    columns = ["s/step", "rollout", "ref_log_prob", "update", "weight_sync", "s/sample", "gen tok/s", "peak GiB"]
    print(f"\n== {name} ==")
    print(f"{'point':<34}" + "".join(f"{c:>13}" for c in columns) + f"{'time/work':>11}")
    base = next((r for r in results if "failed" not in r), None)
    for overrides, result in zip(points, results):
        label = " ".join(f"{k.split('.')[-1]}={v}" for k, v in overrides.items())
        if "failed" in result:
            print(f"{label:<34}FAILED: {result['failed']}")
            continue
        growth = (result["s/step"] / base["s/step"]) / (result["tokens/step"] / base["tokens/step"])
        print(f"{label:<34}" + "".join(f"{result[c]:>13.2f}" for c in columns) + f"{growth:>11.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", choices=["batch", "length", "world", "all"], default="all")
    parser.add_argument("--batch-sizes", default="4,8,16,32", help="prompts per step in the batch sweep")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--engine", default="auto", help="rollout.engine: auto | vllm | hf")
    parser.add_argument("--workdir")
    args = parser.parse_args()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="rlframe_scaling_"))
    workdir.mkdir(parents=True, exist_ok=True)
    chosen = sweeps([int(p) for p in args.batch_sizes.split(",")])
    summary, done = {}, {}  # done: one run per distinct configuration (the sweeps share their first point)
    for name in chosen if args.sweep == "all" else [args.sweep]:
        results = []
        for i, overrides in enumerate(chosen[name]):
            key = tuple(sorted({**BASE, **overrides}.items()))
            if key not in done:
                print(f"{name} point {i + 1}/{len(chosen[name])}: {overrides}", flush=True)
                done[key] = run_point(overrides, args, workdir / f"{name}_{i}")
            results.append(done[key])
        print_sweep(name, chosen[name], results)
        summary[name] = [{"overrides": o, **r} for o, r in zip(chosen[name], results)]
    (workdir / "scaling.json").write_text(json.dumps(summary, indent=2))
    print(f"\nlogs and results: {workdir}")


if __name__ == "__main__":
    main()
