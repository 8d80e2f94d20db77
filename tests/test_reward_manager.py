"""RewardManager: both calling conventions, weights, routing, and every way user code can fail."""

import pickle
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from rlframe.reward.loader import RewardLoadError, load_reward_function
from rlframe.reward.manager import RewardError, RewardManager, RewardSpec, validate_reward_specs

REPO = Path(__file__).resolve().parents[1]
MATH = str(REPO / "reward_fns" / "math.py")


def write(tmp_path: Path, name: str, body: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


@pytest.fixture
def bad_fns(tmp_path):
    """A reward file whose behaviour depends on the response text."""
    return write(tmp_path, "bad.py", """
        import time

        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            if solution_str == "raise":
                raise RuntimeError("boom")
            if solution_str == "hang":
                time.sleep(1000)
            if solution_str == "nan":
                return float("nan")
            if solution_str == "none":
                return None
            if solution_str == "str":
                return "1.0"
            if solution_str == "nokey":
                return {"acc": 1.0}
            return {"score": 1.0, "acc": 1.0}
        """)


def test_per_sample_math_in_workers():
    with RewardManager([RewardSpec(MATH)], num_workers=2) as manager:
        result = manager.score(["\\boxed{12}", "\\boxed{3}", "no idea"], ["12", "4", "5"],
                               ["arithmetic"] * 3)
    assert result.scores.dtype == np.float64
    np.testing.assert_allclose(result.scores, [1.0, 0.0, 0.0])
    np.testing.assert_allclose(result.extras["acc"], [1, 0, 0])
    np.testing.assert_allclose(result.extras["format"], [1, 1, 0])
    assert list(result.extras["pred"]) == ["12", "3", None]
    assert result.metrics["reward/failures"] == 0
    assert result.metrics["reward/acc_mean"] == pytest.approx(1 / 3)
    assert result.failures == []


def test_batch_form_weights_and_routing(tmp_path):
    batch = write(tmp_path, "lengthy.py", """
        REWARD_TYPE = "batch"

        def compute_score(reward_inputs):
            return [{"overall": len(x["response"]) / 10, "len": x["response_length"],
                     "source_seen": x["data_source"]} for x in reward_inputs]
        """)
    specs = [RewardSpec(MATH, weight=2.0, data_sources=["arithmetic", "gsm8k"]),
             RewardSpec(batch, weight=0.5, data_sources=["gsm8k", "prose"])]
    with RewardManager(specs, num_workers=2) as manager:
        result = manager.score(["\\boxed{1}", "\\boxed{2}", "abcde"], ["1", "3", "x"],
                               ["arithmetic", "gsm8k", "prose"], response_lengths=[3, 4, 5])
    # row 0: math only = 2*1; row 1: 2*0 (wrong) + 0.5*0.9; row 2: 0.5*0.5
    np.testing.assert_allclose(result.scores, [2.0, 0.45, 0.25])
    np.testing.assert_allclose(result.extras["math/score"], [1.0, 0.0, np.nan])
    np.testing.assert_allclose(result.extras["lengthy/len"], [np.nan, 4, 5])
    assert list(result.extras["lengthy/source_seen"]) == [None, "gsm8k", "prose"]
    assert result.metrics["reward/math/acc_mean"] == pytest.approx(0.5)


def test_uncovered_data_source_is_an_error():
    with RewardManager([RewardSpec(MATH, data_sources=["arithmetic"])], num_workers=0) as manager:
        with pytest.raises(RewardError, match="openai/gsm8k"):
            manager.score(["x", "y"], ["1", "2"], ["arithmetic", "openai/gsm8k"])


def test_failures_get_fallback_and_are_counted(bad_fns, caplog):
    responses = ["ok", "raise", "nan", "none", "str", "nokey", "ok"]
    with RewardManager([RewardSpec(bad_fns)], num_workers=2, fallback_score=-1.0) as manager:
        result = manager.score(responses, ["1"] * 7, ["d"] * 7)
    np.testing.assert_allclose(result.scores, [1, -1, -1, -1, -1, -1, 1])
    assert result.metrics["reward/failures"] == 5
    assert result.metrics["reward/timeouts"] == 0
    assert "RuntimeError: boom" in result.failures[0] and "Traceback" in result.failures[0]
    assert "nan" in result.failures[1] and "None" in result.failures[2]
    assert "'score'" in result.failures[4]
    # the first failure is logged once in full, with its input
    logged = [r.getMessage() for r in caplog.records if "failed on row" in r.getMessage()]
    assert len(logged) == 1 and "'raise'" in logged[0]


def test_failures_in_process_too(bad_fns):
    with RewardManager([RewardSpec(bad_fns)], num_workers=0) as manager:
        result = manager.score(["ok", "raise", "str"], ["1"] * 3, ["d"] * 3)
    np.testing.assert_allclose(result.scores, [1, 0, 0])
    assert result.metrics["reward/failures"] == 2


def test_hanging_function_is_killed_and_replaced(bad_fns):
    with RewardManager([RewardSpec(bad_fns)], num_workers=2, timeout_s=1.0) as manager:
        manager.score(["ok"], ["1"], ["d"])  # wait for the workers to be up
        start = time.monotonic()
        result = manager.score(["hang", "ok", "hang", "ok", "ok"], ["1"] * 5, ["d"] * 5)
        elapsed = time.monotonic() - start
        np.testing.assert_allclose(result.scores, [0, 1, 0, 1, 1])
        assert result.metrics["reward/timeouts"] == 2
        assert "timed out after 1s" in result.failures[0]
        assert elapsed < 6, elapsed
        # the replaced workers still score
        again = manager.score(["ok", "ok"], ["1"] * 2, ["d"] * 2)
        np.testing.assert_allclose(again.scores, [1, 1])


def test_batch_deadline(bad_fns):
    with RewardManager([RewardSpec(bad_fns)], num_workers=1, timeout_s=100,
                       batch_timeout_s=1.5) as manager:
        manager.score(["ok"], ["1"], ["d"])
        start = time.monotonic()
        result = manager.score(["hang", "ok"], ["1"] * 2, ["d"] * 2)
        assert time.monotonic() - start < 6
    np.testing.assert_allclose(result.scores, [0, 0])
    assert result.metrics["reward/timeouts"] == 2


def test_fail_fast_raises_with_the_input(bad_fns):
    with RewardManager([RewardSpec(bad_fns)], num_workers=1, fail_fast=True) as manager:
        with pytest.raises(RewardError, match="(?s)'raise'.*RuntimeError: boom"):
            manager.score(["ok", "raise", "ok"], ["1"] * 3, ["d"] * 3)
        # the pool still works afterwards
        np.testing.assert_allclose(manager.score(["ok"], ["1"], ["d"]).scores, [1])
    with RewardManager([RewardSpec(bad_fns)], num_workers=1, fail_fast=True,
                       timeout_s=1) as manager:
        start = time.monotonic()
        with pytest.raises(RewardError, match="timed out"):
            manager.score(["hang"] + ["ok"] * 20, ["1"] * 21, ["d"] * 21)
        assert time.monotonic() - start < 10


def test_batch_form_bad_outputs(tmp_path):
    short = write(tmp_path, "short.py", """
        REWARD_TYPE = "batch"
        def compute_score(reward_inputs):
            return [{"overall": 1.0}]
        """)
    mixed = write(tmp_path, "mixed.py", """
        REWARD_TYPE = "batch"
        def compute_score(reward_inputs):
            return [{"overall": 1.0}, {"overall": float("inf")}, 0.5]
        """)
    with RewardManager([RewardSpec(short)], num_workers=0) as manager:
        result = manager.score(["a", "b"], ["1", "1"], ["d", "d"])
    np.testing.assert_allclose(result.scores, [0, 0])
    assert "returned 1 results for 2 inputs" in result.failures[0]
    with RewardManager([RewardSpec(mixed)], num_workers=1) as manager:
        result = manager.score(["a", "b", "c"], ["1"] * 3, ["d"] * 3)
    np.testing.assert_allclose(result.scores, [1, 0, 0.5])
    assert result.metrics["reward/failures"] == 1


def test_worker_that_dies_is_replaced(tmp_path):
    dies = write(tmp_path, "dies.py", """
        import os
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            if solution_str == "die":
                os._exit(3)
            return 1.0
        """)
    with RewardManager([RewardSpec(dies)], num_workers=1) as manager:
        result = manager.score(["ok", "die", "ok"], ["1"] * 3, ["d"] * 3)
    np.testing.assert_allclose(result.scores, [1, 0, 1])
    assert "died (exit code 3)" in result.failures[0]


# ---------------------------------------------------------------- loading errors


def test_bad_files_are_reported_clearly(tmp_path):
    with pytest.raises(RewardLoadError, match=r"(?s)not found.*nope.py.*reward.functions\[i\].path"):
        load_reward_function(tmp_path / "nope.py")
    broken = write(tmp_path, "broken.py", "import not_a_module_xyz\n")
    with pytest.raises(RewardLoadError, match="(?s)broken.py failed.*Traceback.*not_a_module_xyz"):
        load_reward_function(broken)
    other = write(tmp_path, "other.py", """
        def score_it(a, b, c): return 1.0
        def helper(): pass
        compute_score = 3
        """)
    with pytest.raises(RewardLoadError, match="defines no function 'missing'.*helper, score_it"):
        load_reward_function(other, "missing")
    with pytest.raises(RewardLoadError, match="is a int, not a function"):
        load_reward_function(other)
    with pytest.raises(RewardLoadError, match="not found"):
        validate_reward_specs([RewardSpec(MATH), RewardSpec(str(tmp_path / "nope.py"))])
    with pytest.raises(ValueError, match="data_sources"):
        validate_reward_specs([RewardSpec(MATH, data_sources="arithmetic")])


def test_sibling_imports_and_pickling(tmp_path):
    (tmp_path / "my_helpers.py").write_text("def double(x):\n    return 2 * x\n")
    path = write(tmp_path, "uses_helper.py", """
        from my_helpers import double
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            return double(0.25)
        """)
    fn = load_reward_function(path)
    assert fn("d", "r", "g") == 0.5
    clone = pickle.loads(pickle.dumps(fn))
    assert clone._fn is None and clone.kind == "sample" and clone("d", "r", "g") == 0.5
    with RewardManager([RewardSpec(path)], num_workers=1) as manager:  # fresh process
        np.testing.assert_allclose(manager.score(["r"], ["g"], ["d"]).scores, [0.5])


def test_batch_kind_detected(tmp_path):
    path = write(tmp_path, "b.py", "REWARD_TYPE = 'batch'\ndef compute_score(xs): return []\n")
    assert load_reward_function(path).kind == "batch"
    bad = write(tmp_path, "c.py", "REWARD_TYPE = 'batched'\ndef compute_score(xs): return []\n")
    with pytest.raises(RewardLoadError, match="REWARD_TYPE"):
        load_reward_function(bad)
