"""Hand-checked cases for reward_fns/math.py (loaded by path, as a run loads it)."""

import sys
from pathlib import Path

import pytest

from rlframe.reward.loader import load_reward_function

REPO = Path(__file__).resolve().parents[1]
MATH = load_reward_function(REPO / "reward_fns" / "math.py")
math_module = sys.modules[MATH.load().__module__]  # the helpers, for the unit cases below


@pytest.mark.parametrize("response, truth, score, acc, fmt, pred", [
    ("7 + 5 = 12, so \\boxed{12}", "12", 1.0, 1.0, 1.0, "12"),
    ("\\boxed{11} no wait \\boxed{12}", "12", 1.0, 1.0, 1.0, "12"),       # the last box wins
    ("\\boxed{13}", "12", 0.0, 0.0, 1.0, "13"),                            # format alone earns nothing
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0, 1.0, 1.0, "\\frac{1}{2}"),      # balanced braces
    ("\\boxed{3/4}", "\\frac{3}{4}", 1.0, 1.0, 1.0, "3/4"),
    ("\\boxed{12.0}", "12", 1.0, 1.0, 1.0, "12.0"),
    ("\\boxed{\\$1,000}", "1000", 1.0, 1.0, 1.0, "\\$1,000"),
    ("\\boxed{12 apples}", "12", 1.0, 1.0, 1.0, "12 apples"),             # units stripped
    ("\\boxed{\\text{12 apples}}", "12", 1.0, 1.0, 1.0, "\\text{12 apples}"),
    ("\\boxed{x = -3}", "-3", 1.0, 1.0, 1.0, "x = -3"),
    ("\\boxed{50\\%}", "50", 1.0, 1.0, 1.0, "50\\%"),
    ("\\boxed{7+5}", "12", 0.0, 0.0, 1.0, "7+5"),                          # must do the arithmetic
    ("\\boxed{x^2+2x+1}", "(x+1)^2", 1.0, 1.0, 1.0, "x^2+2x+1"),          # sympy
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\sqrt{3}/2", 1.0, 1.0, 1.0, "\\frac{\\sqrt{3}}{2}"),
    ("\\boxed{x+1}", "x+2", 0.0, 0.0, 1.0, "x+1"),
    ("\\boxed{eval(chr(49))}", "1", 0.0, 0.0, 1.0, "eval(chr(49))"),       # never evaluated
    ("She has 72 clips.\n#### 72", "72", 0.9, 1.0, 0.0, "72"),             # GSM8K style
    ("#### 1,000", "1000", 0.9, 1.0, 0.0, "1,000"),
    ("The answer is $12.50.", "12.5", 0.9, 1.0, 0.0, "$12.50"),
    ("The final answer is: 42", "42", 0.9, 1.0, 0.0, "42"),
    ("answer: 12 apples", "12", 0.9, 1.0, 0.0, "12 apples"),
    ("I think it is 12", "12", 0.0, 0.0, 0.0, None),                       # no last-number fallback
    ("so \\boxed{12", "12", 0.0, 0.0, 0.0, None),                          # cut off: unbalanced
    ("", "12", 0.0, 0.0, 0.0, None),
])
def test_compute_score(response, truth, score, acc, fmt, pred):
    out = MATH("arithmetic", response, truth, None)
    assert out == {"score": score, "acc": acc, "format": fmt, "pred": pred}


def test_module_constants_and_kind():
    assert MATH.kind == "sample"
    assert math_module.FORMAT_SCORE == 0.1


@pytest.mark.parametrize("text, expected", [
    ("\\boxed{a{b}c}", "a{b}c"),
    ("\\boxed 7 apples", "7"),
    ("\\fbox{9}", "9"),
    ("no box", None),
])
def test_last_boxed(text, expected):
    assert math_module.last_boxed(text) == expected
