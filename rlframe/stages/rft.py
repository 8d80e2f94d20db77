"""stage=rft: rejection-sampling fine-tuning (RAFT, ReST/STaR-style; RRHF's ranking loss as an option).

    for step (= round) in 1 .. rft.rounds:
        samples = actor_rollout.generate_sequences(next prompts x rft.n)   # at rollout.temperature
        scores  = scorer(samples)                                          # reward.functions
        rows    = the keep_top_k best per prompt with score >= min_score   # select_kept (loss=sft)
                  or the whole group of a prompt whose best reaches it      # (loss=rrhf)
        for each of rft.epochs shuffled passes, each rft.batch_size rows:
            actor_rollout.update_sft(rows)          # one optimiser step (rrhf: update_dpo, the ranking objective)
    validate: the RL driver's generation validation after each round (val/reward_mean, val/accuracy)
    export: <run_dir>/hf_model

The kept replies are the sampled token ids themselves (no re-tokenisation); a prompt whose samples all
fall below min_score contributes nothing that round. With reward.judge (rlframe/reward/judge.py) a sample's
score is the rule rewards' + reward.judge.weight * the judge's (reward/judge_parse_failure_rate logged).
Metrics per round: rft/kept_rows, rft/kept_prompts,
rft/sample_score_mean, rft/sample_accuracy, rft/optimizer_steps, timing/rft_sampling. A checkpoint lands
after a round, so a resumed run starts the next round.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from rlframe.config import RLConfig
from rlframe.reward.judge import build_judge, prompt_text
from rlframe.stages.common import StageTrainer, capped_steps, prompts_batch
from rlframe.stages.data import Example, collate_sft
from rlframe.stages.dpo import pair_prompts
from rlframe.trainer.scorer import validation_accuracy
from rlframe.trainer.worker_settings import actor_settings, judge_engine_settings
from rlframe.workers.roles.policy_trainer import PolicyTrainerWorker, PreferenceSettings
from rlframe.workers.settings import ActorSettings, UpdateLoop


def select_kept(scores: list[float], texts: list[str], keep_top_k: int, min_score: float) -> list[int]:
    """The samples of one prompt that become SFT rows: score >= min_score, best first (ties: the earlier
    sample), identical replies (stripped text) once, at most keep_top_k of them (0: all)."""
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
    kept, seen = [], set()
    for i in order:
        text = texts[i].strip()
        if scores[i] < min_score or not text or text in seen:
            continue
        seen.add(text)
        kept.append(i)
        if keep_top_k and len(kept) == keep_top_k:
            break
    return kept


def rft_settings(cfg: RLConfig, model_path: str) -> ActorSettings:
    """The actor with its rollout engine and the SFT update loop (rft.batch_size rows per step over all ranks)."""
    rft = cfg.rft
    rows = rft.batch_size * (rft.n if rft.loss == "rrhf" else 1)
    loop = UpdateLoop(mini_batch_size=rows // cfg.actor.world_size, micro_batch_size=rft.micro_batch_size,
                      epochs=1, shuffle=True, loss_agg_mode="token-mean")
    return replace(actor_settings(cfg, model_path, with_rollout=True), loop=loop)


class RFTTrainer(StageTrainer):
    def __init__(self, cfg: RLConfig, model_path: str, tokenizer, train_files: list[str], val_files: list[str],
                 run_dir: Path, datasets: dict | None = None):
        super().__init__(cfg, model_path, tokenizer, run_dir)
        rft = cfg.rft
        datasets = datasets or {}  # (the pre-Ray checks' prompts: rlframe/preflight.py)
        self.prompts = datasets["train"] if "train" in datasets else pair_prompts(cfg, tokenizer, train_files)
        self.prompt_order = np.random.default_rng(cfg.data.seed).permutation(len(self.prompts)).tolist()
        preference = PreferenceSettings(loss_type="rrhf", group_size=rft.n) if rft.loss == "rrhf" else None
        self.roles = {"actor_rollout": (PolicyTrainerWorker, {"settings": rft_settings(cfg, model_path),
                                                              "preference": preference})}
        self.rows: list[Example] = []  # this round's rows (rrhf: groups of n consecutive rows)
        self.round_index = 0
        self.round_metrics: dict[str, float] = {}
        print(f"rft: {rft.rounds} rounds of {rft.prompts_per_round} prompts x {rft.n} samples, keep "
              f"{rft.keep_top_k or 'all'} per prompt with score >= {rft.min_score}, then {rft.epochs} {rft.loss} "
              f"pass(es) in steps of {rft.batch_size} ({len(self.prompts)} training prompts)", flush=True)
        self.start(val_files)
        self.judge = build_judge(cfg, run_dir, lambda: judge_engine_settings(cfg),  # None without reward.judge
                                 unscorable_score=cfg.reward.judge.fallback_score)  # (rft ranks: no NaN)
        self.plan_run(capped_steps(cfg, rft.rounds, f"rft.rounds={rft.rounds}, one step each", "rft.rounds"))

    @property
    def val_every(self) -> int:
        return 1  # after every round

    # ------------------------------------------------------------------ one round's data
    def round_prompts(self, round_index: int) -> list[int]:
        """The next prompts_per_round training prompts (a seeded order, wrapping around)."""
        k, order = self.cfg.rft.prompts_per_round, self.prompt_order
        return [order[(round_index * k + j) % len(order)] for j in range(k)]

    def sample_round(self, round_index: int) -> None:
        """Sample, score and filter one round's rows into self.rows; its metrics into self.round_metrics."""
        cfg, rft = self.cfg, self.cfg.rft
        start = time.perf_counter()
        self.actor_rollout.sync_weights(_timeout=cfg.trainer.timeouts.weight_sync)
        indices = self.round_prompts(round_index)
        rows, scores_all, accuracy_all, kept_prompts, judge_metrics = [], [], [], 0, []
        for first in range(0, len(indices), rft.generation_batch_size):
            chunk = indices[first:first + rft.generation_batch_size]
            batch = prompts_batch(self.prompts, chunk, self.pad_token_id)
            prompts = batch.pop(batch_keys=["input_ids", "attention_mask", "position_ids"]).repeat(rft.n, interleave=True)
            batch = batch.repeat(rft.n, interleave=True)
            prompts.meta_info["step"] = 1000 * (round_index + 1) + first  # seeds the sampling
            prompts.meta_info["update_follows"] = True
            batch = batch.union(self.actor_rollout.generate_sequences(prompts, _timeout=cfg.trainer.timeouts.rollout))
            texts = self.scorer.decode(batch)
            result, scores, _ = self.scorer.rule_and_model_scores(batch, texts)
            if self.judge is not None:
                scores = scores + cfg.reward.judge.weight * self.judge_scores(batch, texts, judge_metrics)
            scores = [float(s) for s in scores]
            scores_all += scores
            accuracy_all += validation_accuracy(result).tolist()
            for k in range(len(chunk)):
                group = range(k * rft.n, (k + 1) * rft.n)
                kept = self.keep(batch, [scores[i] for i in group], [texts[i] for i in group], k * rft.n)
                kept_prompts += bool(kept)
                rows += kept
        self.rows = rows
        self.round_metrics = {
            "rft/round": float(round_index + 1), "rft/kept_rows": float(len(rows)), "rft/kept_prompts": float(kept_prompts),
            "rft/sample_score_mean": float(np.mean(scores_all)), "rft/sample_accuracy": float(np.nanmean(accuracy_all)),
            "timing/rft_sampling": time.perf_counter() - start}
        if judge_metrics:  # per generation batch -> the round's means
            self.round_metrics.update({k: float(np.mean([m[k] for m in judge_metrics])) for k in judge_metrics[0]})
        self.round_index = round_index
        print(f"rft round {round_index + 1}: {len(indices)} prompts x {rft.n} samples, mean score "
              f"{self.round_metrics['rft/sample_score_mean']:.3f}; kept {len(rows)} rows from {kept_prompts} prompts "
              f"({self.round_metrics['timing/rft_sampling']:.0f}s)", flush=True)

    def judge_scores(self, batch, texts: list[str], judge_metrics: list) -> np.ndarray:
        """The judge's scores of the samples (parse failures: reward.judge.fallback_score, counted)."""
        nt = batch.non_tensor_batch
        result = self.judge.score([prompt_text(p) for p in nt["raw_prompt"]], texts, list(nt["ground_truth"]))
        judge_metrics.append(result.metrics())
        return result.scores

    def close(self) -> None:
        if getattr(self, "judge", None) is not None:
            self.judge.close()
        super().close()

    def keep(self, batch, scores: list[float], texts: list[str], offset: int) -> list[Example]:
        """This prompt's kept rows: select_kept's (sft), or the whole group when its best reaches min_score (rrhf)."""
        rft = self.cfg.rft
        if rft.loss == "rrhf":
            picked = list(range(len(scores))) if max(scores) >= rft.min_score else []
        else:
            picked = select_kept(scores, texts, rft.keep_top_k, rft.min_score)
        return [self.example(batch, offset + i, scores[i]) for i in picked]

    def example(self, batch, row: int, score: float) -> Example:
        """The sampled row as an SFT example: its prompt's real ids and the response ids under response_mask."""
        b = batch.batch
        prompt = b["input_ids"][row, :b["input_ids"].size(1) - b["responses"].size(1)]
        prompt_mask = b["attention_mask"][row, :prompt.numel()].bool()
        response = b["responses"][row][b["response_mask"][row].bool()]
        return Example(prompt[prompt_mask].tolist(), response.tolist(), "rollout", row, {"score": score})

    # ------------------------------------------------------------------ the loop's part
    def train_step(self, step: int) -> dict[str, float]:
        """One round: sample, keep, then rft.epochs passes of updates over the kept rows."""
        with self.clock.timed("rft_sampling"):
            self.sample_round(step - 1)
        metrics, outs = dict(self.round_metrics), []
        with self.clock.timed("update"):
            for number, batch in enumerate(self.round_batches(step - 1)):
                batch.meta_info["step"] = step * 1000 + number
                update = self.actor_rollout.update_dpo if self.cfg.rft.loss == "rrhf" else self.actor_rollout.update_sft
                outs.append(update(batch, _timeout=self.cfg.trainer.timeouts.update).meta_info["metrics"])
        for key in outs[0] if outs else []:
            metrics[key.replace("sft/", "rft/")] = float(np.mean([out[key] for out in outs]))
        metrics["rft/optimizer_steps"] = float(len(outs))
        return metrics

    def round_batches(self, round_index: int):
        """rft.epochs shuffled passes over this round's rows (rrhf: groups of n), rft.batch_size per batch."""
        rft = self.cfg.rft
        unit = rft.n if rft.loss == "rrhf" else 1
        units = len(self.rows) // unit
        rng = np.random.default_rng(self.cfg.data.seed + round_index)
        for _ in range(rft.epochs if units else 0):
            order = rng.permutation(units).tolist()
            for first in range(0, units, rft.batch_size):
                examples = [self.rows[p * unit + j] for p in order[first:first + rft.batch_size] for j in range(unit)]
                batch = collate_sft(examples, self.pad_token_id)
                if rft.loss == "rrhf":
                    batch.batch["rank_score"] = torch.tensor([e.extra["score"] for e in examples], dtype=torch.float32)
                yield batch

    def driver_state(self) -> dict:
        return {"kl_coef": None}  # a checkpoint lands after a round: nothing of it is left to resume

    def load_driver_state(self, state: dict) -> None:
        pass
