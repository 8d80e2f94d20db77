"""The gateway (workers/rollout/gateway.py) and the agent-program episodes (workers/rollout/agent_program.py)."""

from rlframe.workers.rollout.tools import ToolCall


def calculator_every_turn(text, tools):
    """A test tool-call parser: every model turn calls the calculator (so a random-init model makes tool calls)."""
    return [ToolCall(name="calculator", arguments={"expression": "2 + 3"})] if "calculator" in tools else []
