"""Hand-checked cases for reward_fns/code.py, format.py and countdown.py (loaded by path, as a
run loads them), and each of them through the RewardManager."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from rlframe.reward.loader import load_reward_function
from rlframe.reward.manager import RewardManager, RewardSpec

REPO = Path(__file__).resolve().parents[1]
CODE_PATH = str(REPO / "reward_fns" / "code.py")
FORMAT_PATH = str(REPO / "reward_fns" / "format.py")
COUNTDOWN_PATH = str(REPO / "reward_fns" / "countdown.py")
MATH_PATH = str(REPO / "reward_fns" / "math.py")
CODE = load_reward_function(CODE_PATH)
FORMAT = load_reward_function(FORMAT_PATH)
COUNTDOWN = load_reward_function(COUNTDOWN_PATH)
MATH = load_reward_function(MATH_PATH)
code_module = sys.modules[CODE.load().__module__]
format_module = sys.modules[FORMAT.load().__module__]
countdown_module = sys.modules[COUNTDOWN.load().__module__]

ADD_TESTS = json.dumps({"inputs": ["1 2\n", "10 -3\n", "0 0\n"], "outputs": ["3\n", "7\n", "0\n"]})


def fenced(body: str, tag: str = "python") -> str:
    return f"Here is my solution:\n```{tag}\n{body}\n```\nDone."


# ------------------------------------------------------------------------------------- code.py


def test_code_all_pass():
    out = CODE("code", fenced("a, b = map(int, input().split())\nprint(a + b)"), ADD_TESTS)
    assert out == {"score": 1.0, "format": 1.0, "pass_rate": 1.0, "passed": 3.0, "total": 3.0,
                   "verdict": "passed", "sandbox_isolated": 1.0}


def test_code_partial_credit_and_all_or_nothing(monkeypatch):
    # right only when the sum is non-negative and not 7: passes "1 2" and "0 0"
    program = fenced("a, b = map(int, input().split())\nprint(a + b if a + b != 7 else 8)")
    out = CODE("code", program, ADD_TESTS)
    assert out["score"] == pytest.approx(2 / 3) and out["passed"] == 2 and out["verdict"] == "failed"
    monkeypatch.setattr(code_module, "ALL_OR_NOTHING", True)
    assert CODE("code", program, ADD_TESTS)["score"] == 0.0


def test_code_takes_the_last_python_block():
    response = ("First try:\n```python\nprint('wrong')\n```\nA shell aside:\n```bash\necho 3\n```\n"
                "Fixed:\n```py\na, b = map(int, input().split())\nprint(a + b)\n```")
    assert CODE("code", response, ADD_TESTS)["score"] == 1.0
    assert code_module.extract_program("```\nprint(1)\n```") == "print(1)\n"
    assert code_module.extract_program("print(1)") is None


def test_code_no_block_crash_and_hang():
    assert CODE("code", "a + b", ADD_TESTS) == {"score": 0.0, "format": 0.0, "pass_rate": 0.0,
                                                "passed": 0.0, "total": 3.0, "verdict": "no_code",
                                                "sandbox_isolated": 1.0}
    assert CODE("code", fenced("raise ValueError"), ADD_TESTS)["verdict"] == "failed"


def test_code_hostile_program_scores_zero(monkeypatch):
    monkeypatch.setattr(code_module, "TIME_LIMIT_S", 1.0)
    monkeypatch.setattr(code_module, "_SANDBOX", None)  # rebuilt with the shorter limit
    out = CODE("code", fenced("while True: pass"), json.dumps({"inputs": ["1"], "outputs": ["1"]}))
    assert out["score"] == 0.0 and out["verdict"] == "timeout"
    monkeypatch.setattr(code_module, "_SANDBOX", None)


def test_code_accepts_a_dict_ground_truth_and_rejects_a_malformed_one():
    tests = {"inputs": ["x\n"], "outputs": ["x\n"]}
    assert CODE("code", fenced("print(input())"), tests)["score"] == 1.0
    with pytest.raises(ValueError):
        CODE("code", fenced("print(1)"), {"inputs": ["1"], "outputs": []})


# ------------------------------------------------------------------------------------ format.py


@pytest.mark.parametrize("response, expected", [
    ("<think>7 + 5 = 12</think><answer>12</answer>", 1.0),
    ("  <think>\nlong\nthought\n</think>\n\n<answer>12</answer>\n", 1.0),
    ("<answer>12</answer><think>late</think>", 0.5),                     # all tags, wrong order
    ("<think>a</think><answer>12</answer> and more", 0.5),                 # text after the answer
    ("<think>a</think><think>b</think><answer>12</answer>", 0.25),         # think twice
    ("<think></think><answer>12</answer>", 0.5),                           # empty think
    ("<answer>12</answer>", 0.25),
    ("12", 0.0),
])
def test_format_score(response, expected):
    assert format_module.format_score(response) == expected


def test_format_think_opened_in_prompt(monkeypatch):
    monkeypatch.setattr(format_module, "THINK_OPENED_IN_PROMPT", True)
    assert format_module.format_score("reasoning</think><answer>1</answer>") == 1.0


@pytest.mark.parametrize("length, expected", [(0, 0.0), (768, 0.0), (832, -0.25), (896, -0.5),
                                              (1024, -1.0), (5000, -1.0)])
def test_length_penalty(length, expected):
    assert format_module.length_penalty(length, 1024, 256) == pytest.approx(expected)


def test_format_batch_form():
    assert FORMAT.kind == "batch"
    out = FORMAT([
        {"response": "<think>a</think><answer>1</answer>", "response_length": 10, "ground_truth": None},
        {"response": "<think>a</think><answer>1</answer>", "response_length": 960, "ground_truth": None},
        {"response": "no tags", "response_length": 90, "ground_truth": None,
         "extra_info": {"max_response_length": 100}},
        {"response": "no tags at all", "response_length": None, "ground_truth": None},
    ])
    assert [o["overall"] for o in out] == pytest.approx([1.0, 0.25, -0.9, 0.0])
    assert [o["length_penalty"] for o in out] == pytest.approx([0.0, -0.75, -0.9, 0.0])


# --------------------------------------------------------------------------------- countdown.py

GAME = {"target": 24, "numbers": [1, 2, 3, 4]}


@pytest.mark.parametrize("response, score, reason", [
    ("<answer>(1 + 2 + 3) * 4</answer>", 1.0, "correct"),
    ("<answer>4 * 3 * 2 * 1 = 24</answer>", 1.0, "correct"),                 # trailing "= target"
    ("first <answer>1+2</answer> then <answer>1*2*3*4</answer>", 1.0, "correct"),  # the last one
    ("\\boxed{(4 + 2) * (3 + 1)}", 1.0, "correct"),
    ("<answer>4 * 3 * 2</answer>", 0.1, "numbers used [2, 3, 4] do not fit [1, 2, 3, 4]"),
    ("<answer>4 * 3 * 2 * 1 * 1</answer>", 0.1, "numbers used [1, 1, 2, 3, 4] do not fit [1, 2, 3, 4]"),
    ("<answer>(1 + 2) * 3 + 4</answer>", 0.1, "reaches 13, not 24"),
    ("<answer>24</answer>", 0.1, "numbers used [24] do not fit [1, 2, 3, 4]"),
    ("<answer>4 ** 2 + 3 + 2 + 1</answer>", 0.1, "invalid: Pow is not allowed"),
    ("<answer>__import__('os').system('ls')</answer>", 0.1, "invalid: Call is not allowed"),
    ("<answer>-1 + 2 + 3 * 4</answer>", 0.1, "invalid: UnaryOp is not allowed"),
    ("<answer>4 / (1 - 1) + 2 * 3</answer>", 0.1, "invalid: division by zero"),
    ("The answer is 24", 0.0, "no answer"),
])
def test_countdown(response, score, reason):
    out = COUNTDOWN("countdown", response, GAME)
    assert out["score"] == score
    assert out["reason"].startswith(reason)


def test_countdown_fractions_repeats_and_rules(monkeypatch):
    # 8 / (3 - 8 / 3) = 24 needs a fractional intermediate step
    game = json.dumps({"target": 24, "numbers": [8, 3, 8, 3]})
    assert COUNTDOWN("c", "<answer>8 / (3 - 8 / 3)</answer>", game)["score"] == 1.0
    monkeypatch.setattr(countdown_module, "INTEGER_STEPS", True)
    assert "not a positive integer" in COUNTDOWN("c", "<answer>8 / (3 - 8 / 3)</answer>", game)["reason"]
    # the TV game's rule: each number at most once, not all of them
    monkeypatch.setattr(countdown_module, "USE_ALL_NUMBERS", False)
    assert COUNTDOWN("c", "<answer>4 * 3 * 2</answer>", GAME)["score"] == 1.0
    assert COUNTDOWN("c", "<answer>4 * 3 * 2 * 1 * 1</answer>", GAME)["score"] == 0.1
    # numbers as numpy arrays (as parquet files give them)
    assert COUNTDOWN("c", "<answer>4*3*2*1</answer>",
                     {"target": np.int64(24), "numbers": np.array([1, 2, 3, 4])})["score"] == 1.0


# ------------------------------------------------------------------ math.py: non-equivalent pairs


@pytest.mark.parametrize("response, truth", [
    ("\\boxed{0.51}", "0.5"), ("\\boxed{\\frac{1}{3}}", "0.33"), ("\\boxed{1,001}", "1000"),
    ("\\boxed{12 apples}", "13"), ("\\boxed{-3}", "3"), ("\\boxed{2\\sqrt{2}}", "\\sqrt{2}"),
])
def test_math_non_equivalent_pairs(response, truth):
    assert MATH("math", response, truth)["acc"] == 0.0


# ------------------------------------------------------------------------- through the manager


def test_library_through_the_reward_manager():
    specs = [RewardSpec(CODE_PATH, data_sources=["code"]),
             RewardSpec(COUNTDOWN_PATH, data_sources=["countdown"]),
             RewardSpec(FORMAT_PATH, weight=0.5)]
    responses = ["<think>add</think><answer>ok</answer>\n" + fenced("print(sum(map(int, input().split())))"),
                 "<think>t</think><answer>(1 + 2 + 3) * 4</answer>"]
    with RewardManager(specs, num_workers=2, timeout_s=30) as manager:
        result = manager.score(responses, [ADD_TESTS, json.dumps(GAME)], ["code", "countdown"],
                               response_lengths=[40, 12])
    assert result.failures == []
    np.testing.assert_allclose(result.extras["code/score"], [1.0, np.nan])
    np.testing.assert_allclose(result.extras["countdown/score"], [np.nan, 1.0])
    # row 0: the answer block is followed by the code, so format = 0.5 -> 0.25; row 1: format 1 -> 0.5
    np.testing.assert_allclose(result.scores, [1.25, 1.5])
