"""Strict GSM8K reward (the per-sample verl form): the answer must follow ``####``.

Point a run at it with ``reward.functions=[{path: reward_fns/gsm8k.py}]``. The last ``#### <number>`` in the
response is the answer (commas and a leading ``$`` are ignored: ``#### $1,000`` reads as 1000);
it is compared numerically with the ground truth.

Score: 1.0 if correct; FORMAT_SCORE (0.0 by default, as in verl) if a ``#### number`` was found
but is wrong; 0.0 if there is none. Returns ``{"score", "acc", "format", "pred"}``.
"""

import re

FORMAT_SCORE = 0.0
CORRECT_SCORE = 1.0

_ANSWER = re.compile(r"####\s*\$?\s*(-?[0-9][0-9,]*(?:\.[0-9]+)?|-?\.[0-9]+)")


def extract_solution(solution_str):
    """The number after the last ``####``, commas removed; None if there is none."""
    matches = _ANSWER.findall(solution_str or "")
    if not matches:
        return None
    return matches[-1].replace(",", "")


def _same_number(a, b):
    try:
        return abs(float(a) - float(str(b).replace(",", ""))) < 1e-6
    except ValueError:
        return False


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    pred = extract_solution(solution_str)
    correct = pred is not None and _same_number(pred, ground_truth)
    if correct:
        score = CORRECT_SCORE
    elif pred is not None:
        score = FORMAT_SCORE
    else:
        score = 0.0
    return {"score": score, "acc": float(correct), "format": float(pred is not None), "pred": pred}
