"""stage=dpo: DPO and its relatives (IPO, SimPO, ORPO, KTO, length-normalised) on the same workers as RL.

    pairs  = the pair files, or generate_pairs(prompts) (stages/pair_generation.py: the policy's own samples)
    ref    = ref.compute_ref_log_prob(all pairs)      # once, by the reference role (not for simpo)
    for step in steps:
        batch = collate_pairs(next pairs) + ref_logps # rows 2i chosen, 2i+1 rejected
        actor_rollout.update_dpo(batch)               # rlframe/algos/preference.py through the engine
    validate: the RL driver's generation validation (val/reward_mean, val/accuracy)
    export: <run_dir>/hf_model

dpo.loss=kto trains on unpaired rows instead (stages/unpaired_data.py: prompt, completion, label; a pair is
one desirable and one undesirable row): rows, not pairs, in the batch and the reference pass.

Metrics: dpo/loss, dpo/rewards_chosen / rewards_rejected (beta * (pi - ref)), dpo/reward_accuracy,
dpo/reward_margin, dpo/logps_chosen / logps_rejected.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import torch

from rlframe.algos.preference import ALWAYS_LENGTH_NORMALISED, REFERENCE_FREE, sequence_log_probs
from rlframe.config import RLConfig
from rlframe.data.dataset import RLDataset, read_rows
from rlframe.stages.pair_generation import generate_pairs
from rlframe.stages.common import StageTrainer
from rlframe.stages.data import collate_pairs, collate_sft, load_pairs
from rlframe.stages.unpaired_data import load_unpaired
from rlframe.trainer.worker_settings import actor_settings, engine_settings
from rlframe.workers.roles.policy_trainer import PolicyTrainerWorker, PreferenceSettings
from rlframe.workers.roles.ref import RefWorker
from rlframe.workers.settings import ActorSettings, ForwardSettings, RefSettings, UpdateLoop

REF_CHUNK_PAIRS = 32


def policy_settings(cfg: RLConfig, model_path: str) -> ActorSettings:
    """The actor with its rollout engine (pair sampling, validation); the update loop is set per step."""
    return replace(actor_settings(cfg, model_path, with_rollout=True), loop=UpdateLoop(loss_agg_mode="token-mean"))


def preference_settings(cfg: RLConfig) -> PreferenceSettings:
    """dpo.* -> the objective's settings; orpo always compares per-token mean log-probs (its odds are of them)."""
    d = cfg.dpo
    kto = {"desirable_weight": d.desirable_weight, "undesirable_weight": d.undesirable_weight} if d.loss == "kto" else {}
    return PreferenceSettings(loss_type=d.loss, beta=d.beta, gamma=d.gamma, label_smoothing=d.label_smoothing,
                              length_normalize=d.length_normalize or d.loss in ALWAYS_LENGTH_NORMALISED, **kto)


def reference_settings(cfg: RLConfig, model_path: str) -> RefSettings:
    """The frozen initial policy; log-probs at temperature 1 (the likelihood DPO compares)."""
    return RefSettings(engine=engine_settings(cfg, "ref", model_path),
                       log_prob=ForwardSettings(micro_batch_size=cfg.actor.log_prob_micro_batch_size_per_device))


def needs_pair_generation(cfg: RLConfig, train_files: list[str]) -> bool:
    """Prompt data (the arithmetic default, or files without the chosen column): sample pairs first."""
    if cfg.data.source == "arithmetic":
        return True
    rows = read_rows(train_files[0])
    return bool(rows) and cfg.dpo.chosen_key not in rows[0] and cfg.dpo.completion_key not in rows[0]


def pair_prompts(cfg: RLConfig, tokenizer, files: list[str]) -> RLDataset:
    """The prompts (+ ground truth) that pairs are sampled for."""
    data = cfg.data
    return RLDataset(files, tokenizer, prompt_key=data.prompt_key, answer_key=data.answer_key,
                     prompt_template=data.prompt_template, max_prompt_length=data.max_prompt_length,
                     overlong=data.overlong, bad_rows=data.bad_rows)


class PairSampler(StageTrainer):
    """The policy with its rollout engine and the reward functions, for `rlframe.pairs` alone."""

    def __init__(self, cfg: RLConfig, model_path: str, tokenizer, run_dir: Path):
        super().__init__(cfg, model_path, tokenizer, run_dir)
        self.roles = {"actor_rollout": (PolicyTrainerWorker, {"settings": policy_settings(cfg, model_path)})}
        self.start([])

    def prompt_set(self, files: list[str]) -> RLDataset:
        return pair_prompts(self.cfg, self.tokenizer, files)


class DPOTrainer(StageTrainer):
    def __init__(self, cfg: RLConfig, model_path: str, tokenizer, train_files: list[str], val_files: list[str],
                 run_dir: Path):
        super().__init__(cfg, model_path, tokenizer, run_dir)
        d = cfg.dpo
        self.reference_free = d.loss in REFERENCE_FREE
        self.roles = {"actor_rollout": (PolicyTrainerWorker, {"settings": policy_settings(cfg, model_path),
                                                              "preference": preference_settings(cfg)})}
        if not self.reference_free:
            self.roles["ref"] = (RefWorker, {"settings": reference_settings(cfg, model_path)})
        self.start(val_files)
        pair_files = train_files
        if needs_pair_generation(cfg, train_files):
            out = Path(d.pairs_file) if d.pairs_file else run_dir / "data" / "pairs.jsonl"
            if out.exists():  # a resumed run trains on the pairs it drew first
                print(f"pairs: reusing {out}", flush=True)
            else:
                self.setup_metrics = generate_pairs(self, pair_prompts(cfg, tokenizer, train_files), out)
            pair_files = [str(out)]
        self.unpaired = d.loss == "kto"
        keys = dict(prompt_key=cfg.data.prompt_key, chosen_key=d.chosen_key, rejected_key=d.rejected_key,
                    max_length=d.max_length, overlong=cfg.data.overlong, bad_rows=cfg.data.bad_rows)
        if self.unpaired:  # kto: one reply per row; pairs become a desirable and an undesirable row
            self.pairs = load_unpaired(pair_files, tokenizer, completion_key=d.completion_key, label_key=d.label_key, **keys)
            good = sum(e.extra["label"] for e in self.pairs)
            print(f"kto: {len(self.pairs)} rows, {good} desirable, {len(self.pairs) - good} undesirable", flush=True)
        else:
            self.pairs = load_pairs(pair_files, tokenizer, **keys)
        self.ref_logps = None if self.reference_free else self.reference_log_probs()
        self.plan_steps(len(self.pairs), d.batch_size, d.epochs, "rows" if self.unpaired else "pairs")

    @property
    def val_every(self) -> int:
        return self.cfg.dpo.val_every

    def collate(self, items: list):
        """Pairs: rows 2i chosen, 2i + 1 rejected; kto: one row per example, with its kto_label."""
        if not self.unpaired:
            return collate_pairs(items, self.pad_token_id)
        batch = collate_sft(items, self.pad_token_id)
        batch.batch["kto_label"] = torch.tensor([float(e.extra["label"]) for e in items])
        return batch

    def reference_log_probs(self) -> torch.Tensor:
        """[2 x pairs] (kto: [rows]): the reference's sequence log-probs of every reply, once."""
        start, parts = time.perf_counter(), []
        for first in range(0, len(self.pairs), REF_CHUNK_PAIRS):
            batch = self.collate(self.pairs[first:first + REF_CHUNK_PAIRS])
            token_lp = self.ref.compute_ref_log_prob(batch, _timeout=self.cfg.trainer.timeouts.log_prob).batch["ref_log_prob"]
            parts.append(sequence_log_probs(token_lp, batch.batch["response_mask"], self.cfg.dpo.length_normalize))
        self.setup_metrics["timing/ref_log_prob"] = time.perf_counter() - start
        return torch.cat(parts)

    def pair_batch(self, indices: list[int]):
        batch = self.collate([self.pairs[i] for i in indices])
        if self.ref_logps is not None:
            rows = torch.tensor(indices if self.unpaired else [2 * i + side for i in indices for side in (0, 1)])
            batch.batch["ref_logps"] = self.ref_logps[rows]
        return batch

    def train_step(self, step: int) -> dict[str, float]:
        batch = self.pair_batch(next(self.batches))
        batch.meta_info["step"] = step
        with self.clock.timed("update"):
            return dict(self.actor_rollout.update_dpo(batch, _timeout=self.cfg.trainer.timeouts.update).meta_info["metrics"])
