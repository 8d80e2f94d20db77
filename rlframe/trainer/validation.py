"""Validation by generation: greedy responses to the held-out prompts, scored as training scores them.

val/reward_mean: the rule-based reward functions' score; val/score_mean: the score training uses
(+ reward_model.weight * RM score + overlong shaping); val/accuracy: see scorer.validation_accuracy.
val/accuracy_ci_low, _ci_high and val/reward_mean_ci_low, _ci_high: their 95% percentile-bootstrap interval
over the validation prompts (one response each; rlframe/evaluation/stats.py, seeded with trainer.seed).
"""

from __future__ import annotations

import time

import numpy as np

from rlframe.config import RLConfig
from rlframe.data.dataset import RLDataset, collate_prompts
from rlframe.data.multimodal import share_multi_modal_fields
from rlframe.evaluation.stats import bootstrap_interval
from rlframe.protocol import DataProto
from rlframe.trainer.scorer import Scorer, overlong_penalties, validation_accuracy

SAMPLES_KEPT = 8  # responses written to validation_samples.jsonl per validation


def add_environment_rows(prompts: DataProto, batch: DataProto, cfg: RLConfig) -> None:
    """A multi-turn environment's `reset(row)` and an agent program's `row` get the row's ground truth, data
    source and extra info."""
    if not ((cfg.rollout.multi_turn.enable and cfg.rollout.multi_turn.environment.path)
            or cfg.rollout.agent_program.enabled):
        return
    nt = batch.non_tensor_batch
    rows = [{"ground_truth": nt["ground_truth"][i], "data_source": nt["data_source"][i],
             "extra_info": nt["extra_info"][i]} for i in range(len(batch))]
    prompts.non_tensor_batch["env_row"] = np.array(rows, dtype=object)


def split_prompts(batch: DataProto, cfg: RLConfig) -> DataProto:
    """The engine's part of a batch of prompt rows (ids, masks, images, environment rows), popped from `batch`,
    with the batch's step: the engines seed a training step's sampling from it (workers/rollout/base.py)."""
    prompts = batch.pop(batch_keys=["input_ids", "attention_mask", "position_ids"])
    if "step" in batch.meta_info:
        prompts.meta_info["step"] = batch.meta_info["step"]
    share_multi_modal_fields(prompts, batch)  # rows with images: the rollout engine needs them
    add_environment_rows(prompts, batch, cfg)
    return prompts


def validate_by_generation(cfg: RLConfig, val_set: RLDataset, actor_rollout, scorer: Scorer,
                           pad_token_id: int) -> tuple[dict[str, float], list[dict]]:
    """(the val/* metrics, the first responses as rows {response, ground_truth, score})."""
    start = time.perf_counter()
    n = min(len(val_set), cfg.data.val_max_samples or len(val_set))
    batch = collate_prompts([val_set[i] for i in range(n)], pad_token_id)
    prompts = split_prompts(batch, cfg)
    prompts.meta_info["validate"] = True
    batch = batch.union(actor_rollout.generate_sequences(prompts, _timeout=cfg.trainer.timeouts.rollout))
    texts = scorer.decode(batch)
    result, scores, reward_metrics = scorer.rule_and_model_scores(batch, texts)
    penalty = overlong_penalties(batch.batch["response_mask"], cfg)
    accuracy = validation_accuracy(result)
    truths = batch.non_tensor_batch["ground_truth"]
    samples = [{"response": text, "ground_truth": str(truth), "score": float(score)}
               for text, truth, score in zip(texts[:SAMPLES_KEPT], truths[:SAMPLES_KEPT], result.scores[:SAMPLES_KEPT])]
    metrics = {"val/reward_mean": float(np.mean(result.scores)),
               "val/score_mean": float(np.mean(scores + (0.0 if penalty is None else penalty.double().numpy()))),
               "val/accuracy": float(np.nanmean(accuracy)),
               "val/response_length": float(batch.batch["response_mask"].sum(-1).mean()),
               "timing/validation": time.perf_counter() - start}
    if "reward/rm_score_mean" in reward_metrics:
        metrics["val/rm_score_mean"] = reward_metrics["reward/rm_score_mean"]
    metrics.update(validation_intervals(accuracy, np.asarray(result.scores, dtype=float), cfg.trainer.seed))
    return metrics, samples


def validation_intervals(accuracy: np.ndarray, rewards: np.ndarray, seed: int) -> dict[str, float]:
    """95% bootstrap intervals of val/accuracy and val/reward_mean over the prompts (one response per prompt).

    Added beside the values, which stay as they were: the accuracy's interval resamples the prompts that
    val/accuracy averages (those some function scored: NaN rows are left out, as np.nanmean leaves them)."""
    out = {}
    accuracy = np.asarray(accuracy, dtype=float)
    for key, values in (("val/accuracy", accuracy[~np.isnan(accuracy)]), ("val/reward_mean", rewards)):
        out[key + "_ci_low"], out[key + "_ci_high"] = bootstrap_interval(values, seed=seed)
    return out
