"""stage=rm: a scalar reward model trained with the Bradley-Terry loss, for `reward_model.path`.

    pairs = the pair files, or generate_pairs(prompts) with the policy (rlframe/pairs.py; then the
            policy's workers are shut down)
    for step in steps:
        rm_trainer.update_rm(collate(next pairs))   # -log s(r(x, y_w) - r(x, y_l) - margin)
    validate: accuracy / loss on the held-out pairs (every 10th pair)
    export: <run_dir>/hf_model, an HF sequence-classification folder (num_labels=1)

The rows are the texts the reward-model worker (workers/roles/reward_model.py) scores: its chat
template over the conversation (`rm_render`), so the trained model loads there unchanged:
`recipe=ppo_math reward_model.enable=true reward_model.path=<run_dir>/hf_model`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from rlframe.config import RLConfig
from rlframe.protocol import render_for_scoring
from rlframe.stages.common import StageTrainer
from rlframe.stages.data import collate_scored, load_scored_pairs
from rlframe.stages.dpo import PairSampler, needs_pair_generation
from rlframe.trainer.worker_settings import engine_settings
from rlframe.workers.roles.reward_trainer import RewardTrainerSettings, RewardTrainerWorker
from rlframe.workers.settings import ForwardSettings


def rm_render(tokenizer):
    """(prompt, reply) -> the text the reward-model worker scores (protocol.render_for_scoring)."""
    return lambda prompt, reply: render_for_scoring(tokenizer, prompt, reply)


def reward_trainer_settings(cfg: RLConfig, model_path: str) -> RewardTrainerSettings:
    """The reward model in training: actor.strategy's engine with its own section (megatron / deepspeed), offload
    and checkpoint format, a value head, actor.optim with rm.head_lr (worker_settings.engine_settings)."""
    return RewardTrainerSettings(engine=engine_settings(cfg, "reward", model_path), margin=cfg.rm.margin, seed=cfg.trainer.seed,
                                 forward=ForwardSettings(micro_batch_size=cfg.actor.log_prob_micro_batch_size_per_device))


class RewardModelTrainer(StageTrainer):
    main_role = "reward_trainer"  # the trained role: checkpoints save it as they save the actor

    @property
    def reward_trainer(self):
        return self.workers.actor_rollout

    def __init__(self, cfg: RLConfig, model_path: str, tokenizer, train_files: list[str], val_files: list[str],
                 run_dir: Path):
        super().__init__(cfg, model_path, tokenizer, run_dir)
        pair_files = train_files
        if needs_pair_generation(cfg, train_files):
            out = Path(cfg.dpo.pairs_file) if cfg.dpo.pairs_file else run_dir / "data" / "pairs.jsonl"
            if not out.exists():
                from rlframe.stages.pair_generation import generate_pairs

                sampler = PairSampler(cfg, model_path, tokenizer, run_dir)
                try:
                    self.setup_metrics = generate_pairs(sampler, sampler.prompt_set(train_files), out)
                finally:
                    sampler.close()
            pair_files = [str(out)]
        pairs = load_scored_pairs(pair_files, rm_render(tokenizer), tokenizer, prompt_key=cfg.data.prompt_key,
                                  chosen_key=cfg.dpo.chosen_key, rejected_key=cfg.dpo.rejected_key,
                                  max_length=cfg.rm.max_length, overlong=cfg.data.overlong, bad_rows=cfg.data.bad_rows)
        self.val_pairs = pairs[::10] if len(pairs) >= 20 else []
        self.train_pairs = [p for i, p in enumerate(pairs) if not (self.val_pairs and i % 10 == 0)]
        self.roles = {"reward_trainer": (RewardTrainerWorker, {"settings": reward_trainer_settings(cfg, model_path)})}
        self.start([])
        self.plan_steps(len(self.train_pairs), cfg.rm.batch_size, cfg.rm.epochs, "pairs")

    @property
    def val_every(self) -> int:
        return 0  # held-out pairs are scored before training and at the end

    def pair_batch(self, pairs):
        return collate_scored([ids for p in pairs for ids in (p.chosen_ids, p.rejected_ids)], self.pad_token_id)

    def train_step(self, step: int) -> dict[str, float]:
        batch = self.pair_batch([self.train_pairs[i] for i in next(self.batches)])
        batch.meta_info["step"] = step
        with self.clock.timed("update"):
            return dict(self.reward_trainer.update_rm(batch, _timeout=self.cfg.trainer.timeouts.update).meta_info["metrics"])

    def validate(self) -> dict[str, float]:
        """Held-out pairs: accuracy (chosen scored higher) and the Bradley-Terry loss."""
        if not self.val_pairs:
            return {}
        scores = torch.cat([self.reward_trainer.compute_scores(self.pair_batch(self.val_pairs[i:i + 32])).batch["rm_scores"]
                            for i in range(0, len(self.val_pairs), 32)])
        diff = scores[0::2] - scores[1::2]
        return {"val/rm_accuracy": float((diff > 0).float().mean()),
                "val/rm_loss": float(torch.nn.functional.softplus(-diff).mean()),
                "val/rm_margin": float(diff.mean())}

    def export_model(self, out: Path) -> None:
        self.reward_trainer.save_reward_model(str(out), self.pad_token_id)
        print(f"reward model (HF sequence classification, num_labels=1): {out}; use it with "
              f"reward_model.enable=true reward_model.path={out}", flush=True)


__all__ = ["RewardModelTrainer", "rm_render", "reward_trainer_settings"]
