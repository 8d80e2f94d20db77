"""rlframe/evaluation/stats.py against hand-computed numbers: pass@k, mean@k, maj@k (ties), the bootstrap
interval (its coverage on simulated Bernoulli benchmarks) and the seed spread."""

from __future__ import annotations

import numpy as np
import pytest

from rlframe.evaluation.stats import (Estimate, Spread, bootstrap_interval, maj_at_k_per_prompt, majority_answer,
                                      mean_at_k_per_prompt, pass_at_k, pass_at_k_per_prompt, per_prompt_metrics)


def test_pass_at_k_per_prompt_hand_computed():
    correct = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 0]], dtype=bool)
    # c = 1, 2, 0, 3 of n = 4; k = 2: 1 - C(3,2)/C(4,2) = 1/2, 1 - 1/6 = 5/6, 0, 1 (fewer than k wrong)
    assert pass_at_k_per_prompt(correct, 2) == pytest.approx([0.5, 5 / 6, 0.0, 1.0])
    assert pass_at_k_per_prompt(correct, 1) == pytest.approx([0.25, 0.5, 0.0, 0.75])  # pass@1 = c/n
    with pytest.raises(ValueError, match="k=5 must be in 1..n=4"):
        pass_at_k(4, 1, 5)


def test_mean_at_k_takes_the_first_k_samples():
    accuracy = np.array([[1.0, 0.0, 1.0, 1.0], [np.nan, 1.0, 0.0, 0.0]])
    assert mean_at_k_per_prompt(accuracy, 1) == pytest.approx([1.0, 0.0])  # NaN (not scored) counts as wrong
    assert mean_at_k_per_prompt(accuracy, 2) == pytest.approx([0.5, 0.5])
    assert mean_at_k_per_prompt(accuracy, 4) == pytest.approx([0.75, 0.25])


def test_majority_vote_and_its_ties():
    assert majority_answer(["3", "5", "5", "3", "5"]) == 1  # 5 has three votes; its first sample is 1
    assert majority_answer(["7", "4", "4", "7"]) == 0  # 2-2 tie: the answer seen first (7) wins
    assert majority_answer(["4", "7", "7", "4"]) == 0  # ... whatever the values
    assert majority_answer([None, "", " 9", "8", "9 "]) == 2  # no answer does not vote; answers are stripped
    assert majority_answer([None, None]) is None
    answers = [["7", "4", "4", "7"],   # tie 7/4 -> 7 (first), sample 0 is wrong
               ["4", "7", "7", "7"],   # 7 wins 3-1, sample 1 is right
               [None, None, "2", "3"],  # 1-1 tie among those that answered -> "2" (sample 2): right
               [None, None, None, None]]  # no answer: 0
    correct = np.array([[0, 1, 1, 0], [0, 1, 1, 1], [0, 0, 1, 0], [0, 0, 0, 0]], dtype=bool)
    assert maj_at_k_per_prompt(answers, correct, 4) == pytest.approx([0.0, 1.0, 1.0, 0.0])
    # k = 2: first two samples only. row 0: 7 vs 4 tie -> 7 (wrong); row 1: 4 vs 7 tie -> 4 (wrong); row 2: none
    assert maj_at_k_per_prompt(answers, correct, 2) == pytest.approx([0.0, 0.0, 0.0, 0.0])
    assert maj_at_k_per_prompt(answers, correct, 1) == pytest.approx([0.0, 0.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="k=5 must be in 1..n=4"):
        maj_at_k_per_prompt(answers, correct, 5)


def test_per_prompt_metrics_names_every_k():
    accuracy = np.array([[1.0, 0.0], [0.0, 0.0]])
    metrics = per_prompt_metrics(accuracy, [["1", "2"], ["3", "3"]], [1, 2])
    assert sorted(metrics) == ["accuracy", "maj@1", "maj@2", "mean@1", "mean@2", "pass@1", "pass@2"]
    assert metrics["pass@2"] == pytest.approx([1.0, 0.0]) and metrics["accuracy"] == pytest.approx([0.5, 0.0])
    with pytest.raises(ValueError, match="k=3"):
        per_prompt_metrics(accuracy, [["1", "2"], ["3", "3"]], [3])


def test_bootstrap_interval_is_seeded_and_degenerate_cases():
    values = np.array([0, 1, 1, 0, 1, 0, 0, 1, 1, 1], dtype=float)
    assert bootstrap_interval(values, seed=3) == bootstrap_interval(values, seed=3)
    low, high = bootstrap_interval(values, seed=3)
    assert low < values.mean() < high and 0.0 <= low and high <= 1.0
    assert bootstrap_interval(np.ones(5)) == (1.0, 1.0)  # no spread, no width
    assert bootstrap_interval(np.array([0.25])) == (0.25, 0.25)
    estimate = Estimate.of(values, seed=3)
    assert (estimate.low, estimate.high) == (low, high) and estimate.mean == pytest.approx(0.6)
    assert estimate.fmt(2) == f"0.60 [{low:.2f}, {high:.2f}]"


def test_bootstrap_interval_covers_the_true_rate_about_95_percent():
    """400 simulated benchmarks of 100 prompts, each right with p = 0.3: the 95% interval should hold p in
    about 95% of them (binomial noise of 400 trials: sd 1.1 points; the percentile bootstrap of a mean of
    100 Bernoulli runs a little under nominal)."""
    p, prompts, trials = 0.3, 100, 400
    rng = np.random.default_rng(12345)
    covered = 0
    for trial in range(trials):
        values = (rng.random(prompts) < p).astype(float)
        low, high = bootstrap_interval(values, seed=trial, resamples=1000)
        covered += low <= p <= high
    assert 0.91 <= covered / trials <= 0.98, covered / trials


def test_seed_spread():
    spread = Spread.of([0.25, 0.5, 0.75], seeds=[0, 1, 2])
    assert (spread.mean, spread.low, spread.high, spread.seeds) == (0.5, 0.25, 0.75, (0, 1, 2))
    assert spread.std == pytest.approx(0.25)  # sample sd (ddof=1): sqrt(((.25)^2 * 2) / 2)
    assert Spread.of([0.4], seeds=[7]).std == 0.0
