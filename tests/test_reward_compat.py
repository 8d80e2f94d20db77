"""verl / EasyR1 reward scripts through the real RewardManager (worker processes), the math checker's
math-verify cases, integer answers scored exactly as before, and a reward worker that cannot start."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rlframe.reward.loader import BATCH, SAMPLE, SEQUENTIAL, load_reward_function
from rlframe.reward.manager import RewardManager, RewardSpec

REPO = Path(__file__).resolve().parents[1]

# A verl script: parameters in another order than verl's positional call, a reward_kwargs value.
VERL_SCRIPT = '''
def compute_score(solution_str, ground_truth, data_source, extra_info=None, bonus=0.0):
    assert data_source == "my_task", data_source
    return {"score": float(solution_str.strip() == str(ground_truth)) + bonus, "acc": 1.0}
'''

# An EasyR1 batch script without REWARD_TYPE (EasyR1's default is batch).
EASYR1_BATCH = '''
REWARD_NAME = "exact"

def compute_score(reward_inputs, format_weight=0.1):
    if not isinstance(reward_inputs, list):
        raise ValueError("Please use `reward_type=batch` for exact reward function.")
    out = []
    for item in reward_inputs:
        right = float(item["response"].strip() == item["ground_truth"])
        out.append({"overall": (1 - format_weight) * right + format_weight * (item["response_length"] > 0),
                    "accuracy": right})
    return out
'''

EASYR1_SEQUENTIAL = '''
REWARD_TYPE = "sequential"

def compute_score(reward_input):
    return {"overall": float(reward_input["response"] == reward_input["ground_truth"])}
'''

ASYNC_SCRIPT = '''
import asyncio

async def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    await asyncio.sleep(0)
    return float(solution_str == ground_truth)
'''


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


RESPONSES = ["12", "7", "12"]
TRUTHS = ["12", "12", "12"]


def test_verl_keyword_call_with_reward_kwargs(tmp_path):
    path = write(tmp_path, "verl_reward.py", VERL_SCRIPT)
    assert load_reward_function(path).kind == SAMPLE
    with RewardManager([RewardSpec(str(path), kwargs={"bonus": 0.5})], num_workers=1, fail_fast=True) as manager:
        result = manager.score(RESPONSES, TRUTHS, ["my_task"] * 3, [{}] * 3)
    assert result.scores.tolist() == [1.5, 0.5, 1.5]


def test_easyr1_batch_without_reward_type_by_path_name(tmp_path):
    path = write(tmp_path, "easyr1_reward.py", EASYR1_BATCH)
    fn = load_reward_function(f"{path}:compute_score")
    assert fn.kind == BATCH and fn.name == "compute_score"
    with RewardManager([RewardSpec(f"{path}:compute_score", kwargs={"format_weight": 0.2})], num_workers=1,
                       fail_fast=True) as manager:
        result = manager.score(RESPONSES, TRUTHS, ["math"] * 3, [{}] * 3, response_lengths=[3, 3, 0])
    assert result.scores.tolist() == pytest.approx([1.0, 0.2, 0.8])
    assert result.extras["accuracy"].tolist() == [1.0, 0.0, 1.0]


def test_easyr1_sequential_and_async(tmp_path):
    seq = write(tmp_path, "seq_reward.py", EASYR1_SEQUENTIAL)
    asy = write(tmp_path, "async_reward.py", ASYNC_SCRIPT)
    assert load_reward_function(seq).kind == SEQUENTIAL
    for path in (seq, asy):
        with RewardManager([RewardSpec(str(path))], num_workers=1, fail_fast=True) as manager:
            result = manager.score(RESPONSES, TRUTHS, ["math"] * 3, [{}] * 3)
        assert result.scores.tolist() == [1.0, 0.0, 1.0], path
    # reward_type from the config overrides the signature
    assert load_reward_function(asy, reward_type="sample").kind == SAMPLE


MATH = load_reward_function(REPO / "reward_fns" / "math.py")


@pytest.mark.parametrize("pred, truth", [
    ("(1, 2)", "(1,2)"), ("[0, \\infty)", "[0,\\infty)"), ("(1, 2]", "(1,2]"),
    ("\\frac12", "1/2"), ("1/2", "\\frac12"), ("50\\%", "0.5"), ("0.5", "50\\%"),
    ("\\frac{\\sqrt2}{2}", "\\sqrt{2}/2"),
])
def test_math_checker_equivalences(pred, truth):
    out = MATH("math", f"so \\boxed{{{pred}}}", truth, None)
    assert out["acc"] == 1.0, (pred, truth, out)


@pytest.mark.parametrize("pred, truth", [("(1, 2)", "(2,1)"), ("(1, 2)", "[1,2]"), ("\\frac13", "1/2"),
                                         ("5\\%", "0.5")])
def test_math_checker_still_rejects(pred, truth):
    assert MATH("math", f"\\boxed{{{pred}}}", truth, None)["acc"] == 0.0


def test_integer_answers_scored_exactly_as_before(tmp_path):
    """The main job's arithmetic answers: the new checker agrees with the previous commit's on every case."""
    old = load_reward_function(REPO / "tests" / "reward_fns" / "math_before_math_verify.py")  # reward_fns/math.py at 795c58f
    preds = ["12", "-3", "12.0", "7+5", "\\frac{24}{2}", "\\frac242", "1200\\%", "12 apples", "x = 12", "0012",
             "1,2", "(12)", "12/1", "twelve", "\\$12", "12.5", "1e1", "100\\%", "", "1", "0", "-0", "+12"]
    truths = ["12", "-3", "1", "0", "10", 12, -3, 1]
    forms = ["The answer is \\boxed{{{}}}.", "#### {}", "The answer is {}", "{}"]
    cases = 0
    for truth in truths:
        for pred in preds:
            for form in forms:
                response = form.format(pred)
                assert MATH("arithmetic", response, truth, None) == old("arithmetic", response, truth, None), \
                    (response, truth)
                cases += 1
    # and on the generated arithmetic dataset's own ground truths with sampled-looking replies
    from rlframe.data.arithmetic import generate_arithmetic_dataset
    from rlframe.data.dataset import read_rows

    train, _ = generate_arithmetic_dataset(tmp_path / "data", n_train=200, n_val=8, seed=0, max_operand=10)
    for row in read_rows(train):
        truth = row["reward_model"]["ground_truth"]
        for reply in (f"\\boxed{{{truth}}}", f"\\boxed{{{int(truth) + 1}}}", f"The answer is {truth}%.",
                      f"\\boxed{{{truth}.0}}", "\\boxed{\\frac{1}{2}}"):
            assert MATH("arithmetic", reply, truth, None) == old("arithmetic", reply, truth, None)
            cases += 1
    assert cases > 1000


NO_GUARD_DRIVER = '''
from rlframe.reward.manager import RewardManager, RewardSpec
manager = RewardManager([RewardSpec({path!r})], num_workers=1)   # no if __name__ == "__main__" guard
print(manager.score(["The answer is 12"], ["12"], ["math"], [{{}}]).scores.tolist())
'''


def test_driver_from_stdin_scores(tmp_path):
    """A driver piped through stdin used to kill every reward worker at start (spawn re-ran '<stdin>')."""
    script = NO_GUARD_DRIVER.format(path=str(REPO / "reward_fns" / "math.py"))
    done = subprocess.run([sys.executable, "-"], input=script, capture_output=True, text=True, cwd=tmp_path,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "[0.9]" in done.stdout


def test_worker_that_cannot_start_says_why(tmp_path):
    """A script without the main guard: the spawned worker re-runs it and dies; the error carries its stderr."""
    driver = write(tmp_path, "driver.py", NO_GUARD_DRIVER.format(path=str(REPO / "reward_fns" / "math.py")))
    done = subprocess.run([sys.executable, str(driver)], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert done.returncode != 0
    assert "a reward worker process exited while starting" in done.stderr
    assert "Its stderr:" in done.stderr and "bootstrapping phase" in done.stderr
    assert 'if __name__ == "__main__":' in done.stderr and "reward.num_workers=0" in done.stderr


def test_a_pool_started_long_before_its_first_batch_scores(monkeypatch):
    """The driver is busy for minutes between starting the pool and the first batch (workers start,
    validation generates): a worker whose "ready" waits unread in the pipe is not a startup failure."""
    import time

    import rlframe.reward.manager as manager_module

    monkeypatch.setattr(manager_module, "WORKER_STARTUP_TIMEOUT_S", 1.0)
    with RewardManager([RewardSpec(str(REPO / "reward_fns" / "math.py"))], num_workers=1) as manager:
        time.sleep(12)  # the worker is ready long before this, its message unread
        assert manager.score(["\\boxed{12}"], ["12"], ["math"], [{}]).scores.tolist() == [1.0]
