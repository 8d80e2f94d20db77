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

import time
from pathlib import Path

import torch

from rlframe.config import RLConfig
from rlframe.stages.common import StageTrainer
from rlframe.stages.data import collate_scored, load_scored_pairs
from rlframe.stages.dpo import PairSampler, needs_pair_generation
from rlframe.trainer import checkpoint
from rlframe.trainer.worker_settings import deepspeed_settings, device_request, optim_settings
from rlframe.workers.roles.reward_model import _as_messages
from rlframe.workers.roles.reward_trainer import RewardTrainerSettings, RewardTrainerWorker
from rlframe.workers.settings import EngineSettings, ForwardSettings


def rm_render(tokenizer):
    """(prompt, reply) -> the text the reward-model worker scores (RewardModelWorker.render)."""
    def render(prompt, reply: str) -> str:
        if getattr(tokenizer, "chat_template", None):
            return tokenizer.apply_chat_template(_as_messages(prompt) + [{"role": "assistant", "content": reply}],
                                                 tokenize=False)
        if not isinstance(prompt, str):
            prompt = "\n".join(m["content"] for m in _as_messages(prompt))
        return prompt + reply
    return render


def reward_trainer_settings(cfg: RLConfig, model_path: str) -> RewardTrainerSettings:
    engine = EngineSettings(model_path=model_path, strategy=cfg.actor.strategy, head="value", device=device_request(cfg),
                            gradient_checkpointing=cfg.model.gradient_checkpointing,
                            trust_remote_code=cfg.model.trust_remote_code, deepspeed=deepspeed_settings(cfg),
                            optim=optim_settings(cfg.actor.optim, cfg, head_lr=cfg.rm.head_lr))
    return RewardTrainerSettings(engine=engine, margin=cfg.rm.margin, seed=cfg.trainer.seed,
                                 forward=ForwardSettings(micro_batch_size=cfg.actor.log_prob_micro_batch_size_per_device))


class RewardModelTrainer(StageTrainer):
    def __init__(self, cfg: RLConfig, model_path: str, tokenizer, train_files: list[str], val_files: list[str],
                 run_dir: Path):
        pair_files = train_files
        self.pair_stats: dict[str, float] = {}
        if needs_pair_generation(cfg, train_files):
            out = Path(cfg.dpo.pairs_file) if cfg.dpo.pairs_file else run_dir / "data" / "pairs.jsonl"
            if not out.exists():
                from rlframe.stages.pairs import generate_pairs

                sampler = PairSampler(cfg, model_path, tokenizer, run_dir)
                try:
                    self.pair_stats = generate_pairs(sampler, sampler.prompt_set(train_files), out)
                finally:
                    sampler.close()
            pair_files = [str(out)]
        pairs = load_scored_pairs(pair_files, rm_render(tokenizer), tokenizer, prompt_key=cfg.data.prompt_key,
                                  chosen_key=cfg.dpo.chosen_key, rejected_key=cfg.dpo.rejected_key,
                                  max_length=cfg.rm.max_length, overlong=cfg.data.overlong, bad_rows=cfg.data.bad_rows)
        self.val_pairs = pairs[::10] if len(pairs) >= 20 else []
        self.train_pairs = [p for i, p in enumerate(pairs) if not (self.val_pairs and i % 10 == 0)]
        self.roles = {"reward_trainer": (RewardTrainerWorker, {"settings": reward_trainer_settings(cfg, model_path)})}
        self.setup(cfg, model_path, tokenizer, [], run_dir)
        self.plan_steps(len(self.train_pairs), cfg.rm.batch_size, cfg.rm.epochs, "pairs")

    def _start_workers(self) -> None:
        from rlframe.stages.common import start_stage_workers

        with self.timed("init_workers"):
            self.workers = start_stage_workers(self.cfg, self.roles, main_role="reward_trainer")

    def pair_batch(self, pairs):
        return collate_scored([ids for p in pairs for ids in (p.chosen_ids, p.rejected_ids)], self.pad_token_id)

    def validate(self) -> dict[str, float]:
        """Held-out pairs: accuracy (chosen scored higher) and the Bradley-Terry loss."""
        if not self.val_pairs:
            return {}
        scores = torch.cat([self.actor_rollout.compute_scores(self.pair_batch(self.val_pairs[i:i + 32])).batch["rm_scores"]
                            for i in range(0, len(self.val_pairs), 32)])
        diff = scores[0::2] - scores[1::2]
        return {"val/rm_accuracy": float((diff > 0).float().mean()),
                "val/rm_loss": float(torch.nn.functional.softplus(-diff).mean()),
                "val/rm_margin": float(diff.mean())}

    def train(self, start_step: int) -> dict:
        cfg = self.cfg
        if start_step == 0 and cfg.trainer.val_before_train:
            self.first_val = {**self.validate(), **self.pair_stats}
            self.tracker.log(0, self.first_val)
        for step in range(start_step + 1, cfg.trainer.total_steps + 1):
            self.step, self.phase_times = step, {}
            step_start = time.perf_counter()
            batch = self.pair_batch([self.train_pairs[i] for i in next(self.batches)])
            batch.meta_info["step"] = step
            with self.timed("update"):
                metrics = dict(self.actor_rollout.update_rm(batch, _timeout=cfg.trainer.timeouts.update).meta_info["metrics"])
            if step == cfg.trainer.total_steps and cfg.trainer.val_at_end:
                metrics.update(self.validate())
            metrics["timing/step"] = time.perf_counter() - step_start
            self.tracker.log(step, metrics)
            self.last_metrics = metrics
            if checkpoint.should_save(step, cfg.trainer.total_steps, cfg.trainer.save_every):
                self.save_checkpoint(step)
        summary = self.finish(export=False)
        if cfg.trainer.export_hf:
            out = self.run_dir / "hf_model"
            self.actor_rollout.save_reward_model(str(out), self.pad_token_id)
            summary["hf_model"] = str(out)
            print(f"reward model (HF sequence classification, num_labels=1): {out}; use it with "
                  f"reward_model.enable=true reward_model.path={out}", flush=True)
        return summary


__all__ = ["RewardModelTrainer", "rm_render", "reward_trainer_settings"]
