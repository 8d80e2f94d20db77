"""On-policy preference pairs: sample n responses per prompt with our rollout engine, score them with
the reward functions, keep (best, worst) when their scores differ; write them as chosen/rejected rows.

`stage=dpo` (and `rm`) on prompt data without chosen/rejected columns calls `generate_pairs` before
training; `python -m rlframe.pairs recipe=dpo_math out=pairs.jsonl` (rlframe/pairs.py) runs it alone.

Row layout written (jsonl): prompt (the chat messages), chosen, rejected (reply texts),
chosen_score, rejected_score, ground_truth, data_source.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from rlframe.config import RLConfig
from rlframe.data.dataset import RLDataset, read_rows
from rlframe.stages.common import prompts_batch


def _prompt_messages(dataset: RLDataset, index: int, prompt_key: str, cache: dict) -> list[dict] | str:
    """The original prompt field of a dataset row (chat messages or a string)."""
    row = dataset.rows[index]
    if row["file"] not in cache:
        cache[row["file"]] = read_rows(row["file"])
    value = cache[row["file"]][row["row"]]
    for part in prompt_key.split("."):
        value = value[part]
    return value if isinstance(value, str) else [dict(m) for m in value]


def select_pair(scores: list[float], min_gap: float) -> tuple[int, int] | None:
    """(best, worst) sample indices of one prompt; None when the scores differ by less than min_gap.
    Ties go to the earliest sample."""
    best, worst = int(np.argmax(scores)), int(np.argmin(scores))
    return (best, worst) if scores[best] - scores[worst] >= min_gap else None


def generate_pairs(trainer, dataset: RLDataset, out_file: Path) -> dict[str, float]:
    """Sample pairs with `trainer`'s rollout engine (a StageTrainer's actor_rollout) and score them with
    its scorer; write them to `out_file`. Returns the pair statistics."""
    cfg: RLConfig = trainer.cfg
    p = cfg.pairs
    start = time.perf_counter()
    order = np.random.default_rng(cfg.data.seed).permutation(len(dataset))
    chosen_prompts = order[:p.prompts] if p.prompts else order
    rows, n_scored, score_sum, cache = [], 0, 0.0, {}
    trainer.actor_rollout.sync_weights(_timeout=cfg.trainer.timeouts.weight_sync)
    for first in range(0, len(chosen_prompts), p.batch_size):
        indices = [int(i) for i in chosen_prompts[first:first + p.batch_size]]
        batch = prompts_batch(dataset, indices, trainer.pad_token_id)
        prompts = batch.pop(batch_keys=["input_ids", "attention_mask", "position_ids"]).repeat(p.n, interleave=True)
        batch = batch.repeat(p.n, interleave=True)
        prompts.meta_info["step"] = first // p.batch_size  # seeds the sampling (rollout.temperature)
        batch = batch.union(trainer.actor_rollout.generate_sequences(prompts, _timeout=cfg.trainer.timeouts.rollout))
        texts = trainer.scorer.decode(batch)
        _, scores, _ = trainer.scorer.rule_and_model_scores(batch, texts)
        n_scored += len(scores)
        score_sum += float(np.sum(scores))
        for k, index in enumerate(indices):
            group = slice(k * p.n, (k + 1) * p.n)
            group_texts, group_scores = texts[group], [float(s) for s in scores[group]]
            picked = select_pair(group_scores, p.min_score_gap)
            if picked is None or not group_texts[picked[0]].strip() or not group_texts[picked[1]].strip():
                continue
            if group_texts[picked[0]].strip() == group_texts[picked[1]].strip():
                continue
            rows.append({"prompt": _prompt_messages(dataset, index, cfg.data.prompt_key, cache),
                         "chosen": group_texts[picked[0]], "rejected": group_texts[picked[1]],
                         "chosen_score": group_scores[picked[0]], "rejected_score": group_scores[picked[1]],
                         "ground_truth": str(dataset[index]["ground_truth"]),
                         "data_source": dataset[index]["data_source"]})
        print(f"pairs: {first + len(indices)}/{len(chosen_prompts)} prompts sampled, {len(rows)} pairs "
              f"({time.perf_counter() - start:.0f}s)", flush=True)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    with open(out_file, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    stats = {"pairs/prompts": float(len(chosen_prompts)), "pairs/pairs": float(len(rows)),
             "pairs/sample_score_mean": score_sum / max(n_scored, 1), "timing/pair_generation": time.perf_counter() - start}
    print(f"pairs: wrote {len(rows)} pairs from {len(chosen_prompts)} prompts x {p.n} samples to {out_file} "
          f"in {stats['timing/pair_generation']:.0f}s (mean sample score {stats['pairs/sample_score_mean']:.3f})",
          flush=True)
    return stats
