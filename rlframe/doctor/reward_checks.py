"""Doctor checks of the reward: the dataset's own answers score above corrupted ones, its speed, its signal."""

from __future__ import annotations

import time
from fractions import Fraction

import numpy as np

from rlframe.config import RLConfig
from rlframe.doctor.result import CheckResult, failed, passed, warned

GROUP = "reward"
ROWS = 16  # dataset rows scored with their own answer and a corrupted one
# The answer written the ways reward functions commonly read it; a row's score is its best format's.
ANSWER_FORMATS = ("The answer is \\boxed{{{}}}.", "#### {}", "The answer is {}.")


def corrupt(answer) -> str:
    """A wrong answer of the same kind: a number + 7, any other text reversed and suffixed."""
    text = str(answer).strip()
    try:
        value = Fraction(text.replace(",", ""))
        return str(value + 7)
    except (ValueError, ZeroDivisionError):
        return text[::-1] + " (not this)"


def best_scores(manager, answers: list[str], rows: list[dict]) -> tuple[np.ndarray, dict]:
    """The best score over ANSWER_FORMATS of each row's response built from `answers`."""
    per_format = []
    metrics = {}
    for fmt in ANSWER_FORMATS:
        result = manager.score([fmt.format(a) for a in answers], [r["ground_truth"] for r in rows],
                               [r["data_source"] for r in rows], [r["extra_info"] for r in rows])
        per_format.append(result.scores)
        metrics = {k: metrics.get(k, 0.0) + v for k, v in result.metrics.items() if k.endswith(("failures", "timeouts"))}
    return np.max(np.stack(per_format), axis=0), metrics


def check_reward_on_answers(cfg: RLConfig, dataset) -> list[CheckResult]:
    """The reward functions (reward.functions, in their process pool) on ROWS rows: each row's own ground truth
    written as an answer must score above a corrupted one; the seconds per sample; a constant score fails."""
    from rlframe.trainer.scorer import reward_manager

    if dataset is None:
        return [failed(GROUP, "own_answers", "no training data to score (see data/train_rows)", "fix the data first")]
    rows = [dataset[i] for i in range(min(ROWS, len(dataset)))]
    manager = reward_manager(cfg)
    try:
        start = time.perf_counter()
        own, own_metrics = best_scores(manager, [str(r["ground_truth"]) for r in rows], rows)
        wrong, wrong_metrics = best_scores(manager, [corrupt(r["ground_truth"]) for r in rows], rows)
        seconds = (time.perf_counter() - start) / (2 * len(rows) * len(ANSWER_FORMATS))
    finally:
        manager.close()
    failures = own_metrics.get("reward/failures", 0.0) + wrong_metrics.get("reward/failures", 0.0)
    measured = (f"{len(rows)} rows: own answers score {own.mean():.3f} (min {own.min():.3f}), corrupted ones "
                f"{wrong.mean():.3f} (max {wrong.max():.3f}); {int((own > wrong).sum())}/{len(rows)} rows tell them apart")
    if failures:
        measured += f"; {int(failures)} calls failed (scored reward.fallback_score)"
    speed = (passed if seconds < 1.0 else warned)(
        GROUP, "seconds_per_sample", f"{seconds * 1000:.1f} ms per sample (reward.num_workers={cfg.reward.num_workers})",
        *(() if seconds < 1.0 else ("a slow reward holds every step: raise reward.num_workers or make it faster",)))
    scores = np.concatenate([own, wrong])
    if scores.max() == scores.min():
        return [failed(GROUP, "own_answers", measured + f": every response scores {scores[0]:.3f}",
                       "the reward returns a constant: check that it reads the response and the ground truth "
                       "(reward.functions, data.answer_key) and that it does not fail on every call"), speed]
    if (own > wrong).mean() < 0.5:
        return [failed(GROUP, "own_answers", measured, "the reward does not score the dataset's answers as correct: "
                       "check the ground-truth column (data.answer_key) and the answer format the reward expects"), speed]
    if (own > wrong).mean() < 1.0 or failures:
        return [warned(GROUP, "own_answers", measured, "some rows' answers are not recognised: look at those rows' "
                       "ground truth and the reward's extraction"), speed]
    return [passed(GROUP, "own_answers", measured), speed]


def check_group_signal(batch, max_share: float = 0.9) -> CheckResult:
    """Real samples (the doctor's training step): their score distribution, and the share of prompts whose
    samples all scored alike (zero group-relative advantage: no GRPO signal)."""
    from rlframe.trainer.gates import group_scores, zero_variance_share

    scores, uids = group_scores(batch)
    share = zero_variance_share(scores, uids)
    values, counts = np.unique(np.round(scores, 3), return_counts=True)
    shown = ", ".join(f"{v:g} x{c}" for v, c in list(zip(values, counts))[:6])
    measured = (f"{len(scores)} samples of {len(set(uids.tolist()))} prompts: scores {shown}; "
                f"{share:.0%} of the groups score alike")
    if share > max_share:
        return warned(GROUP, "group_signal", measured, "most groups carry no signal: easier data for this policy, "
                      "a higher rollout.n or rollout.temperature, or a reward with partial credit")
    return passed(GROUP, "group_signal", measured)
