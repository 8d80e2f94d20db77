"""The feedback task through the gateway (the agent as a user's OpenAI-SDK program) vs the built-in agent loop.

    python examples/benchmark/gateway_vs_builtin.py [--steps 3] [--model smollm2-135m-instruct] [--out runs/bench]

Both runs are recipe=grpo_feedback_math on the same model and data, with the outcome estimator (grpo: the gateway
path has no per-turn reward positions) and validation on 8 prompts: once with the built-in loop and the
tools/feedback_math.py environment, once with examples/agents/feedback_agent.py through rollout.agent_program.
Printed per run, over the training steps after the first: generated tokens per second
(perf/generated_tokens_per_s), rollout time and step time, and turns (calls) per trajectory.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
COMMON = ["recipe=grpo_feedback_math", "algorithm.adv_estimator=grpo", "rollout.multi_turn.turn_rewards=final",
          "data.val_max_samples=8", "trainer.save_every=0"]
GATEWAY = ["rollout.multi_turn.enable=false", f"rollout.agent_program.path={REPO / 'examples/agents/feedback_agent.py'}",
           "rollout.agent_program.name=solve", "rollout.agent_program.max_concurrent_episodes=32",
           "rollout.agent_program.max_tokens_per_call=48"]


def run(name: str, extra: list[str], args) -> list[dict]:
    run_dir = Path(args.out).resolve() / name
    command = [sys.executable, "-m", "rlframe.main", *COMMON, f"trainer.total_steps={args.steps}",
               f"model.path={args.model}", f"trainer.run_dir={run_dir}", *extra]
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run each time
    print("+", " ".join(command), flush=True)
    subprocess.run(command, check=True, cwd=REPO, env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [m for m in map(json.loads, lines) if m["step"] > 1]  # the first step warms up


def summary(steps: list[dict]) -> dict:
    mean = lambda key: statistics.mean(m[key] for m in steps if key in m)  # noqa: E731
    turns = "gateway/calls_per_episode" if "gateway/calls_per_episode" in steps[0] else "agent/turns_mean"
    return {"generated tok/s": mean("perf/generated_tokens_per_s"), "rollout s": mean("timing/rollout"),
            "step s": mean("timing/step"), "calls per trajectory": mean(turns),
            "response tokens": mean("response_length/mean")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--out", default="runs/gateway_vs_builtin")
    args = parser.parse_args()
    results = {"built-in loop": summary(run("builtin", [], args)), "gateway": summary(run("gateway", GATEWAY, args))}
    keys = list(next(iter(results.values())))
    print(f"{'':22}" + "".join(f"{k:>22}" for k in keys))
    for name, values in results.items():
        print(f"{name:22}" + "".join(f"{values[k]:>22.2f}" for k in keys))


if __name__ == "__main__":
    main()
