"""A Gymnasium environment with text observations and actions: answer an arithmetic problem, retry when wrong.

    rollout.multi_turn.environment={path: examples/agents/gym_math_feedback.py, name: MathFeedbackEnv}

An ordinary `gymnasium.Env`, used unchanged by the agent loop (workers/rollout/gym_environment.py): the loop
calls `reset(seed=..., options=row)` with the dataset row ({ground_truth, data_source, extra_info}) and
`step(model_text)` after every model turn without a tool call. A right answer terminates the episode with reward
0.5 ** (attempt - 1); a wrong or missing one gets feedback (the next user message) and reward 0; after
MAX_ATTEMPTS the episode is truncated.
"""

import re

import gymnasium
from gymnasium import spaces

MAX_ATTEMPTS = 3
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_ANSWER_IS = re.compile(r"answer is[:\s]*\$?(-?[\d,]*\.?\d+)", re.IGNORECASE)


def extract_answer(text: str):
    found = _BOXED.findall(text) or _ANSWER_IS.findall(text)
    return found[-1].strip() if found else None


def as_number(value):
    try:
        return float(str(value).replace(",", "").strip())
    except ValueError:
        return None


class MathFeedbackEnv(gymnasium.Env):
    """Observations and actions are text (spaces.Text); the task's answer comes in through `options`."""

    def __init__(self):
        self.observation_space = spaces.Text(max_length=512)
        self.action_space = spaces.Text(max_length=4096)
        self.truth, self.attempts = None, 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.truth, self.attempts = (options or {}).get("ground_truth"), 0
        return "", {}  # the question is already in the prompt: no first message

    def step(self, action: str):
        self.attempts += 1
        answer = extract_answer(action)
        if answer is not None and as_number(answer) is not None and as_number(answer) == as_number(self.truth):
            return "right", 0.5 ** (self.attempts - 1), True, False, {"attempts": self.attempts}
        truncated = self.attempts >= MAX_ATTEMPTS
        feedback = ("No answer found." if answer is None else f"{answer} is wrong, try again.")
        return feedback + " End your reply with: The answer is \\boxed{your number}.", 0.0, False, truncated, {}
