"""Rewards off the critical path (reward.overlap): scoring overlaps the log-prob passes, same numbers.

Two real 2-step runs on the tiny model (Ray workers, HF engine, the reward process pool) with a
deliberately slow reward function (tests/reward_fns/slow_length.py: 0.25 s per sample, some samples
fail): overlap on and off. From the recorded phase intervals (<run_dir>/timeline.jsonl):
- off: scoring ends before the old-log-prob pass starts, and the driver waits the whole scoring;
- on: scoring runs while the log-prob passes run; what the step saves (scoring time - time blocked
  on the join) is the overlapped time;
and the scores, failures, advantages and losses are identical.
"""

from __future__ import annotations

import os

import pytest

from conftest import read_metrics, run_tiny

from rlframe.report import read_timeline

SLOW_REWARD = os.path.join(os.path.dirname(__file__), "reward_fns", "slow_length.py")
COMMON = [f"reward.functions=[{{path: {SLOW_REWARD}}}]", "rollout.engine=hf", "actor.skip_old_log_prob_when_on_policy=false",
          "trainer.val_before_train=false", "trainer.val_at_end=false", "trainer.export_hf=false", "reward.num_workers=2"]
SAME = ("critic/score/mean", "reward/score_mean", "reward/failures", "reward/timeouts", "critic/accuracy",
        "critic/advantages/mean", "actor/pg_loss", "actor/grad_norm", "actor/kl_loss")
LOG_PROB_PHASES = ("old_log_prob", "ref_log_prob")


def _overlap(a: tuple[float, float], b: tuple[float, float]) -> float:
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))


@pytest.mark.slow
def test_reward_overlap_saves_the_overlapped_time_and_changes_no_number(tmp_path, tiny_model_dir):
    (tmp_path / "off").mkdir()
    (tmp_path / "on").mkdir()
    off_dir, _ = run_tiny(tmp_path / "off", tiny_model_dir, "grpo_math", *COMMON, "reward.overlap=false")
    on_dir, _ = run_tiny(tmp_path / "on", tiny_model_dir, "grpo_math", *COMMON, "reward.overlap=true")
    off, on = read_metrics(off_dir), read_metrics(on_dir)
    assert [m["step"] for m in off] == [m["step"] for m in on] == [1, 2]
    for a, b in zip(off, on):
        for key in SAME:
            assert a[key] == b[key], (a["step"], key, a[key], b[key])
    assert sum(m["reward/failures"] for m in off) > 0  # the failure accounting was exercised

    for step, phases in read_timeline(off_dir).items():
        metrics = off[step - 1]
        reward = phases["reward"]
        assert reward[1] <= min(phases[p][0] for p in LOG_PROB_PHASES)  # scored before the log-probs
        assert metrics["timing/reward_wait_s"] == pytest.approx(reward[1] - reward[0], abs=1e-4)
        assert all(_overlap(reward, phases[p]) == 0 for p in LOG_PROB_PHASES)

    for step, phases in read_timeline(on_dir).items():
        metrics = on[step - 1]
        reward = phases["reward"]
        scoring = reward[1] - reward[0]
        log_probs = sum(phases[p][1] - phases[p][0] for p in LOG_PROB_PHASES)
        overlapped = sum(_overlap(reward, phases[p]) for p in LOG_PROB_PHASES)
        saved = scoring - metrics["timing/reward_wait_s"]
        print(f"step {step}: scoring {scoring:.2f}s, log-prob passes {log_probs:.2f}s, overlapped {overlapped:.2f}s, "
              f"waited {metrics['timing/reward_wait_s']:.2f}s, saved {saved:.2f}s", flush=True)
        assert scoring > 0.5  # 8 samples x 0.25 s on 2 reward workers
        assert overlapped >= 0.8 * min(scoring, log_probs)  # the scoring ran while the passes ran ...
        assert saved == pytest.approx(overlapped, abs=0.15)  # ... and the step saved that time
