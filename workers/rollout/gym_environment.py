"""Gymnasium environments in the agent loop: a gymnasium.Env with text observations and actions, unchanged.

    rollout.multi_turn.environment={path: examples/agents/gym_guess_number.py, name: GuessNumberEnv}

The agent loop speaks one form, `reset(row) -> first message | None` and `step(model_text) -> (observation | None,
reward, done)`. A class is taken in the Gymnasium form when it subclasses `gymnasium.Env`, or when its `reset`
takes `seed` and `options` keywords (a Gymnasium-shaped class that does not import gymnasium); GymEnvironment
then maps one onto the other:

    reset(row)  -> env.reset(seed=row_seed(row), options=row) -> (observation, info): the observation is the first
                   (user) message; the row is {ground_truth, data_source, extra_info} of the dataset row
    step(text)  -> env.step(text) -> (observation, reward, terminated, truncated, info): terminated or truncated
                   ends the trajectory (its last observation is not shown), else the observation is the next user
                   message; the reward is the turn's reward (summed into the score, or per turn)
    close()     -> env.close(), when the trajectory ends

The seed is a function of the row alone, so the n samples of a prompt meet the same initial state (a GRPO group
compares like with like) and a resumed run replays it. Observations must be text (a `gymnasium.spaces.Text`, or
any str); for other spaces, Gymnasium's own adapters are the spec: wrap the env in an `ObservationWrapper` whose
`observation(obs)` returns text (and an `ActionWrapper` whose `action(text)` turns the model's text into the
env's action) and name the wrapper class. A non-text observation is an environment error naming that fix.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json


def is_gym_environment(cls: type) -> bool:
    """A gymnasium.Env subclass, or a class whose reset takes the `seed` and `options` keywords."""
    try:
        import gymnasium

        if issubclass(cls, gymnasium.Env):
            return True
    except ImportError:
        pass
    try:
        parameters = inspect.signature(cls.reset).parameters
    except (TypeError, ValueError):
        return False
    return "seed" in parameters and "options" in parameters


def row_seed(row) -> int | None:
    """A seed from the row's content (stable across processes and runs); None without a row."""
    if row is None:
        return None
    text = json.dumps(row, sort_keys=True, default=str)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "little") & 0x7FFFFFFF


def as_text(observation, method: str) -> str:
    if isinstance(observation, str):
        return observation
    raise TypeError(f"{method} returned a {type(observation).__name__} observation, not text. Fix: wrap the env in a "
                    "gymnasium.ObservationWrapper whose observation(obs) returns a str, and name the wrapper class")


class GymEnvironment:
    """The agent loop's environment form over one Gymnasium env instance."""

    def __init__(self, env_class: type):
        self.env = env_class()
        self.truncated = False  # the last step truncated the episode (the loop counts it as a turn limit)

    @classmethod
    def factory(cls, env_class: type):
        """A no-argument constructor, as the loop builds one environment per trajectory."""
        return functools.partial(cls, env_class)

    def reset(self, row) -> str | None:
        result = self.env.reset(seed=row_seed(row), options=row)
        if not (isinstance(result, tuple) and len(result) == 2):
            raise TypeError(f"reset returned {result!r:.200}, not (observation, info)")
        first = as_text(result[0], "reset")
        return first or None

    def step(self, model_text: str):
        result = self.env.step(model_text)
        if not (isinstance(result, tuple) and len(result) == 5):
            raise TypeError(f"step returned {result!r:.200}, not (observation, reward, terminated, truncated, info)")
        observation, reward, terminated, truncated, _ = result
        if terminated or truncated:
            self.truncated = bool(truncated) and not terminated
            return None, float(reward), True
        return as_text(observation, "step"), float(reward), False

    def close(self) -> None:
        self.env.close()
