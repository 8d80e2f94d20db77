"""A feedback environment for arithmetic answers: "wrong, try again" until the answer is right.

    rollout.multi_turn.environment={path: tools/feedback_math.py, name: FeedbackMath}

After each model turn, `step` reads the turn's answer (the last ``\\boxed{...}``, else "The answer is X");
a correct one ends the trajectory with reward RETRY_DISCOUNT ** (attempt - 1): 1.0 on the first attempt,
0.5 on the second, 0.25 on the third; a wrong or missing one gets a user message saying so (reward 0.0)
and the model tries again, up to rollout.multi_turn.max_turns turns in all.

Why the discount: the whole trajectory shares one outcome reward, so without it a wrong first attempt
followed by a right retry is reinforced exactly as much as a right first attempt, and GRPO has no
reason to prefer answering right at once (the reward function on the last answer still gives 1.0 to
any trajectory that ends right).
"""

import re

RETRY_DISCOUNT = 0.5
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_ANSWER_IS = re.compile(r"answer is[:\s]*\$?(-?[\d,]*\.?\d+)", re.IGNORECASE)


def extract_answer(text: str):
    boxed = _BOXED.findall(text)
    if boxed:
        return boxed[-1].strip()
    found = _ANSWER_IS.findall(text)
    return found[-1] if found else None


def _number(value):
    try:
        return float(str(value).replace(",", "").replace("$", "").strip())
    except ValueError:
        return None


class FeedbackMath:
    """State: the ground truth of the row and the attempts so far."""

    def reset(self, row) -> None:
        self.truth = None if row is None else row.get("ground_truth")
        self.attempts = 0

    def step(self, model_text: str):
        self.attempts += 1
        answer = extract_answer(model_text)
        if answer is None:
            return "No answer found. End your reply with: The answer is \\boxed{your number}.", 0.0, False
        truth = _number(self.truth)
        if truth is not None and _number(answer) == truth:
            return None, RETRY_DISCOUNT ** (self.attempts - 1), True
        return f"{answer} is wrong, try again. End your reply with: The answer is \\boxed{{your number}}.", 0.0, False
