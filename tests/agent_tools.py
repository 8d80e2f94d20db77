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


# ---------------------------------------------------------------- issue 30: typed tools, Gymnasium, non-blocking
import threading  # noqa: E402

import gymnasium  # noqa: E402
from gymnasium import spaces  # noqa: E402

ENGINE = None  # the test's engine double, for tools that count its steps
CLOSED = []  # the Gymnasium envs closed so far (their options' ground truth)
FAST_STEPPED = threading.Event()  # set by a GymStartEnv step on the row "fast"


def wait_for_steps(text: str) -> str:
    """Wait until the engine has made 20 more steps than when the call started (a tool that is slow in engine steps).

    Args:
        text: ignored
    """
    start = ENGINE.steps
    for _ in range(2000):
        if ENGINE.steps >= start + 20:
            return f"waited {ENGINE.steps - start} steps"
        time.sleep(0.005)
    raise TimeoutError("the engine made no progress while this tool ran")


def mcp_every_other(text, tools):
    """The tiny end-to-end run's parser: a turn of even length calls the MCP tool `add`; other turns call none
    (the environment judges them), so a random-init model exercises both paths."""
    return [ToolCall(name="add", arguments={"a": len(text), "b": 1})] if len(text) % 2 == 0 else []


class GymTextEnv(gymnasium.Env):
    """Text in, text out: reset shows the row's truth and the seed; "stop" terminates (reward 1); a step without it
    gets feedback (reward 0.25); the second step without it truncates."""

    def __init__(self):
        self.observation_space, self.action_space = spaces.Text(max_length=256), spaces.Text(max_length=256)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.truth, self.steps = (options or {}).get("ground_truth"), 0
        return f"start {self.truth} seed={seed}", {}

    def step(self, action):
        self.steps += 1
        if "stop" in action:
            return "bye", 1.0, True, False, {}
        return f"more {self.steps}", 0.25, False, self.steps >= 2, {}

    def close(self):
        CLOSED.append(self.truth)


class GymShapedEnv:
    """The Gymnasium form without importing gymnasium (reset takes seed and options); ends at once."""

    def reset(self, *, seed=None, options=None):
        return "", {}

    def step(self, action):
        return "", 0.5, True, False, {}


class GymBoxEnv(gymnasium.Env):
    """Observations are arrays, not text."""

    def reset(self, *, seed=None, options=None):
        return [0.0, 1.0], {}

    def step(self, action):
        return [0.0], 0.0, True, False, {}


class GymStartEnv(gymnasium.Env):
    """The row "slow" resets only after the row "fast" has taken a step: serial resets (slow first) would wait
    out the deadline instead."""

    def reset(self, *, seed=None, options=None):
        self.row = (options or {}).get("ground_truth")
        if self.row == "slow" and not FAST_STEPPED.wait(10):
            raise TimeoutError("reset ran before the fast trajectory could take a step")
        return "", {}

    def step(self, action):
        if self.row == "fast":
            FAST_STEPPED.set()
        return "", 1.0, True, False, {}
