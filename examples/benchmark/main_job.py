"""Time the main job end to end and measure the peak memory of all its processes together.

    python examples/benchmark/main_job.py                       # recipe=grpo_math, model cache kept
    python examples/benchmark/main_job.py --fresh-model-cache   # include the one-time model provisioning
    python examples/benchmark/main_job.py -- trainer.total_steps=5   # extra overrides after --

Prints wall-clock seconds, the peak of the summed RSS over the driver and every process it starts
(Ray, workers, reward processes), and the validation reward/accuracy before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grpo_vs_trl import REPO_ROOT, run_measured  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipe", default="grpo_math")
    parser.add_argument("--fresh-model-cache", action="store_true",
                        help="provision the model into a new, empty cache (counts the download + conversion)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="rlframe_main_job_"))
    if args.fresh_model_cache:
        os.environ["RLFRAME_CACHE"] = str(workdir / "cache")
    run_dir = workdir / "run"
    cmd = [sys.executable, "-m", "rlframe.main", f"recipe={args.recipe}", f"trainer.run_dir={run_dir}", *args.overrides]
    start = time.perf_counter()
    code, peak = run_measured(cmd, REPO_ROOT, workdir / "main_job.log")
    wall = time.perf_counter() - start
    if code != 0:
        sys.exit(f"the main job exited {code}; see {workdir / 'main_job.log'}")
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    vals = [m for m in metrics if "val/reward_mean" in m]
    print(f"wall clock: {wall:.0f} s ({wall / 60:.1f} min); peak RSS of all processes: {peak:.2f} GiB")
    for m in vals:
        print(f"step {m['step']:>3}: val/reward_mean={m['val/reward_mean']:.3f} val/accuracy={m['val/accuracy']:.3f}")
    phases = sorted({k for m in metrics for k in m if k.startswith("perf/peak_mem_gib/")})
    if phases:
        print("worker peak memory per phase, largest over the steps (GiB): " + ", ".join(
            f"{k.removeprefix('perf/peak_mem_gib/')} {max(m.get(k, 0.0) for m in metrics):.2f}" for k in phases))
    print(f"log: {workdir / 'main_job.log'}; run: {run_dir}")


if __name__ == "__main__":
    main()
