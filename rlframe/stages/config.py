"""Typed configuration of the stages around RL (`stage: pt | sft | dpo | rm | rft`; `rl` is the RL loop).

Plain dataclasses (their bounds declared beside the fields, rlframe/bounds.py: its only project import):
`rlframe.config.RLConfig` holds one section of each, so a recipe sets them like every other key
(`sft.epochs=2`, `dpo.beta=0.2`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from rlframe.bounds import bounded, one_of

STAGES = ("rl", "pt", "sft", "dpo", "rm", "rft")


@dataclass
class SFTConfig:
    """stage=sft (rlframe/stages/sft.py): supervised fine-tuning on prompt/response rows."""

    loss_on: str = one_of("response", ("response", "all"))  # response: the reply tokens only | all: every token but the first
    epochs: int = bounded(1, ">= 1")  # passes over the training rows (trainer.total_steps caps the optimiser steps)
    batch_size: int = bounded(16, ">= 1")  # sequences per optimiser step, over all ranks
    micro_batch_size: int = bounded(8, ">= 1")  # sequences per forward/backward, per rank
    max_length: int = bounded(256, ">= 2")  # prompt + response tokens; longer rows: data.overlong
    response_key: str = "response"  # prompt + response rows
    messages_key: str = "messages"  # or whole conversations (the last message is the target)
    val_every: int = bounded(0, ">= 0")  # steps; 0: validation before and after training only


@dataclass
class PairGenerationConfig:
    """On-policy preference pairs (rlframe/pairs.py): n samples per prompt from the model with the
    rollout engine, scored by reward.functions; the best and the worst of a prompt become a pair when
    their scores differ by at least min_score_gap."""

    n: int = bounded(4, ">= 2", "a pair needs two samples")  # samples per prompt, at rollout.temperature
    prompts: int = bounded(256, ">= 0", "0: all")  # training prompts to sample (0: all)
    # a prompt's best and worst become a pair only when their scores differ by this much
    min_score_gap: float = bounded(0.05, ">= 0")
    batch_size: int = bounded(64, ">= 1")  # prompts per generation call


@dataclass
class DPOConfig:
    """stage=dpo (rlframe/stages/dpo.py): preference optimisation on chosen/rejected pairs."""

    loss: str = "sigmoid"  # sigmoid (DPO) | ipo | simpo | orpo (reference-free) | kto (unpaired rows); rlframe/algos/preference.py
    beta: float = bounded(0.1, "> 0")  # orpo: the odds-ratio term's weight (lambda)
    gamma: float = bounded(0.5, "finite")  # simpo's target reward margin
    label_smoothing: float = bounded(0.0, "[0, 0.5)")  # sigmoid only: conservative DPO
    length_normalize: bool = False  # per-token mean log-probs (LN-DPO; SimPO wants true)
    epochs: int = bounded(1, ">= 1")  # passes over the pairs (trainer.total_steps caps the optimiser steps)
    batch_size: int = bounded(8, ">= 1")  # pairs per optimiser step, over all ranks
    max_length: int = bounded(256, ">= 2")  # prompt + the longer reply, in tokens; longer pairs: data.overlong
    chosen_key: str = "chosen"  # the preferred reply's column
    rejected_key: str = "rejected"  # the dispreferred reply's column
    # kto: unpaired rows {prompt, completion, label (true: desirable)}; pair rows are split into one of each
    completion_key: str = "completion"
    label_key: str = "label"  # kto: the column saying whether the completion is desirable
    desirable_weight: float = bounded(1.0, "> 0")  # kto: w_D
    undesirable_weight: float = bounded(1.0, "> 0")  # kto: w_U
    val_every: int = bounded(0, ">= 0")  # steps; 0: validation before and after training only
    # data.source=arithmetic (or pairs.generate=true): pairs from the model's own samples first.
    pairs_file: Optional[str] = None  # where generated pairs are written (default: <run_dir>/data/pairs.jsonl)


@dataclass
class RewardTrainingConfig:
    """stage=rm (rlframe/stages/reward_model.py): a scalar reward model trained with the
    Bradley-Terry loss on chosen/rejected pairs (the dpo section's keys and pair generation)."""

    epochs: int = bounded(1, ">= 1")  # passes over the pairs (trainer.total_steps caps the optimiser steps)
    batch_size: int = bounded(8, ">= 1")  # pairs per optimiser step, over all ranks
    max_length: int = bounded(256, ">= 2")  # prompt + reply tokens scored; longer pairs: data.overlong
    margin: float = bounded(0.0, "finite")  # the Bradley-Terry loss wants chosen - rejected above this margin
    head_lr: Optional[float] = bounded(None, "> 0")  # the score head's LR (it starts at zero); null: actor.optim.lr


@dataclass
class PretrainConfig:
    """stage=pt (rlframe/stages/pt.py): continued pre-training, next-token prediction on raw text.

    The documents (txt: one per blank-line-separated block; jsonl / parquet: the `text_key` column) are
    tokenised, each ended with EOS, and packed back to back into rows of `max_length` tokens; attention
    stays inside each document (the packed forward); the loss is on every token that has its document's
    context (all but each document's first). Validation: the held-out perplexity, exp(val/loss)."""

    text_key: str = "text"  # jsonl / parquet: the column holding each document's text
    max_length: int = 256  # tokens per packed row
    epochs: int = 1  # passes over the packed rows (trainer.total_steps caps the optimiser steps)
    batch_size: int = 8  # packed rows per optimiser step, over all ranks
    micro_batch_size: int = 4  # rows per forward/backward, per rank
    val_fraction: float = 0.1  # documents held out when no data.val_files are given
    val_every: int = 0  # steps; 0: validation before and after training only
    # data.source=text: the text set the project generates (rlframe/stages/pt_data.py: generated_corpus)
    generated_documents: int = 400


@dataclass
class RFTConfig:
    """stage=rft (rlframe/stages/rft.py): rejection-sampling fine-tuning (RAFT / ReST / STaR-style).

    One step of the run is one round: `n` samples per prompt for the next `prompts_per_round` training
    prompts with the rollout engine, scored by reward.functions; the `keep_top_k` best of each prompt whose
    score is at least `min_score` become SFT rows (identical replies kept once); then `epochs` shuffled
    passes of SFT updates over that round's rows, `batch_size` rows per optimiser step. loss=rrhf trains on
    whole groups instead: the n samples of each prompt whose best reaches min_score (the rank loss + the
    best's NLL), `batch_size` groups per step."""

    rounds: int = 4  # sample-filter-train rounds; one round is one step of the run
    n: int = 8  # samples per prompt, at rollout.temperature
    prompts_per_round: int = 64  # training prompts sampled per round
    keep_top_k: int = 1  # per prompt, among those >= min_score (0: all above min_score)
    min_score: float = 1.0  # a sample is kept only with at least this score
    loss: str = "sft"  # sft: NLL of the kept replies | rrhf: ranking loss over all n + NLL of the best
    epochs: int = 2  # passes over one round's rows
    batch_size: int = 8  # rows per optimiser step (rrhf: groups of n rows), over all ranks
    micro_batch_size: int = 8  # rows per forward/backward, per rank
    generation_batch_size: int = 64  # prompts per generation call
