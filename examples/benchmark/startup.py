"""Time to the first step and the exit: a run's start-up, steps and exit, timed from outside, and its orphans.

    python examples/benchmark/startup.py --case tiny2 --rounds 3
    python examples/benchmark/startup.py --case tiny_default --case main --rounds 3 \
        --checkout after=. --checkout before=/path/to/an/older/checkout/.venv/bin/python

Cases (each `python -m rlframe.main ...` in a process of its own, as a user runs it):

- ``tiny2``: the recipe test's sizes (tests/test_recipes.py TINY_SIZES) on a 2-layer random Llama built here;
- ``tiny_default``: the issue's embedded default at tiny sizes (SmolLM2-135M, 2 steps, no validation, no export);
- ``main``: the main job (`recipe=grpo_math`) cut to 1 step without the final validation and export: its
  command-to-step-1 time is the main job's.

Per run it prints: wall seconds; `to_step1` (from the command to the start of step 1: the moment the step-1
line is printed less that step's timing/step); the steps' own time (sum of timing/step); `exit` (from the
last line the run prints to the process's end); and `orphans`, the processes started by the run (they carry
a token in their environment) still alive 0.5 s after it ended. Each `--checkout NAME=PYTHON` is a Python whose
rlframe is the code to time (a checkout's venv); rounds interleave the checkouts (A B, B A, ...). With
`--json FILE` every run's figures are written there too. Run it under `heavy --exclusive` for figures.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
TOKEN_ENV = "RLFRAME_BENCH_TOKEN"

TINY_SIZES = ["trainer.total_steps=2", "data.arithmetic.n_train=64", "data.arithmetic.n_val=8", "data.val_max_samples=8",
              "data.max_prompt_length=256", "data.max_response_length=16", "data.train_batch_size=4",
              "actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size_per_device=4", "rollout.n=2",
              "trainer.num_cpus=4", "trainer.save_every=2"]
TINY_DEFAULT = ["trainer.total_steps=2", "data.train_batch_size=2", "rollout.n=2", "actor.ppo_mini_batch_size=2",
                "data.max_response_length=16", "trainer.val_before_train=false", "trainer.val_at_end=false",
                "trainer.export_hf=false"]
MAIN_TO_STEP1 = ["trainer.total_steps=1", "trainer.val_at_end=false", "trainer.export_hf=false"]


def tiny_model(folder: Path) -> Path:
    """The tests' tiny random Llama (tests/conftest.py build_tiny_model_dir), built once into `folder`."""
    if not (folder / "config.json").exists():
        sys.path.insert(0, str(REPO_ROOT / "tests"))
        from conftest import build_tiny_model_dir

        build_tiny_model_dir(folder)
    return folder


def case_args(case: str, work: Path) -> list[str]:
    if case == "tiny2":
        return ["recipe=grpo_math", *TINY_SIZES, f"model.path={tiny_model(work / 'tiny_llama')}"]
    if case == "tiny_default":
        return ["recipe=grpo_math", *TINY_DEFAULT]
    if case == "main":
        return ["recipe=grpo_math", *MAIN_TO_STEP1]
    raise SystemExit(f"error: unknown --case {case!r} (tiny2, tiny_default, main)")


def processes_with_token(token: str) -> list[int]:
    """Live processes whose environment carries TOKEN_ENV=token (everything the run started)."""
    found, needle = [], f"{TOKEN_ENV}={token}".encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    with open(f"/proc/{entry}/stat") as s:
                        if s.read().rsplit(")", 1)[1].split()[0] != "Z":  # zombies are gone, waiting for a reap
                            found.append(int(entry))
        except OSError:
            continue
    return found


def last_line(lines: list[tuple[float, str]]) -> float:
    """When the run's work ended: its last step, checkpoint or report line (what follows is the shutdown)."""
    ends = [t for t, text in lines if re.match(r"\s*(step\s+\d|checkpoint |report: )", text)]
    return ends[-1] if ends else lines[-1][0]


def run_once(python: str, args: list[str], work: Path, name: str) -> dict:
    run_dir = work / f"run-{name}-{uuid.uuid4().hex[:6]}"
    token = uuid.uuid4().hex
    env = {**os.environ, TOKEN_ENV: token, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1"}
    env.pop("RAY_ADDRESS", None)
    lines: list[tuple[float, str]] = []
    start = time.perf_counter()
    proc = subprocess.Popen([python, "-m", "rlframe.main", *args, f"trainer.run_dir={run_dir}"], cwd=work, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def read() -> None:
        for line in proc.stdout:
            lines.append((time.perf_counter() - start, line.rstrip("\n")))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    code = proc.wait()
    wall = time.perf_counter() - start
    reader.join(timeout=5)
    time.sleep(0.5)
    orphans = processes_with_token(token)
    (work / f"{run_dir.name}.log").write_text("\n".join(f"{t:8.2f} {text}" for t, text in lines))
    if code != 0:
        raise SystemExit(f"error: {name} exited {code}; see {work / (run_dir.name + '.log')}")
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if m["step"] > 0]
    step_lines = [t for t, text in lines if re.match(r"\s*step\s+1(/|\s|$)", text)]
    to_step1 = step_lines[0] - steps[0]["timing/step"] if step_lines else float("nan")
    out = {"checkout": name, "wall_s": wall, "to_step1_s": to_step1, "steps_s": sum(m["timing/step"] for m in steps),
           "exit_s": wall - last_line(lines), "orphans": len(orphans), "run_dir": str(run_dir)}
    first = metrics[0]
    out.update({k: v for k, v in first.items() if k.startswith(("timing/startup/", "val/reward_mean", "val/accuracy"))
                and "_ci_" not in k})
    for pid in orphans:  # leave the machine as it was for the next run
        try:
            os.kill(pid, 9)
        except OSError:
            pass
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", action="append", choices=["tiny2", "tiny_default", "main"])
    parser.add_argument("--checkout", action="append", default=[],
                        help="NAME=PYTHON: a Python whose rlframe is the code to time (default: this one)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--workdir", type=Path)
    args = parser.parse_args()
    checkouts = [c.split("=", 1) for c in args.checkout] or [["this", sys.executable]]
    work = args.workdir or Path(tempfile.mkdtemp(prefix="rlframe_startup_"))
    work.mkdir(parents=True, exist_ok=True)
    results = []
    for case in args.case or ["tiny2"]:
        for r in range(args.rounds):
            order = checkouts if r % 2 == 0 else checkouts[::-1]
            for name, python in order:
                result = {"case": case, "round": r, **run_once(python, case_args(case, work), work, name)}
                results.append(result)
                print(json.dumps(result), flush=True)
                if args.json:
                    args.json.write_text(json.dumps(results, indent=1))
    print("\nmedians:")
    for case in args.case or ["tiny2"]:
        for name, _ in checkouts:
            rows = [r for r in results if r["case"] == case and r["checkout"] == name]
            med = {k: statistics.median(r[k] for r in rows) for k in ("wall_s", "to_step1_s", "steps_s", "exit_s")}
            print(f"{case:13s} {name:8s} n={len(rows)} wall {med['wall_s']:6.1f} s, to step 1 {med['to_step1_s']:6.1f} s, "
                  f"steps {med['steps_s']:5.1f} s, start-up+exit {med['wall_s'] - med['steps_s']:6.1f} s, "
                  f"exit {med['exit_s']:4.1f} s, orphans max {max(r['orphans'] for r in rows)}")


if __name__ == "__main__":
    main()
