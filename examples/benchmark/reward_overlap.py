"""Step time with the code reward scored off the critical path (reward.overlap) vs in line.

    python examples/benchmark/reward_overlap.py [--steps 3] [--rounds 1] [--workdir /tmp/reward_overlap]

1. Generates a small set of programming problems (seeded): "write a Python program that reads x from
   stdin and prints f(x)" for simple integer functions f (affine, square plus constant, digit sum,
   absolute difference, ...), each with 4 stdin/stdout test cases in reward_fns/code.py's format, as
   a jsonl file in the common layout (prompt as a chat list, reward_model.ground_truth, data_source).
2. Runs `python -m rlframe.main recipe=grpo_math` on it with `reward.functions=[{path: reward_fns/code.py}]`,
   `reward.overlap=false` then `true` (alternating for --rounds rounds, a settle pause between), and
   reads each run's metrics.jsonl.
3. Prints, per mode: seconds per step (median, min, max over the steps), the scoring's own seconds
   (timing/reward), the seconds the driver blocked on the scores (timing/reward_wait_s), the
   reference pass it overlaps (timing/ref_log_prob), the share of responses with a code block and
   the mean reward; and the step-time difference.

The model is the recipe's (the embedded SmolLM2-135M-Instruct unless --model is given); it is weak,
so most of its programs fail, but each program with a code block is still run against every test
case in the sandbox: that is the scoring time this benchmark is about.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

FAMILIES = [
    ("prints {a} * x + {b}", lambda x, a, b: a * x + b),
    ("prints x * x + {b}", lambda x, a, b: x * x + b),
    ("prints the sum of the decimal digits of x (x >= 0)", lambda x, a, b: sum(int(d) for d in str(abs(x)))),
    ("prints the absolute difference between x and {a}", lambda x, a, b: abs(x - a)),
    ("prints x // {a} (integer division)", lambda x, a, b: x // a),
    ("prints the larger of x and {b}", lambda x, a, b: max(x, b)),
]


def generate_problems(n: int, seed: int = 0) -> list[dict]:
    """n problems in the common layout, each with 4 stdin/stdout test cases for reward_fns/code.py."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        text, fn = FAMILIES[i % len(FAMILIES)]
        a, b = rng.randint(2, 9), rng.randint(-5, 20)
        xs = [rng.randint(0, 50) for _ in range(4)]
        task = text.format(a=a, b=b)
        prompt = (f"Write a Python program that reads one integer x from standard input and {task}. "
                  "Answer with the program in one ```python code block.")
        tests = {"inputs": [f"{x}\n" for x in xs], "outputs": [f"{fn(x, a, b)}\n" for x in xs]}
        rows.append({"data_source": "generated_code", "prompt": [{"role": "user", "content": prompt}],
                     "ability": "code", "reward_model": {"ground_truth": json.dumps(tests)},
                     "extra_info": {"index": i, "family": text}})
    return rows


def write_jsonl(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def run(mode: bool, index: int, args, train: Path, val: Path) -> list[dict]:
    run_dir = Path(args.workdir) / f"overlap_{str(mode).lower()}_{index}"
    command = [sys.executable, "-m", "rlframe.main", "recipe=grpo_math", f"data.train_files={train}",
               f"data.val_files={val}", f"data.max_response_length={args.response_length}",
               f"data.train_batch_size={args.prompts}", f"actor.ppo_mini_batch_size={args.prompts}",
               f"rollout.n={args.samples}", "rollout.temperature=0.7",
               f"reward.functions=[{{path: {REPO / 'reward_fns' / 'code.py'}}}]", "reward.timeout_s=30",
               f"reward.num_workers={args.reward_workers}", f"reward.overlap={str(mode).lower()}",
               f"trainer.total_steps={args.steps}", "trainer.val_before_train=false", "trainer.val_at_end=false",
               "trainer.export_hf=false", f"trainer.run_dir={run_dir}", *args.overrides]
    if args.model:
        command.append(f"model.path={args.model}")
    print(f"$ {' '.join(command[1:])}", flush=True)
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"run failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if json.loads(line).get("step", 0) >= 1]


def summary(steps: list[dict]) -> dict:
    def mean(key):
        values = [s[key] for s in steps if key in s]
        return statistics.mean(values) if values else float("nan")

    times = [s["timing/step"] for s in steps]
    return {"step_median": statistics.median(times), "step_min": min(times), "step_max": max(times),
            "reward": mean("timing/reward"), "wait": mean("timing/reward_wait_s"), "ref": mean("timing/ref_log_prob"),
            "format": mean("reward/format_mean"), "score": mean("critic/score/mean"), "steps": len(steps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=1, help="off/on pairs, alternating")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--samples", type=int, default=8, help="rollout.n")
    parser.add_argument("--response-length", type=int, default=96)
    parser.add_argument("--reward-workers", type=int, default=2)
    parser.add_argument("--problems", type=int, default=48)
    parser.add_argument("--settle", type=float, default=10.0, help="seconds between runs")
    parser.add_argument("--model", default=None, help="model.path (default: the recipe's)")
    parser.add_argument("--workdir", default="/tmp/rlframe_reward_overlap")
    parser.add_argument("overrides", nargs="*", help="more key=value overrides for both modes")
    args = parser.parse_args()
    data = Path(args.workdir) / "data"
    train, val = data / "code_train.jsonl", data / "code_val.jsonl"
    write_jsonl(generate_problems(args.problems, seed=0), train)
    write_jsonl(generate_problems(8, seed=1), val)
    print(f"{args.problems} generated problems -> {train}", flush=True)

    results: dict[bool, list[dict]] = {False: [], True: []}
    for index in range(args.rounds):
        for mode in (False, True):
            if results[False] or results[True]:
                time.sleep(args.settle)
            results[mode].extend(run(mode, index, args, train, val))

    rows = {mode: summary(steps) for mode, steps in results.items()}
    print(f"\nreward_fns/code.py, {args.prompts} prompts x {args.samples} samples, <= {args.response_length} tokens, "
          f"{args.reward_workers} reward workers, {rows[False]['steps']} steps per mode")
    print(f"{'reward.overlap':<15}{'step s (median)':>16}{'min':>8}{'max':>8}{'scoring s':>11}{'waited s':>10}"
          f"{'ref pass s':>11}{'code block':>11}{'reward':>8}")
    for mode in (False, True):
        r = rows[mode]
        print(f"{str(mode).lower():<15}{r['step_median']:>16.2f}{r['step_min']:>8.2f}{r['step_max']:>8.2f}"
              f"{r['reward']:>11.2f}{r['wait']:>10.2f}{r['ref']:>11.2f}{r['format']:>11.2f}{r['score']:>8.3f}")
    saved = rows[False]["step_median"] - rows[True]["step_median"]
    print(f"step time saved by the overlap (median): {saved:.2f}s "
          f"({saved / rows[False]['step_median']:.1%}); blocked on the scores: {rows[False]['wait']:.2f}s -> "
          f"{rows[True]['wait']:.2f}s per step")


if __name__ == "__main__":
    main()
