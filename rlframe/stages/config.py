"""Typed configuration of the stages around RL (`stage: sft | dpo | rm`; `rl` is the RL loop).

Plain dataclasses with no project imports: `rlframe.config.RLConfig` holds one section of each, so
a recipe sets them like every other key (`sft.epochs=2`, `dpo.beta=0.2`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

STAGES = ("rl", "sft", "dpo", "rm")


@dataclass
class SFTConfig:
    """stage=sft (rlframe/stages/sft.py): supervised fine-tuning on prompt/response rows."""

    loss_on: str = "response"  # response: the reply tokens only | all: every token but the first
    epochs: int = 1
    batch_size: int = 16  # sequences per optimiser step, over all ranks
    micro_batch_size: int = 8  # sequences per forward/backward, per rank
    max_length: int = 256  # prompt + response tokens; longer rows: data.overlong
    response_key: str = "response"  # prompt + response rows
    messages_key: str = "messages"  # or whole conversations (the last message is the target)
    val_every: int = 0  # steps; 0: validation before and after training only


@dataclass
class PairGenerationConfig:
    """On-policy preference pairs (rlframe/pairs.py): n samples per prompt from the model with the
    rollout engine, scored by reward.functions; the best and the worst of a prompt become a pair when
    their scores differ by at least min_score_gap."""

    n: int = 4  # samples per prompt, at rollout.temperature
    prompts: int = 256  # training prompts to sample (0: all)
    min_score_gap: float = 0.05
    batch_size: int = 64  # prompts per generation call


@dataclass
class DPOConfig:
    """stage=dpo (rlframe/stages/dpo.py): preference optimisation on chosen/rejected pairs."""

    loss: str = "sigmoid"  # sigmoid (DPO) | ipo | simpo (reference-free); rlframe/algos/preference.py
    beta: float = 0.1
    gamma: float = 0.5  # simpo's target reward margin
    label_smoothing: float = 0.0  # sigmoid only: conservative DPO
    length_normalize: bool = False  # per-token mean log-probs (LN-DPO; SimPO wants true)
    epochs: int = 1
    batch_size: int = 8  # pairs per optimiser step, over all ranks
    max_length: int = 256  # prompt + the longer reply, in tokens; longer pairs: data.overlong
    chosen_key: str = "chosen"
    rejected_key: str = "rejected"
    val_every: int = 0
    # data.source=arithmetic (or pairs.generate=true): pairs from the model's own samples first.
    pairs_file: Optional[str] = None  # where generated pairs are written (default: <run_dir>/data/pairs.jsonl)


@dataclass
class RewardTrainingConfig:
    """stage=rm (rlframe/stages/reward_model.py): a scalar reward model trained with the
    Bradley-Terry loss on chosen/rejected pairs (the dpo section's keys and pair generation)."""

    epochs: int = 1
    batch_size: int = 8  # pairs per optimiser step, over all ranks
    max_length: int = 256
    margin: float = 0.0
    head_lr: Optional[float] = None  # the score head's LR (it starts at zero); null: actor.optim.lr
