"""stage=pt: continued pre-training, next-token prediction on raw text packed to the context length.

    documents = the text files (txt / jsonl / parquet: pt.text_key), or on the embedded default the
                project's arithmetic problems written out with their worked solutions
    rows      = pack_documents(tokenised documents + EOS, pt.max_length)   # stages/pt_data.py
    for step in steps:
        actor_rollout.update_sft(collate_packed(next rows))   # NLL of every token with in-document context
    validate: val/loss (NLL per token of the held-out documents) and val/perplexity = exp(val/loss)
    export: <run_dir>/hf_model, a model.path for stage=sft or RL

The rows go through the engine's packed (padding-free) forward, where a position id of 0 starts a new
causal sequence: documents sharing a row never attend to each other (config check: packing on).
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import replace
from pathlib import Path

from rlframe.config import RLConfig
from rlframe.stages.common import StageTrainer
from rlframe.data.dataset import read_rows
from rlframe.stages.pt_data import PackedRow, collate_packed, load_documents, pack_documents, tokenize_documents
from rlframe.stages.sft import worked_solution
from rlframe.trainer.worker_settings import actor_settings
from rlframe.workers.roles.policy_trainer import PolicyTrainerWorker
from rlframe.workers.settings import ActorSettings, UpdateLoop

VAL_CHUNK_ROWS = 32


def pt_settings(cfg: RLConfig, model_path: str) -> ActorSettings:
    """The actor (no rollout engine) with the SFT update loop over packed rows (pt.batch_size rows per step)."""
    pt = cfg.pt
    loop = UpdateLoop(mini_batch_size=pt.batch_size // cfg.actor.world_size, micro_batch_size=pt.micro_batch_size,
                      epochs=1, shuffle=True, loss_agg_mode="token-mean")
    return replace(actor_settings(cfg, model_path, with_rollout=False), loop=loop)  # nothing is generated


def arithmetic_documents(files: list[str]) -> list[str]:
    """data.source=arithmetic: the project's own problems as text, each with its worked solution
    (`rlframe.stages.sft.worked_solution`): the generated text set of `recipe=pt_text`."""
    documents = []
    for path in files:
        for row in read_rows(path):
            question, answer = row["extra_info"]["question"], row["reward_model"]["ground_truth"]
            documents.append(f"Problem: {question}\nSolution: {worked_solution(question, answer)}")
    return documents


def split_documents(cfg: RLConfig, train_files: list[str], val_files: list[str]) -> tuple[list[str], list[str]]:
    """(training, held-out) documents: the validation files', else a seeded pt.val_fraction of the training ones."""
    pt = cfg.pt
    if cfg.data.source == "arithmetic":
        return arithmetic_documents(train_files), arithmetic_documents(val_files)
    train = load_documents(train_files, pt.text_key)
    if val_files:
        return train, load_documents(val_files, pt.text_key)
    order = list(range(len(train)))
    random.Random(cfg.data.seed).shuffle(order)
    held = set(order[:max(1, int(len(train) * pt.val_fraction))]) if len(train) > 1 and pt.val_fraction > 0 else set()
    return [d for i, d in enumerate(train) if i not in held], [d for i, d in enumerate(train) if i in held]


class PretrainTrainer(StageTrainer):
    def __init__(self, cfg: RLConfig, model_path: str, tokenizer, train_files: list[str], val_files: list[str],
                 run_dir: Path):
        super().__init__(cfg, model_path, tokenizer, run_dir)
        pt = cfg.pt
        train_docs, val_docs = split_documents(cfg, train_files, val_files)
        self.rows: list[PackedRow] = pack_documents(tokenize_documents(train_docs, tokenizer), pt.max_length)
        self.val_rows: list[PackedRow] = pack_documents(tokenize_documents(val_docs, tokenizer), pt.max_length) \
            if val_docs else []
        tokens = sum(len(r.ids) for r in self.rows)
        print(f"pt: {len(train_docs)} documents, {tokens} tokens packed into {len(self.rows)} rows of "
              f"{pt.max_length}; held out: {len(val_docs)} documents ({len(self.val_rows)} rows)", flush=True)
        self.roles = {"actor_rollout": (PolicyTrainerWorker, {"settings": pt_settings(cfg, model_path)})}
        self.start([])  # no generation validation: the held-out perplexity is pt's
        self.plan_steps(len(self.rows), pt.batch_size, pt.epochs, "packed rows")

    @property
    def val_every(self) -> int:
        return self.cfg.pt.val_every

    def has_validation(self) -> bool:
        return bool(self.val_rows)

    def train_step(self, step: int) -> dict[str, float]:
        batch = collate_packed([self.rows[i] for i in next(self.batches)], self.pad_token_id)
        batch.meta_info["step"] = step
        with self.clock.timed("update"):
            out = self.actor_rollout.update_sft(batch, _timeout=self.cfg.trainer.timeouts.update)
        metrics = {key.replace("sft/", "pt/"): value for key, value in out.meta_info["metrics"].items()}
        metrics["pt/loss_tokens"] = float(batch.batch["response_mask"].sum())
        metrics["pt/epoch"] = float(self.sampler.state_dict()["epoch"])
        return metrics

    def validate(self) -> dict[str, float]:
        """val/loss: the NLL per token of the held-out rows; val/perplexity = exp(val/loss)."""
        if not self.val_rows:
            return {}
        start, nll, tokens = time.perf_counter(), 0.0, 0.0
        for first in range(0, len(self.val_rows), VAL_CHUNK_ROWS):
            batch = collate_packed(self.val_rows[first:first + VAL_CHUNK_ROWS], self.pad_token_id)
            out = self.actor_rollout.compute_nll(batch, _timeout=self.cfg.trainer.timeouts.log_prob)
            nll += float(out.batch["nll_sum"].sum())
            tokens += float(out.batch["nll_tokens"].sum())
        loss = nll / max(tokens, 1.0)
        return {"val/loss": loss, "val/perplexity": math.exp(min(loss, 50.0)), "val/tokens": tokens,
                "timing/validation_loss": time.perf_counter() - start}
