"""stage=sft: supervised fine-tuning on the same workers as RL.

    for step in steps:
        batch = collate_sft(next examples)          # left-padded prompts, right-padded replies, loss mask
        actor_rollout.update_sft(batch)             # -sum m log p / tokens; the engine's update loop
    validate: val/loss (NLL of the validation replies) + the RL driver's generation validation
    export: <run_dir>/hf_model, which RL recipes take as model.path

On the embedded default (data.source=arithmetic) the project writes the worked solutions of its own
arithmetic problems (`worked_solution`), so `recipe=sft_math` needs no data at all.
"""

from __future__ import annotations

import re
import time
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from rlframe.config import RLConfig
from rlframe.data.dataset import read_rows
from rlframe.stages.common import StageTrainer
from rlframe.stages.data import collate_sft, load_sft_examples
from rlframe.trainer.worker_settings import actor_settings
from rlframe.workers.roles.policy_trainer import PolicyTrainerWorker
from rlframe.workers.settings import ActorSettings, UpdateLoop


def worked_solution(question: str, answer: int | str) -> str:
    """A short worked solution of an arithmetic problem (rlframe/data/arithmetic.py) in the format
    its reward asks for: the two operands are the question's two numbers; + or - is whichever gives
    the answer."""
    a, b = (int(x) for x in re.findall(r"\d+", question)[:2])
    answer = int(answer)
    op, verb = ("+", "add") if a + b == answer else ("-", "subtract")
    return f"We {verb} {b} {'to' if op == '+' else 'from'} {a}: {a} {op} {b} = {answer}. The answer is \\boxed{{{answer}}}."


def write_arithmetic_sft_data(train_file: str, val_file: str, out_dir: Path) -> tuple[list[str], list[str]]:
    """The arithmetic train/val parquet files + a `response` column with the worked solutions."""
    out = []
    for src, name in ((train_file, "sft_train.parquet"), (val_file, "sft_val.parquet")):
        rows = read_rows(src)
        for row in rows:
            row["response"] = worked_solution(row["extra_info"]["question"], row["reward_model"]["ground_truth"])
        path = out_dir / name
        pq.write_table(pa.Table.from_pylist(rows), path)
        out.append([str(path)])
    return out[0], out[1]


def sft_settings(cfg: RLConfig, model_path: str) -> ActorSettings:
    """The actor's settings with the SFT update loop (sft.batch_size sequences per step over all ranks)."""
    sft = cfg.sft
    loop = UpdateLoop(mini_batch_size=sft.batch_size // cfg.actor.world_size, micro_batch_size=sft.micro_batch_size,
                      epochs=1, shuffle=True, loss_agg_mode="token-mean")
    return replace(actor_settings(cfg, model_path, with_rollout=True), loop=loop)


class SFTTrainer(StageTrainer):
    def __init__(self, cfg: RLConfig, model_path: str, tokenizer, train_files: list[str], val_files: list[str],
                 run_dir: Path):
        super().__init__(cfg, model_path, tokenizer, run_dir)
        if cfg.data.source == "arithmetic":  # the project writes the worked solutions of its own problems
            train_files, val_files = write_arithmetic_sft_data(train_files[0], val_files[0], run_dir / "data")
        sft = cfg.sft
        kwargs = dict(prompt_key=cfg.data.prompt_key, response_key=sft.response_key, messages_key=sft.messages_key,
                      max_length=sft.max_length, overlong=cfg.data.overlong, bad_rows=cfg.data.bad_rows)
        self.train_examples = load_sft_examples(train_files, tokenizer, **kwargs)
        self.val_examples = load_sft_examples(val_files, tokenizer, **kwargs) if val_files else []
        if cfg.data.val_max_samples:
            self.val_examples = self.val_examples[:cfg.data.val_max_samples]
        if len(self.train_examples) < sft.batch_size:
            raise ValueError(f"{len(self.train_examples)} SFT rows cannot fill one batch of sft.batch_size="
                             f"{sft.batch_size}. Fix: a smaller sft.batch_size or more data")
        self.roles = {"actor_rollout": (PolicyTrainerWorker, {"settings": sft_settings(cfg, model_path)})}
        print(f"SFT: {len(self.train_examples)} training rows, {len(self.val_examples)} validation rows; "
              f"loss on {sft.loss_on} tokens", flush=True)
        self.start(val_files)
        self.plan_steps(len(self.train_examples), sft.batch_size, sft.epochs, "training rows")

    @property
    def val_every(self) -> int:
        return self.cfg.sft.val_every

    def train_step(self, step: int) -> dict[str, float]:
        cfg = self.cfg
        batch = collate_sft([self.train_examples[i] for i in next(self.batches)], self.pad_token_id, cfg.sft.loss_on)
        batch.meta_info["step"] = step
        with self.clock.timed("update"):
            metrics = dict(self.actor_rollout.update_sft(batch, _timeout=cfg.trainer.timeouts.update).meta_info["metrics"])
        metrics["sft/loss_tokens"] = float(batch.batch["response_mask"].sum())
        metrics["sft/epoch"] = float(self.sampler.state_dict()["epoch"])
        return metrics

    def validate(self) -> dict[str, float]:
        """The generation validation, and val/loss on the validation replies."""
        metrics = super().validate()
        if self.val_examples:
            start = time.perf_counter()
            metrics["val/loss"] = self.validation_loss()
            metrics["timing/validation_loss"] = time.perf_counter() - start
        return metrics

    def validation_loss(self) -> float:
        """Mean NLL per loss-mask token over the validation rows."""
        nll = tokens = 0.0
        for start in range(0, len(self.val_examples), 64):
            batch = collate_sft(self.val_examples[start:start + 64], self.pad_token_id, self.cfg.sft.loss_on)
            out = self.actor_rollout.compute_nll(batch, _timeout=self.cfg.trainer.timeouts.log_prob)
            nll += float(out.batch["nll_sum"].sum())
            tokens += float(out.batch["nll_tokens"].sum())
        return nll / max(tokens, 1.0)
