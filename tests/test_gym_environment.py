"""Gymnasium environments in the agent loop (workers/rollout/gym_environment.py): a gymnasium.Env with text
observations and actions runs unchanged (scripted engine double: the loop and the envs are real); environments
start concurrently; and one tiny end-to-end run trains 2 steps with a Gymnasium env and an MCP server's tools."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import sys

import numpy as np
import pytest

from helpers_tokenizer import build_tokenizer
from rlframe.workers.rollout.agent_loop import END_ANSWER, END_ENV_ERROR, END_TURN_LIMIT, AgentLoop, ObservationRenderer
from rlframe.workers.rollout.gym_environment import GymEnvironment, is_gym_environment, row_seed
from rlframe.workers.rollout.tools import load_environment
from rlframe.workers.settings import MultiTurnSettings, SamplingSettings
from test_agent_loop import TOOLS, ScriptedEngine, SteppedScriptedEngine, ids, prompt_batch

REPO = Path(__file__).resolve().parents[1]
GYM_EXAMPLE = str(REPO / "examples" / "agents" / "gym_math_feedback.py")
SAMPLING = SamplingSettings(max_new_tokens=256, temperature=1.0)
# tests/agent_tools.py as the agent loop imports it (a module of its own: its globals are the ones the envs see)
agent_tools = sys.modules[load_environment(TOOLS, "CountdownEnv").__module__]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def env_loop(engine, tok, name: str, path: str = TOOLS, **settings) -> AgentLoop:
    settings = {"format": "tag", "max_turns": 5, "tool_prompt": False, **settings}
    return AgentLoop(engine, MultiTurnSettings(tools=(), environment=(path, name), **settings), tok)


def with_rows(batch, truths):
    batch.non_tensor_batch["env_row"] = np.array([{"ground_truth": t} for t in truths], dtype=object)
    return batch


def test_the_forms_are_told_apart():
    assert is_gym_environment(agent_tools.GymTextEnv) and is_gym_environment(agent_tools.GymShapedEnv)
    assert not is_gym_environment(agent_tools.CountdownEnv)
    assert isinstance(load_environment(TOOLS, "GymTextEnv")(), GymEnvironment)
    assert isinstance(load_environment(TOOLS, "CountdownEnv")(), agent_tools.CountdownEnv)  # ours: the class itself
    assert row_seed({"ground_truth": "7"}) == row_seed({"ground_truth": "7"}) != row_seed({"ground_truth": "8"})
    assert row_seed(None) is None


def test_a_gymnasium_env_runs_unchanged(tok):
    """reset(seed, options=row)'s observation joins the prompt; each step's observation is the next user message
    and its reward the turn's; terminated ends with an answer, truncated at the turn limit; close() is called."""
    pa, pb = ids(tok, "Alpha <|im_start|>user\nA", eos=False), ids(tok, "Beta <|im_start|>user\nB", eos=False)
    go, stop = ids(tok, "go on"), ids(tok, "stop now")
    engine = ScriptedEngine(tok, {tuple(pa[:3]): [go, stop], tuple(pb[:3]): [go, go, go]})
    agent_tools.CLOSED.clear()
    loop = env_loop(engine, tok, "GymTextEnv")
    out = loop.run(with_rows(prompt_batch(tok, [pa, pb]), ["7", "8"]), SAMPLING)
    nt = out.non_tensor_batch
    assert list(nt["agent_end"]) == [END_ANSWER, END_TURN_LIMIT] and list(nt["agent_turns"]) == [2, 2]
    assert list(nt["agent_turn_rewards"][0]) == [0.25, 1.0] and nt["agent_env_reward"][1] == 0.5
    assert list(nt["agent_env_errors"]) == [0, 0]
    first = f"start 7 seed={row_seed({'ground_truth': '7'})}"
    assert first in tok.decode(out.batch["prompts"][0].tolist())  # reset's observation: context in the prompt
    feedback = ids(tok, ObservationRenderer(tok).text(["more 1"], role="user"), eos=False)
    row = out.batch["responses"][0].tolist()
    assert row[: len(go)] == go and row[len(go): len(go) + len(feedback)] == feedback
    assert out.batch["response_mask"][0, len(go): len(go) + len(feedback)].sum() == 0  # feedback is context
    deadline = time.monotonic() + 5
    while len(agent_tools.CLOSED) < 2 and time.monotonic() < deadline:  # (closed in threads)
        time.sleep(0.01)
    assert sorted(agent_tools.CLOSED) == ["7", "8"]


def test_the_example_environment_and_a_non_text_observation(tok, caplog):
    prompt = ids(tok, "<|im_start|>user\nWhat is 5 + 7?", eos=False)
    engine = ScriptedEngine(tok, {tuple(prompt[:3]): [ids(tok, "It is 11. The answer is 11"),
                                                      ids(tok, "The answer is \\boxed{12}")]})
    out = env_loop(engine, tok, "MathFeedbackEnv", path=GYM_EXAMPLE).run(
        with_rows(prompt_batch(tok, [prompt]), ["12"]), SAMPLING)
    assert list(out.non_tensor_batch["agent_turn_rewards"][0]) == [0.0, 0.5]
    assert out.non_tensor_batch["agent_end"][0] == END_ANSWER
    assert "11 is wrong, try again" in tok.decode(out.batch["responses"][0].tolist())

    with caplog.at_level("WARNING"):
        out = env_loop(engine, tok, "GymBoxEnv").run(prompt_batch(tok, [prompt]), SAMPLING)
    assert out.non_tensor_batch["agent_end"][0] == END_ENV_ERROR and out.non_tensor_batch["agent_env_errors"][0] == 1
    text = " ".join(r.getMessage() for r in caplog.records)
    assert "GymBoxEnv.reset failed" in text and "not text" in text and "ObservationWrapper" in text

    out = env_loop(engine, tok, "GymShapedEnv").run(prompt_batch(tok, [prompt]), SAMPLING)
    assert out.non_tensor_batch["agent_env_reward"][0] == 0.5


def test_environments_start_concurrently(tok):
    """The row "slow" resets only once the row "fast" has taken a step: serial resets (slow first) would wait out
    the deadline; started at once, the fast trajectory runs while the slow one still resets."""
    pa, pb = ids(tok, "Alpha <|im_start|>user\nA", eos=False), ids(tok, "Beta <|im_start|>user\nB", eos=False)
    agent_tools.FAST_STEPPED.clear()
    for scheduling in ("auto", "rounds"):
        agent_tools.FAST_STEPPED.clear()
        engine = SteppedScriptedEngine(tok, {tuple(pa[:3]): [ids(tok, "7")], tuple(pb[:3]): [ids(tok, "8")]})
        loop = env_loop(engine, tok, "GymStartEnv", tool_timeout_s=8.0)
        loop.scheduling = scheduling
        out = loop.run(with_rows(prompt_batch(tok, [pa, pb]), ["slow", "fast"]), SAMPLING)
        assert list(out.non_tensor_batch["agent_env_errors"]) == [0, 0], scheduling
        assert list(out.non_tensor_batch["agent_env_reward"]) == [1.0, 1.0], scheduling


def test_a_slow_tool_does_not_stall_the_engine(tok):
    """Counted in engine steps, not seconds: A's tool returns only after the engine has made 20 more steps, which
    only B's turns can give it. Had the loop waited for A's tool, the engine would stand still and the tool would
    time out (an error observation); it returns, and B finishes its turns while A's tool runs."""
    pa, pb = ids(tok, "Alpha <|im_start|>user\nA", eos=False), ids(tok, "Beta <|im_start|>user\nB", eos=False)
    b_turns = [ids(tok, "<echo>one two three</echo>")] * 4 + [ids(tok, "ok")]
    assert sum(len(t) for t in b_turns) > 20
    engine = SteppedScriptedEngine(tok, {tuple(pa[:3]): [ids(tok, "<wait_for_steps>x</wait_for_steps>"), ids(tok, "ok")],
                                         tuple(pb[:3]): b_turns})
    agent_tools.ENGINE = engine
    loop = AgentLoop(engine, MultiTurnSettings(tools=((TOOLS, "echo"), (TOOLS, "wait_for_steps")), format="tag",
                                               max_turns=6, tool_prompt=False, tool_timeout_s=8.0), tok)
    out = loop.run(prompt_batch(tok, [pa, pb]), SAMPLING)
    nt = out.non_tensor_batch
    assert list(nt["agent_tool_errors"]) == [0, 0] and list(nt["agent_end"]) == [END_ANSWER, END_ANSWER]
    waited = re.search(r"waited (\d+) steps", tok.decode(out.batch["responses"][0].tolist()))
    assert waited and int(waited.group(1)) >= 20
    # (Which of A and B finishes last depends on when the tool's thread sees the 20th step: a race in wall time,
    # not a property of the loop, so it is not asserted; the 20 steps made while A's tool ran are.)


# ------------------------------------------------------------------ the end-to-end run (Gymnasium + MCP)
MCP_SERVER = str(REPO / "examples" / "agents" / "mcp_calculator.py")
GYM_MCP_TINY = [f"rollout.multi_turn.environment={{path: {GYM_EXAMPLE}, name: MathFeedbackEnv}}",
                f"rollout.multi_turn.mcp_servers=[{{command: python, args: [{MCP_SERVER}], tools: [add]}}]",
                f"rollout.multi_turn.format={TOOLS}:mcp_every_other", "rollout.multi_turn.max_turns=3",
                "rollout.multi_turn.max_tokens_per_turn=8", "rollout.multi_turn.max_tool_response_tokens=8",
                "data.max_response_length=48"]


def live_processes_running(path: str) -> list[int]:
    """Pids whose command line names `path` (the MCP servers a run started)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if path in cmdline and "pytest" not in cmdline:
                found.append(int(entry))
    return found


def check_gym_mcp_run(run_dir: Path) -> None:
    """Two trained steps with the Gymnasium env judging turns and the MCP server's `add` answering calls, the
    trainer's log-probs equal to the engine's; afterwards no MCP server process is left."""
    from conftest import read_metrics
    from test_agent_loop import check_multi_turn_run

    steps = check_multi_turn_run(run_dir, continuous=False, environment=True)
    assert sum(m.get("agent/tool_calls/add", 0) for m in steps) > 0, steps  # the MCP tool was called ...
    assert all(m["agent/tool_error_rate"] == 0 for m in steps), steps  # ... and answered
    assert any(k.startswith("val/") for k in read_metrics(run_dir)[-1])


def test_e2e_gymnasium_env_and_mcp_tools_train_two_steps(tmp_path, tiny_model_dir):
    """recipe=grpo_feedback_math with its environment replaced by the Gymnasium example and an MCP server started
    over stdio (examples/agents/mcp_calculator.py) on the tiny model, HF engine: 2 steps."""
    from conftest import run_tiny

    run_dir, _ = run_tiny(tmp_path, tiny_model_dir, "grpo_feedback_math", "rollout.engine=hf", *GYM_MCP_TINY)
    check_gym_mcp_run(run_dir)
    deadline = time.monotonic() + 10
    while live_processes_running(MCP_SERVER) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert live_processes_running(MCP_SERVER) == []
