"""The gates of an RL run (rlframe/trainer/gates.py) against hand-computed cases, and the sync checksums they read
(workers/weight_broadcast.py): each rule fires exactly past its threshold and names step, metric, value and cause."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from rlframe.config import RLConfig, ConfigError, validate_config
from rlframe.config.gates import GatesConfig
from rlframe.protocol import DataProto
from rlframe.trainer.gates import (Gates, GateStopped, constant_reward_gate, entropy_collapse_gate, logprob_gap_gate,
                                   logprob_gap_threshold, non_finite_loss_gate, run_dtype, step_signals,
                                   topk_overlap_gate, weight_sync_gate, zero_variance_gate, zero_variance_share)
from rlframe.workers.weight_broadcast import (CHECKSUM_SAMPLES, checksum_close, compare_checksums, tensor_checksum)


def test_tensor_checksum_samples_a_stride_and_sums_in_float64():
    t = torch.arange(10, dtype=torch.float32)  # 10 elements < CHECKSUM_SAMPLES: stride 1, all of them
    assert tensor_checksum(t) == (45.0, 285.0)
    big = torch.ones(CHECKSUM_SAMPLES * 3 + 1)  # stride 3: elements 0, 3, ..., 3 * 4096 -> 4097 of them
    assert tensor_checksum(big) == (4097.0, 4097.0)
    assert tensor_checksum(t.view(2, 5)) == tensor_checksum(t.to(torch.float64))  # shape and dtype do not matter


def test_checksum_close_tells_an_optimizer_step_from_rounding():
    torch.manual_seed(0)
    w = torch.randn(576, 576) * 0.02
    base = tensor_checksum(w)
    assert checksum_close(base, tensor_checksum(w.clone()))
    assert not checksum_close(base, tensor_checksum(w + 1e-6 * torch.randn_like(w)))  # a step 10x below lr 1e-5
    assert checksum_close((1.0, 2.0), (1.0 + 1e-12, 2.0))


def test_compare_checksums_reports_equal_unequal_and_what_moved():
    a, b, c = (1.0, 1.0), (2.0, 4.0), (3.0, 9.0)
    healthy = compare_checksums({"x": b, "y": b}, {"x": b, "y": b, "z": c}, {"x": a, "y": b}, {"x": a, "y": b})
    assert healthy == {"streamed": 2, "checked": 2, "missing": 0, "unequal": 0, "first_unequal": "",
                       "engine_changed": 1, "trainer_changed": 1}
    skipped = compare_checksums({"x": b}, {"x": a}, {"x": a}, {"x": a})
    assert skipped == {"streamed": 1, "checked": 1, "missing": 0, "unequal": 1, "first_unequal": "x",
                       "engine_changed": 0, "trainer_changed": 1}
    never_loaded = compare_checksums({"x": b, "y": b}, {"y": b})  # the engine's loader never took x
    assert (never_loaded["missing"], never_loaded["unequal"], never_loaded["first_unequal"]) == (1, 1, "x")
    first = compare_checksums({"x": b}, {"x": b})
    assert (first["engine_changed"], first["trainer_changed"]) == (-1, -1)  # nothing to compare with yet


def test_logprob_gap_gate_fires_above_the_threshold_of_the_dtype():
    cfg = GatesConfig()
    assert logprob_gap_threshold(cfg, "float32") == 1e-3 and logprob_gap_threshold(cfg, "bfloat16") == 0.05
    assert logprob_gap_threshold(cfg, "float8") == 0.05  # unknown: the largest given
    assert run_dtype("auto", on_gpu=False) == "float32" and run_dtype("auto", on_gpu=True) == "bfloat16"
    assert logprob_gap_gate(3, 1e-3, 1e-3) is None and logprob_gap_gate(3, None, 1e-3) is None
    event = logprob_gap_gate(3, 2e-3, 1e-3)
    assert (event.step, event.metric, event.value, event.threshold) == (3, "rollout/logprob_abs_diff", 2e-3, 1e-3)
    assert "step 3" in event.message() and "0.002" in event.message() and "weight sync" in event.message()


def test_weight_sync_gate():
    assert weight_sync_gate(1, None) is None
    assert weight_sync_gate(1, {"checked": 3, "unequal": 0, "first_unequal": "", "engine_changed": 1,
                                "trainer_changed": 1}) is None
    assert weight_sync_gate(1, {"checked": 3, "unequal": 0, "first_unequal": "", "engine_changed": 0,
                                "trainer_changed": 0}) is None  # a zero-gradient step: nothing moved, nothing to load
    unequal = weight_sync_gate(2, {"checked": 3, "unequal": 2, "first_unequal": "w", "engine_changed": 0,
                                   "trainer_changed": 1})
    assert unequal.value == 2.0 and "2 of 3 tensors" in unequal.cause and "(first: w)" in unequal.cause
    unknown = weight_sync_gate(2, compare_checksums({f"w{i}": (1.0, 1.0) for i in range(5)}, {}))
    assert unknown.value == 5.0 and "5 of 5 tensors" in unknown.cause and "5 not held by the engine" in unknown.cause
    stale = weight_sync_gate(2, {"checked": 3, "unequal": 0, "first_unequal": "", "engine_changed": 0,
                                 "trainer_changed": 1})
    assert stale.metric == "weight_sync/engine_changed" and "old policy" in stale.cause


def test_zero_variance_share_and_gate():
    scores = np.array([1.0, 1.0, 0.0, 1.0, 0.5, 0.5])
    uids = np.array(["a", "a", "b", "b", "c", "c"])
    assert zero_variance_share(scores, uids) == pytest.approx(2 / 3)  # a and c score alike, b does not
    assert zero_variance_gate(5, [1.0, 1.0, 1.0, 1.0], 0.95, 5) is None  # fewer steps than the window
    assert zero_variance_gate(5, [1.0, 1.0, 1.0, 0.75, 1.0], 0.95, 5) is None  # mean 0.95: not above
    event = zero_variance_gate(6, [0.0, 1.0, 1.0, 1.0, 1.0, 1.0], 0.95, 5)
    assert event.value == 1.0 and event.threshold == 0.95


def test_constant_reward_gate_needs_n_constant_steps_in_a_row():
    assert constant_reward_gate(4, [0.0, 0.0, 0.0, 0.0], 5) is None
    assert constant_reward_gate(5, [0.0, 0.0, 0.1, 0.0, 0.0], 5) is None
    assert constant_reward_gate(6, [0.3, 0.0, 0.0, 0.0, 0.0, 0.0], 5).step == 6


def test_entropy_collapse_gate_is_relative_to_the_first_step():
    assert entropy_collapse_gate(3, [0.05, 0.05, 0.05], None, 0.1, 3) is None
    assert entropy_collapse_gate(4, [1.0, 0.09, 0.1, 0.09], 1.0, 0.1, 3) is None  # 0.1 is not below 0.1 x 1.0
    event = entropy_collapse_gate(5, [1.0, 0.09, 0.05, 0.01], 1.0, 0.1, 3)
    assert (event.value, event.threshold) == (0.01, pytest.approx(0.1))


def test_non_finite_loss_gate():
    assert non_finite_loss_gate(1, {"actor/skipped_updates": 0.0, "actor/pg_loss": 0.3}) is None
    assert non_finite_loss_gate(1, {"actor/skipped_updates": 1.0}).metric == "actor/skipped_updates"
    assert non_finite_loss_gate(1, {"actor/pg_loss": math.nan}).metric == "actor/pg_loss"


def rollout_batch(scores: list[float], uids: list[str], log_prob: float) -> DataProto:
    n = len(scores)
    token_scores = torch.zeros(n, 3)
    token_scores[:, 1] = torch.tensor(scores)
    mask = torch.tensor([[1, 1, 0]] * n)
    batch = DataProto.from_dict(tensors={"token_level_scores": token_scores, "response_mask": mask,
                                         "rollout_log_probs": torch.full((n, 3), log_prob)})
    batch.non_tensor_batch["uid"] = np.array(uids, dtype=object)
    return batch


def test_step_signals_by_hand():
    signals = step_signals(rollout_batch([1.0, 1.0, 0.0, 1.0], ["a", "a", "b", "b"], log_prob=-0.25))
    assert signals == {"reward/zero_variance_groups": 0.5, "reward/score_std": pytest.approx(np.std([1, 1, 0, 1])),
                       "rollout/sampled_nll": pytest.approx(0.25)}


def test_gates_warn_in_the_log_metrics_and_gates_jsonl_and_stop_with_the_message(tmp_path, caplog):
    cfg = GatesConfig(constant_reward_steps=2)
    gates = Gates(cfg, "float32", tmp_path)
    steady = {"reward/zero_variance_groups": 1.0, "reward/score_std": 0.0, "rollout/sampled_nll": 0.4,
              "rollout/logprob_abs_diff": 5e-6, "actor/skipped_updates": 0.0}
    assert gates.check(1, steady) == {f"gates/{n}": 0.0 for n in ("logprob_gap", "weight_sync", "zero_variance",
                                                                   "constant_reward", "entropy_collapse",
                                                                   "non_finite_loss")}
    fired = gates.check(2, {**steady, "rollout/logprob_abs_diff": 0.5})
    assert fired["gates/constant_reward"] == 1.0 and fired["gates/logprob_gap"] == 1.0
    rows = [json.loads(line) for line in (tmp_path / "gates.jsonl").read_text().splitlines()]
    assert {(r["name"], r["step"], r["action"]) for r in rows} == {("logprob_gap", 2, "warn"),
                                                                   ("constant_reward", 2, "warn")}
    assert "gate logprob_gap fired at step 2: rollout/logprob_abs_diff = 0.5 (threshold 0.001)" in caplog.text
    stopping = Gates(GatesConfig(weight_sync="stop", logprob_gap="off"), "float32", None)
    with pytest.raises(GateStopped, match=r"gate weight_sync fired at step 7: weight_sync/checksum_unequal = 1 "
                                          r".*trainer.gates.weight_sync=warn"):
        stopping.check(7, steady, {"checked": 2, "unequal": 1, "first_unequal": "w", "engine_changed": 0,
                                   "trainer_changed": 1})
    assert "gates/logprob_gap" not in Gates(GatesConfig(logprob_gap="off"), "float32", None).check(1, steady)


def test_gate_config_checks_name_the_key():
    cfg = RLConfig()
    cfg.trainer.gates.weight_sync = "halt"
    cfg.trainer.gates.zero_variance_max_share = 1.5
    with pytest.raises(ConfigError) as error:
        validate_config(cfg)
    assert "trainer.gates.weight_sync: 'halt' is not one of warn, stop, off" in str(error.value)
    assert "trainer.gates.zero_variance_max_share: must be in [0, 1]" in str(error.value)


def test_the_gates_history_survives_a_checkpoint():
    """A resumed run's gates fire at the step the uninterrupted run's do (the history is in the driver state)."""
    steady = {"reward/zero_variance_groups": 1.0, "reward/score_std": 0.0, "rollout/sampled_nll": 0.4}
    whole = Gates(GatesConfig(constant_reward_steps=3), "float32", None)
    resumed = Gates(GatesConfig(constant_reward_steps=3), "float32", None)
    for step in (1, 2):
        whole.check(step, steady)
        resumed.check(step, steady)
    restored = Gates(GatesConfig(constant_reward_steps=3), "float32", None)
    restored.load_state_dict(json.loads(json.dumps(resumed.state_dict())))
    assert whole.check(3, steady) == restored.check(3, steady)
    assert restored.check(4, steady)["gates/constant_reward"] == 1.0 and restored.first_entropy == 0.4


def test_a_gate_that_fires_every_step_keeps_the_driver_bounded(tmp_path):
    """Gates that warn on every step (a random model: every group scores the same) keep FIRED_KEPT events in
    memory, however long the run; every event still reaches gates.jsonl (issue 44: the soak's driver grew by two
    GateEvents a step)."""
    from rlframe.trainer.gates import FIRED_KEPT

    gates = Gates(GatesConfig(constant_reward_steps=2), "float32", tmp_path)
    steady = {"reward/zero_variance_groups": 1.0, "reward/score_std": 0.0, "rollout/sampled_nll": 0.4}
    steps = 3 * FIRED_KEPT
    for step in range(1, steps + 1):
        gates.check(step, steady)
    logged = [json.loads(line) for line in (tmp_path / "gates.jsonl").read_text().splitlines()]
    assert len(logged) > 2 * FIRED_KEPT  # both gates fire on (nearly) every step
    assert len(gates.fired) == FIRED_KEPT
    assert [(e.name, e.step) for e in gates.fired] == [(r["name"], r["step"]) for r in logged[-FIRED_KEPT:]]


def test_topk_overlap_gate_fires_on_a_collapsed_overlap_and_holds_on_a_healthy_or_recovering_one(tmp_path):
    """Hand-made distillation metrics: an overlap below topk_overlap_min two steps in a row fires (with the value,
    the threshold and the doctor check named); a healthy overlap, one low step, and a run without a teacher do not."""
    assert topk_overlap_gate(2, [0.9, 0.1], 0.2, 2) is None  # one low step: not yet
    assert topk_overlap_gate(3, [0.1, 0.25, 0.1], 0.2, 2) is None  # recovered in between
    event = topk_overlap_gate(3, [0.9, 0.15, 0.05], 0.2, 2)
    assert (event.name, event.value, event.threshold) == ("topk_overlap", 0.05, 0.2)
    assert "live/teacher_self_kl" in event.cause

    steady = {"reward/zero_variance_groups": 0.0, "reward/score_std": 0.5, "rollout/sampled_nll": 0.4}
    collapsing = Gates(GatesConfig(), "float32", tmp_path)
    verdicts = [collapsing.check(step, {**steady, "distill/topk_overlap": overlap})["gates/topk_overlap"]
                for step, overlap in enumerate([0.8, 0.7, 0.12, 0.08, 0.3], start=1)]
    assert verdicts == [0.0, 0.0, 0.0, 1.0, 0.0]
    rows = [json.loads(line) for line in (tmp_path / "gates.jsonl").read_text().splitlines()]
    assert [(r["name"], r["step"], r["value"]) for r in rows] == [("topk_overlap", 4, 0.08)]

    healthy = Gates(GatesConfig(), "float32", None)
    assert all(healthy.check(step, {**steady, "distill/topk_overlap": 0.75})["gates/topk_overlap"] == 0.0
               for step in range(1, 5))
    assert "gates/topk_overlap" not in Gates(GatesConfig(), "float32", None).check(1, steady)  # no teacher
    assert Gates(GatesConfig(topk_overlap_min=0.5, topk_overlap_steps=1), "float32", None).check(
        1, {**steady, "distill/topk_overlap": 0.4})["gates/topk_overlap"] == 1.0  # the threshold is the config's
