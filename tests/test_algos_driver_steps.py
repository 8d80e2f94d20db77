"""The driver's algorithm steps on hand-computed numbers: DAPO overlong shaping, the KL in the reward,
ReMax's greedy baseline and what validation reports (rlframe/trainer/algorithm_steps.py, scorer.py,
validation.py, rollout_source.py).

No workers: the rollout engine is a stub that returns fixed responses; the scorer and the reward functions are real."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from rlframe.algos import FixedKLController
from rlframe.config import RLConfig
from rlframe.protocol import DataProto
from rlframe.config import RewardFunctionConfig
from rlframe.reward.manager import RewardResult
from rlframe.trainer import algorithm_steps
from rlframe.trainer.phases import PhaseClock
from rlframe.trainer.rollout_source import RolloutSource
from rlframe.trainer.scorer import (Scorer, last_trained_token, overlong_penalties, reported_accuracy,
                                    shape_overlong)
from rlframe.trainer.validation import validate_by_generation


def overlong_config(max_len=8, buffer=4, factor=0.5) -> RLConfig:
    cfg = RLConfig()
    cfg.data.max_response_length = max_len
    cfg.algorithm.overlong_buffer.enable = True
    cfg.algorithm.overlong_buffer.len = buffer
    cfg.algorithm.overlong_buffer.penalty_factor = factor
    return cfg


def mask_of(lengths, width=8) -> torch.Tensor:
    return (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).float()


def test_overlong_shaping_hand_computed():
    mask = mask_of([3, 5, 8, 0])
    scores = torch.zeros(4, 8)
    scores[0, 2], scores[1, 4], scores[2, 7] = 1.0, 1.0, 1.0  # outcome scores on the last tokens
    batch = DataProto.from_dict(tensors={"response_mask": mask, "token_level_scores": scores})
    # the buffer starts at 8 - 4 = 4 tokens: L=3 -> 0; L=5 -> (4 - 5) / 4 = -0.25; L=8 -> -1; x factor 0.5
    expected_penalty = torch.tensor([0.0, -0.125, -0.5, 0.0])
    assert torch.allclose(overlong_penalties(mask, overlong_config()), expected_penalty)
    metrics = shape_overlong(batch, overlong_config())
    assert torch.allclose(batch.batch["token_level_scores"].sum(-1), torch.tensor([1.0, 0.875, 0.5, 0.0]))
    assert batch.batch["token_level_scores"][1, 4] == pytest.approx(0.875)  # on the last token
    assert metrics == pytest.approx({"reward/overlong_penalty": -0.625 / 4, "reward/overlong_frac": 0.5})
    off = RLConfig()
    assert overlong_penalties(mask, off) is None and shape_overlong(batch, off) == {}


def test_overlong_penalty_lands_on_the_last_trained_token_of_a_mask_with_holes():
    """A multi-turn response: model turn (tokens 0-1), tool tokens (2-4, mask 0), model turn (5-6), padding.
    mask.sum() - 1 = 3 is a tool token; the penalty belongs on token 6, where the outcome score sits."""
    mask = torch.tensor([[1, 1, 0, 0, 0, 1, 1, 0], [1, 1, 1, 0, 0, 0, 0, 0]], dtype=torch.float32)
    assert last_trained_token(mask).tolist() == [6, 2]
    scores = torch.zeros(2, 8)
    scores[0, 6], scores[1, 2] = 1.0, 1.0
    batch = DataProto.from_dict(tensors={"response_mask": mask, "token_level_scores": scores})
    # max length 6, buffer 4: the buffer starts at 2 trained tokens; L=4 -> (2 - 4) / 4 = -0.5, L=3 -> -0.25; x 0.5
    shape_overlong(batch, overlong_config(max_len=6, buffer=4, factor=0.5))
    shaped = batch.batch["token_level_scores"]
    assert shaped[0].tolist() == [0, 0, 0, 0, 0, 0, 0.75, 0]  # on token 6, not on the tool token 3
    assert shaped[1].tolist() == [0, 0, 0.875, 0, 0, 0, 0, 0]
    assert batch.batch["outcome_scores"].tolist() == [1.0, 1.0]


def test_dynamic_sampling_compares_the_scores_before_overlong_shaping():
    # group a: both right, lengths 3 and 8 (shaped 1.0 and 0.5: they differ only by the length penalty)
    # group b: one right, one wrong
    mask = mask_of([3, 8, 2, 2])
    scores = torch.zeros(4, 8)
    scores[0, 2], scores[1, 7], scores[2, 1] = 1.0, 1.0, 1.0
    batch = DataProto.from_dict(tensors={"response_mask": mask, "token_level_scores": scores.clone()},
                                non_tensors={"uid": np.array(["a", "a", "b", "b"], dtype=object)})
    shape_overlong(batch, overlong_config())
    assert torch.equal(batch.batch["outcome_scores"], torch.tensor([1.0, 1.0, 1.0, 0.0]))
    kept = algorithm_steps.keep_informative(batch)
    assert list(kept.non_tensor_batch["uid"]) == ["b", "b"]
    assert torch.allclose(kept.batch["token_level_scores"].sum(-1), torch.tensor([1.0, 0.0]))  # still shaped rows
    # without shaping: the token-level scores themselves
    plain = DataProto.from_dict(tensors={"response_mask": mask, "token_level_scores": scores},
                                non_tensors={"uid": np.array(["a", "a", "b", "b"], dtype=object)})
    assert len(algorithm_steps.keep_informative(plain)) == 2
    # an LLM judge's unscorable row (scorable False) does not make its group informative: "a" differs only there
    judged = DataProto.from_dict(tensors={"response_mask": mask_of([1, 1, 1, 1], width=1),
                                          "token_level_scores": torch.tensor([[1.0], [5.0], [1.0], [0.0]]),
                                          "scorable": torch.tensor([True, False, True, True])},
                                 non_tensors={"uid": np.array(["a", "a", "b", "b"], dtype=object)})
    assert list(algorithm_steps.keep_informative(judged).non_tensor_batch["uid"]) == ["b", "b"]


def test_kl_in_reward_hand_computed():
    mask = mask_of([2, 1], width=2)
    scores = torch.tensor([[0.0, 1.0], [0.5, 0.0]])
    old = torch.tensor([[-1.0, -2.0], [-1.0, -9.0]])
    ref = torch.tensor([[-1.5, -1.0], [-2.0, 0.0]])
    batch = DataProto.from_dict(tensors={"response_mask": mask, "token_level_scores": scores, "old_log_probs": old,
                                         "ref_log_prob": ref})
    metrics = algorithm_steps.token_level_rewards(batch, FixedKLController(0.1), "k1")
    # k1 = old - ref: [0.5, -1.0], [1.0, (masked)]; rewards = scores - 0.1 * k1
    expected = torch.tensor([[-0.05, 1.1], [0.4, 0.0]])
    assert torch.allclose(batch.batch["token_level_rewards"], expected)
    assert metrics["reward/kl_coef"] == 0.1
    assert metrics["reward/kl_penalty"] == pytest.approx(((0.5 - 1.0) / 2 + 1.0) / 2)  # per-token mean, then rows
    assert metrics["critic/rewards/mean"] == pytest.approx((1.05 + 0.4) / 2)
    # without the KL in the reward the rewards are the scores and nothing is logged
    assert algorithm_steps.token_level_rewards(batch, None) == {}
    assert batch.batch["token_level_rewards"] is batch.batch["token_level_scores"]


def test_reported_accuracy():
    nan = float("nan")
    single = RewardResult(scores=np.zeros(3), extras={"acc": np.array([1.0, 0.0, nan])})
    assert np.array_equal(reported_accuracy(single), np.array([1.0, 0.0, nan]), equal_nan=True)
    # several functions: labelled keys; per response the mean over the functions that scored it
    several = RewardResult(scores=np.zeros(3), extras={"math/acc": np.array([1.0, nan, 0.0]),
                                                       "code/acc": np.array([nan, 1.0, 1.0]),
                                                       "math/format": np.array([1.0, 1.0, 1.0])})
    assert np.allclose(reported_accuracy(several), [1.0, 1.0, 0.5])
    assert reported_accuracy(RewardResult(scores=np.zeros(2), extras={"format": np.ones(2)})) is None


# ----------------------------------------------------------------------------------------------
# the trainer's steps, with a stub rollout

PER_SAMPLE = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    right = float(ground_truth == "a")
    return {"score": right, "acc": right}
'''
BATCH = '''
REWARD_TYPE = "batch"

def compute_score(reward_inputs):
    return [{"score": x["response_length"] / 10} for x in reward_inputs]   # fails on None
'''
NO_ACC = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return 2.0 if ground_truth == "a" else 0.5
'''


class StubRollout:
    """Answers every prompt i with a response of lengths[i] tokens (of width 8)."""

    def __init__(self, lengths):
        self.lengths, self.calls = lengths, []

    def generate_sequences(self, prompts: DataProto, _timeout=None) -> DataProto:
        self.calls.append(dict(prompts.meta_info))
        mask = mask_of(self.lengths[: len(prompts)])
        return DataProto.from_dict(tensors={"responses": torch.ones(len(prompts), 8, dtype=torch.long),
                                            "response_mask": mask})


class StubTokenizer:
    def batch_decode(self, rows, skip_special_tokens=True):
        return ["x" * len(row) for row in rows]


VAL_ROWS = [{"input_ids": [5, 6], "raw_prompt": "p", "data_source": "d", "extra_info": None}]


def val_set(truths) -> list[dict]:
    return [{**VAL_ROWS[0], "ground_truth": truth, "index": i} for i, truth in enumerate(truths)]


def scorer_of(cfg: RLConfig, tmp_path, *sources) -> Scorer:
    """The real scorer over reward files written from `sources` (run in this process: num_workers=0)."""
    cfg.reward.functions = []
    for i, source in enumerate(sources):
        path = tmp_path / f"fn{i}.py"
        path.write_text(source)
        cfg.reward.functions.append(RewardFunctionConfig(path=str(path)))
    cfg.reward.num_workers = 0
    return Scorer(cfg, StubTokenizer(), PhaseClock())


def validate(cfg, scorer, lengths, truths):
    rollout = StubRollout(lengths)
    metrics, samples = validate_by_generation(cfg, val_set(truths), rollout, scorer, pad_token_id=0)
    return metrics, samples, rollout


def test_validation_main_case_keys_keep_their_meaning(tmp_path):
    cfg = RLConfig()
    metrics, samples, rollout = validate(cfg, scorer_of(cfg, tmp_path, PER_SAMPLE), [2, 4, 8, 8], ["a", "b", "a", "a"])
    assert rollout.calls == [{"validate": True}]
    assert [s["score"] for s in samples] == [1.0, 0.0, 1.0, 1.0] and samples[0]["response"] == "xx"
    assert metrics["val/reward_mean"] == metrics["val/score_mean"] == 0.75  # no RM, no shaping: the same
    assert metrics["val/accuracy"] == 0.75
    assert metrics["val/response_length"] == 5.5


def test_validation_several_functions_shaping_and_batch_lengths(tmp_path, caplog):
    cfg = overlong_config(max_len=8, buffer=4, factor=1.0)
    scorer = scorer_of(cfg, tmp_path, PER_SAMPLE, BATCH)
    with caplog.at_level(logging.INFO, logger="rlframe.trainer.scorer"):
        metrics, _, _ = validate(cfg, scorer, [2, 4, 8], ["a", "b", "a"])
    # rule score = (1, 0, 1) + length / 10 (the batch function gets the real lengths 2, 4, 8)
    assert metrics["val/reward_mean"] == pytest.approx((1.2 + 0.4 + 1.8) / 3)
    # the training score adds the overlong penalty: 0, 0, -1 (L = 8 is at the limit)
    assert metrics["val/score_mean"] == pytest.approx((1.2 + 0.4 + 1.8 - 1.0) / 3)
    assert metrics["val/accuracy"] == pytest.approx(2 / 3)  # fn0/acc, the one function that reports it
    assert "the mean of fn0/acc" in caplog.text


def test_validation_without_acc_says_what_accuracy_means(tmp_path, caplog):
    cfg = RLConfig()
    scorer = scorer_of(cfg, tmp_path, NO_ACC)
    with caplog.at_level(logging.INFO, logger="rlframe.trainer.scorer"):
        metrics, _, _ = validate(cfg, scorer, [2, 4, 8], ["a", "b", "b"])
        validate(cfg, scorer, [2, 4, 8], ["a", "b", "b"])
    assert metrics["val/accuracy"] == pytest.approx(1 / 3)  # rewards 2, 0.5, 0.5: one is >= 1
    assert caplog.text.count("no reward function returns an 'acc' key") == 1


def test_remax_greedy_baseline_is_overlong_shaped_like_the_samples(tmp_path):
    cfg = overlong_config(max_len=8, buffer=4, factor=0.5)
    cfg.algorithm.adv_estimator = "remax"
    cfg.data.train_batch_size = 2
    scorer = scorer_of(cfg, tmp_path, PER_SAMPLE)
    rows = val_set(["a", "b"])
    source = RolloutSource(cfg, rows, scorer, scorer.clock, model_path="unused", pad_token_id=0)
    rollout = StubRollout([3, 8])
    source.attach(rollout, engines_record_versions=False)
    assert source.greedy_baseline_needed
    batch = DataProto.from_dict(non_tensors={key: [row[key] for row in rows]
                                             for key in ("raw_prompt", "ground_truth", "data_source", "extra_info")})
    prompts = DataProto.from_dict(tensors={"input_ids": torch.ones(2, 2, dtype=torch.long)}, meta_info={"step": 1})
    baseline = source.greedy_baseline(batch, prompts)
    assert rollout.calls == [{"greedy": True}]
    # scores 1, 0; penalties 0 (L=3) and 0.5 * -1 (L=8, the limit)
    assert torch.allclose(baseline, torch.tensor([1.0, -0.5]))
