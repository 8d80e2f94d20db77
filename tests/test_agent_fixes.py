"""Agent-loop configuration and counting: an environment alone gets no tool, `format: tag` refuses a tool of
several required arguments before start, a call on the last allowed turn is counted as dropped, and names the
model invents for tools count under one metric key (scripted engine double: the loop itself is real)."""

from __future__ import annotations

import json
import textwrap

import pytest

from helpers_tokenizer import build_tokenizer
from rlframe.trainer.agent_metrics import agent_metrics
from rlframe.workers.rollout.agent_loop import END_TURN_LIMIT, AgentLoop, left_padded
from rlframe.workers.rollout.tools import ToolLoadError
from rlframe.workers.settings import MultiTurnSettings, SamplingSettings
from test_agent_loop import TOOLS, ScriptedEngine, ids

SAMPLING = SamplingSettings(max_new_tokens=1024, temperature=1.0)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def test_an_environment_alone_gets_no_tool():
    from rlframe.config import ConfigError, validate_config
    from rlframe.main import compose_config
    from rlframe.trainer.worker_settings import multi_turn_settings

    cfg = compose_config(["recipe=grpo_math", "rollout.multi_turn.enable=true",
                          "rollout.multi_turn.environment={path: tools/feedback_math.py, name: FeedbackMath}"])
    assert cfg.rollout.multi_turn.tools == [] and multi_turn_settings(cfg).tools == ()
    cfg = compose_config(["recipe=grpo_math", "rollout.multi_turn.enable=true"])  # nothing to call, nothing to judge
    with pytest.raises(ConfigError, match="rollout.multi_turn.tools: no tool and no environment"):
        validate_config(cfg)


def test_tag_format_refuses_a_tool_of_several_required_arguments(tmp_path, tok):
    from rlframe.config import ConfigError, RLConfig, ToolConfig, validate_config

    two = tmp_path / "two_args.py"
    two.write_text(textwrap.dedent("""
        TOOL_SCHEMAS = {"lookup": {"type": "function", "function": {"name": "lookup", "description": "d",
            "parameters": {"type": "object", "properties": {"table": {"type": "string"}, "key": {"type": "string"}},
                           "required": ["table", "key"]}}}}

        def lookup(table, key):
            return table + key
        """))
    cfg = RLConfig()
    mt = cfg.rollout.multi_turn
    mt.enable, mt.format, mt.tools = True, "tag", [ToolConfig(path=TOOLS, name="echo"), ToolConfig(path=str(two), name="lookup")]
    with pytest.raises(ConfigError) as error:
        validate_config(cfg)
    text = str(error.value)
    assert "rollout.multi_turn.tools[1]" in text and "requires 2 arguments (table, key)" in text
    assert "rollout.multi_turn.format=hermes" in text and "tools[0]" not in text
    mt.format = "hermes"  # JSON arguments: fine
    validate_config(cfg)
    with pytest.raises(ToolLoadError, match="requires 2 arguments"):  # and the loop itself refuses it
        AgentLoop(ScriptedEngine(tok, {}), MultiTurnSettings(tools=((str(two), "lookup"),), format="tag"), tok)


def test_last_turn_calls_are_dropped_and_counted_and_invented_names_share_one_key(tok):
    call = lambda name: "<tool_call>" + json.dumps({"name": name, "arguments": {"text": "x"}}) + "</tool_call>"  # noqa: E731
    pa = ids(tok, "Alpha <|im_start|>user\nA", eos=False)
    pb = ids(tok, "Beta <|im_start|>user\nB", eos=False)
    pc = ids(tok, "Gamma <|im_start|>user\nC", eos=False)
    engine = ScriptedEngine(tok, {
        tuple(pa[:3]): [ids(tok, call("echo")), ids(tok, call("echo") + call("echo"))],  # turn 2 = the last allowed
        tuple(pb[:3]): [ids(tok, call("web_search_v2") + call("")), ids(tok, "7")],
        tuple(pc[:3]): [ids(tok, call("sudo_rm")), ids(tok, "7")],
    })
    loop = AgentLoop(engine, MultiTurnSettings(tools=((TOOLS, "echo"),), format="hermes", tool_prompt=False,
                                               max_turns=2), tok)
    out = loop.run(left_padded([pa, pb, pc], tok.pad_token_id), SAMPLING)
    nt = out.non_tensor_batch
    assert nt["agent_end"][0] == END_TURN_LIMIT
    assert nt["agent_calls_by_tool"][0] == {"echo": 1, "(dropped)": 2}  # the last turn's two calls: not run, counted
    assert nt["agent_tool_calls"][0] == 1
    assert nt["agent_calls_by_tool"][1] == {"(unknown)": 1, "(malformed)": 1}
    assert nt["agent_calls_by_tool"][2] == {"(unknown)": 1}
    metrics = agent_metrics(nt, out.batch["response_mask"], out.batch["attention_mask"])
    keys = sorted(k for k in metrics if k.startswith("agent/tool_calls/"))
    assert keys == ["agent/tool_calls/(dropped)", "agent/tool_calls/(malformed)", "agent/tool_calls/(unknown)",
                    "agent/tool_calls/echo"]
    assert metrics["agent/tool_calls/(dropped)"] == pytest.approx(2 / 3)  # per trajectory
    assert metrics["agent/tool_calls/(unknown)"] == pytest.approx(2 / 3)
