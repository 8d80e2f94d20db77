"""The statistics of an evaluation: pass@k, mean@k, maj@k per prompt, bootstrap intervals over prompts, seed spread.

Every metric is first computed per prompt (an array of P values), then averaged over the prompts; its 95%
interval is a percentile bootstrap over the prompts (the unit that was sampled from the benchmark). The
samples of one prompt stay together: resampling responses would treat correlated samples as independent
and give intervals that are too narrow.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

CONFIDENCE = 0.95
BOOTSTRAP_RESAMPLES = 1000


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt from n samples with c correct (Chen et al. 2021):

        pass@k = 1 - C(n - c, k) / C(n, k)

    the probability that at least one of k samples drawn without replacement from the n is correct."""
    if not 1 <= k <= n:
        raise ValueError(f"k={k} must be in 1..n={n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_at_k_per_prompt(correct: np.ndarray, k: int) -> np.ndarray:
    """[P] pass@k of each prompt; `correct` [P, n] of booleans (sample j of prompt i correct)."""
    n = correct.shape[1]
    return np.array([pass_at_k(n, int(c), k) for c in correct.sum(axis=1)], dtype=float)


def mean_at_k_per_prompt(accuracy: np.ndarray, k: int) -> np.ndarray:
    """[P] mean@k of each prompt: the mean accuracy of its first k samples, mean_j<k acc[i, j] (NaN counts as 0)."""
    if not 1 <= k <= accuracy.shape[1]:
        raise ValueError(f"k={k} must be in 1..n={accuracy.shape[1]}")
    return np.nan_to_num(accuracy[:, :k].astype(float)).mean(axis=1)


def majority_answer(answers: Sequence[str | None]) -> int | None:
    """The index of the sample whose answer wins the vote, or None when no sample has an answer.

    Votes: each sample with an answer (not None, not empty after strip()) votes for it; answers compare after
    strip(). The most frequent answer wins; a tie goes to the tied answer that appeared FIRST (the lowest
    sample index), so the vote is deterministic and does not depend on the order of a dict or a sort. The
    index returned is that answer's first sample (whose correctness the prompt gets)."""
    counts: dict[str, int] = {}
    first: dict[str, int] = {}
    for j, answer in enumerate(answers):
        if answer is None or not str(answer).strip():
            continue
        key = str(answer).strip()
        counts[key] = counts.get(key, 0) + 1
        first.setdefault(key, j)
    if not counts:
        return None
    best = max(counts.values())
    return min(first[key] for key, count in counts.items() if count == best)


def maj_at_k_per_prompt(answers: Sequence[Sequence[str | None]], correct: np.ndarray, k: int) -> np.ndarray:
    """[P] maj@k (self-consistency) of each prompt: 1 when the majority answer of its first k samples is
    correct (`majority_answer`: ties to the first-seen answer; no answer in k samples: 0), else 0.

    `answers` `[P][n]` the extracted answers, `correct` [P, n] booleans."""
    if not 1 <= k <= correct.shape[1]:
        raise ValueError(f"k={k} must be in 1..n={correct.shape[1]}")
    out = np.zeros(len(answers), dtype=float)
    for i, row in enumerate(answers):
        winner = majority_answer(list(row)[:k])
        out[i] = float(winner is not None and bool(correct[i, winner]))
    return out


def bootstrap_interval(values: np.ndarray, seed: int = 0, resamples: int = BOOTSTRAP_RESAMPLES,
                       confidence: float = CONFIDENCE) -> tuple[float, float]:
    """Percentile bootstrap interval of mean(values) over the P prompts:

        draw P prompts with replacement, `resamples` times (numpy's default_rng(seed)); the interval is the
        (1 - confidence)/2 and (1 + confidence)/2 quantiles of the resampled means.

    Percentile rather than BCa: the metrics are means of bounded per-prompt values, where the two agree to
    within the Monte-Carlo noise at our sizes, and the percentile form is one line a reader can check.
    One prompt (or all values equal) gives a zero-width interval at the value."""
    values = np.asarray(values, dtype=float)
    if values.size == 0:
        return (math.nan, math.nan)
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, values.size, size=(resamples, values.size))
    means = values[picks].mean(axis=1)
    alpha = (1.0 - confidence) / 2
    return float(np.quantile(means, alpha)), float(np.quantile(means, 1.0 - alpha))


@dataclass(frozen=True)
class Estimate:
    """A metric over prompts: its mean and the bootstrap interval (`bootstrap_interval`)."""

    mean: float
    low: float
    high: float

    @classmethod
    def of(cls, per_prompt: np.ndarray, seed: int = 0, resamples: int = BOOTSTRAP_RESAMPLES) -> Estimate:
        low, high = bootstrap_interval(per_prompt, seed, resamples)
        return cls(float(np.mean(per_prompt)), low, high)

    def fmt(self, digits: int = 4) -> str:
        return f"{self.mean:.{digits}f} [{self.low:.{digits}f}, {self.high:.{digits}f}]"


@dataclass(frozen=True)
class Spread:
    """One metric over R sampling seeds: the mean, the sample standard deviation (ddof=1; 0 for one seed)
    and the range min..max: the noise band a difference between two models must clear."""

    mean: float
    std: float
    low: float
    high: float
    seeds: tuple[int, ...]

    @classmethod
    def of(cls, values: Sequence[float], seeds: Sequence[int]) -> Spread:
        values = np.asarray(values, dtype=float)
        std = float(values.std(ddof=1)) if values.size > 1 else 0.0
        return cls(float(values.mean()), std, float(values.min()), float(values.max()), tuple(int(s) for s in seeds))


def per_prompt_metrics(accuracy: np.ndarray, answers: Sequence[Sequence[str | None]], ks: Sequence[int]
                       ) -> dict[str, np.ndarray]:
    """{metric: [P] per-prompt values}: `accuracy` (mean over all n samples = mean@n), and for each k
    pass@k, mean@k and maj@k. `accuracy` [P, n] (NaN: no function scored the sample; counts as wrong),
    `answers` `[P][n]` the extracted answers. A sample is correct when its accuracy >= 0.5."""
    accuracy = np.nan_to_num(np.asarray(accuracy, dtype=float))
    correct = accuracy >= 0.5
    n = accuracy.shape[1]
    out = {"accuracy": accuracy.mean(axis=1)}
    for k in ks:
        if not 1 <= k <= n:
            raise ValueError(f"k={k} must be in 1..n={n}")
        out[f"pass@{k}"] = pass_at_k_per_prompt(correct, k)
        out[f"mean@{k}"] = mean_at_k_per_prompt(accuracy, k)
        out[f"maj@{k}"] = maj_at_k_per_prompt(answers, correct, k)
    return out
