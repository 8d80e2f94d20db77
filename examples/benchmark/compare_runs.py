"""Compare two runs' metrics.jsonl: every non-timing metric of every step must be equal; step times side by side.

    python examples/benchmark/compare_runs.py runs/before runs/after

Timing-derived keys (timing/*, perf/* and weight_sync/seconds: seconds, throughput, MFU, peak memory) are
left out of the equality and summarised as the median step time of each run. Exit code 1 on any difference.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

TIMING_PREFIXES = ("timing/", "perf/")
TIMING_KEYS = {"weight_sync/seconds"}


def read_metrics(run_dir: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {row["step"]: row for row in rows}


def is_timing(key: str) -> bool:
    return key.startswith(TIMING_PREFIXES) or key in TIMING_KEYS


def differences(before: dict[int, dict], after: dict[int, dict]) -> list[str]:
    problems = []
    if sorted(before) != sorted(after):
        problems.append(f"steps differ: {sorted(before)} vs {sorted(after)}")
    for step in sorted(set(before) & set(after)):
        a = {k: v for k, v in before[step].items() if not is_timing(k)}
        b = {k: v for k, v in after[step].items() if not is_timing(k)}
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                problems.append(f"step {step} {key}: {a.get(key)!r} vs {b.get(key)!r}")
    return problems


def median_step_s(run: dict[int, dict]) -> float:
    return statistics.median(row["timing/step"] for step, row in run.items() if step > 0 and "timing/step" in row)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    args = parser.parse_args(argv)
    before, after = read_metrics(args.before), read_metrics(args.after)
    problems = differences(before, after)
    compared = sum(1 for step in before for key in before[step] if not is_timing(key))
    print(f"{len(before)} steps, {compared} non-timing values compared: "
          f"{'identical' if not problems else f'{len(problems)} differ'}")
    for problem in problems[:50]:
        print("  " + problem)
    print(f"median step time: {median_step_s(before):.2f} s before, {median_step_s(after):.2f} s after")
    last = max(before)
    for key in ("val/reward_mean", "val/accuracy"):
        if key in before.get(0, {}) and key in after.get(last, {}):
            print(f"{key}: {before[0][key]:.4f} -> {before[last].get(key, float('nan')):.4f} (before run), "
                  f"{after[0][key]:.4f} -> {after[last].get(key, float('nan')):.4f} (after run)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
