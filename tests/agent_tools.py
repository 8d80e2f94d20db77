"""Tools and a tool-call parser for the agent-loop tests (written the way a user writes a tool file)."""

import time

from rlframe.workers.rollout.tools import ToolCall


def _schema(name, param):
    return {"type": "function", "function": {"name": name, "description": name, "parameters": {
        "type": "object", "properties": {param: {"type": "string"}}, "required": [param]}}}


TOOL_SCHEMAS = {"echo": _schema("echo", "text"), "boom": _schema("boom", "text"), "hang": _schema("hang", "text"),
                "slow": _schema("slow", "text"), "bad_schema": {"type": "function", "function": {
                    "name": "bad_schema", "parameters": {"type": "object", "properties": {"x": {"type": 12}}}}}}


def echo(text: str) -> str:
    return f"echo:{text}"


def boom(text: str) -> str:
    raise RuntimeError("the tool broke")


def hang(text: str) -> str:
    time.sleep(30)
    return "never"


def slow(text: str) -> str:
    time.sleep(1.5)
    return "slow done"


def bad_schema(x: str) -> str:
    return x


def broken_parser(text, tools):
    raise KeyError("a parser bug")


def every_turn(text, tools):
    """Every model turn calls `echo` (so a random-init model produces multi-turn trajectories)."""
    return [ToolCall(name="echo", arguments={"text": "x"})]


class CountdownEnv:
    """Feedback "again" until the third turn; reward 0.25 per turn, done at the third."""

    def reset(self, row):
        self.turns, self.truth = 0, (row or {}).get("ground_truth")

    def step(self, model_text):
        self.turns += 1
        return (None, 0.25, True) if self.turns >= 3 else (f"again {self.truth}", 0.25, False)


class BrokenResetEnv:
    def reset(self, row):
        raise ValueError("reset failed")

    def step(self, model_text):
        return None, 0.0, True


class NotAnEnv:
    def reset(self, row):
        pass


class GameEnv:
    """reset returns the first message (the game's state); every turn ends the game with reward 1."""

    def reset(self, row):
        return f"Board for {(row or {}).get('ground_truth')}: X.O"

    def step(self, model_text):
        return None, 1.0, True


class SlowWhenToldEnv:
    """Feedback "again" until the third turn; a row whose ground truth is "slow" takes 1 s per step."""

    def reset(self, row):
        self.turns, self.slow = 0, (row or {}).get("ground_truth") == "slow"

    def step(self, model_text):
        self.turns += 1
        if self.slow:
            time.sleep(1.0)
        return (None, 1.0, True) if self.turns >= 3 else ("again", 0.0, False)
