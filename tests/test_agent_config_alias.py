"""`rollout.agent` (the issue's spelling) is read as `rollout.multi_turn`, on the command line and in recipes."""

from pathlib import Path

import pytest

from rlframe.main import UsageError, agent_alias_overrides, compose_config

REPO = Path(__file__).resolve().parents[1]


def test_command_line_agent_keys_become_multi_turn_and_turn_the_loop_on():
    cfg = compose_config(["recipe=grpo_math", "rollout.agent.tools=[{path: tools/calculator.py, name: calculator}]",
                          "rollout.agent.format=tag", "rollout.agent.max_turns=2"])
    mt = cfg.rollout.multi_turn
    assert mt.enable and mt.format == "tag" and mt.max_turns == 2
    assert [(t.path, t.name) for t in mt.tools] == [("tools/calculator.py", "calculator")]
    assert cfg.rollout.agent is None


def test_explicit_enable_wins_and_other_overrides_pass_through():
    out, notices = agent_alias_overrides(["actor.optim.lr=1e-6", "rollout.agent.enable=false",
                                          "rollout.agent.tools=[]"])
    assert out == ["actor.optim.lr=1e-6", "rollout.multi_turn.enable=false", "rollout.multi_turn.tools=[]"]
    assert len(notices) == 2


def test_recipe_agent_section(tmp_path):
    text = (REPO / "recipes" / "grpo_tool_math.yaml").read_text()
    recipe = tmp_path / "agent_recipe.yaml"
    recipe.write_text(text.replace("  multi_turn:\n    enable: true\n", "  agent:\n"))
    assert "multi_turn" not in recipe.read_text()
    mt = compose_config([f"recipe={recipe}"]).rollout.multi_turn
    assert mt.enable and mt.format == "tag" and mt.max_tool_response_tokens == 32
    assert [t.name for t in mt.tools] == ["calculator"]


def test_unknown_agent_key_is_named():
    with pytest.raises(UsageError, match="multi_turn"):
        compose_config(["recipe=grpo_math", "rollout.agent.max_turn=2"])
