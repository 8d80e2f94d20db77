"""What the stage drivers share: starting their workers, and the RL driver's validation and scoring.

A stage driver is an `RLTrainer` with its own data and update step: it keeps the RL driver's
validation (greedy generation scored by reward.functions: val/reward_mean, val/accuracy), its
checkpoint / resume / export and its tracker, and builds those here without the RL loop's state.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from rlframe.config import RLConfig, to_container
from rlframe.controller import WorkerGroup, process_group_backend
from rlframe.controller.cluster import check_cluster, list_nodes
from rlframe.controller.placement import make_pool
from rlframe.data.dataset import RLDataset, collate_prompts
from rlframe.data.files import DatasetError
from rlframe.data.sampler import StatefulSampler
from rlframe.protocol import DataProto
from rlframe.reward.manager import RewardManager, RewardSpec
from rlframe.trainer import checkpoint
from rlframe.trainer.launch import Workers, cluster_request, describe_placement, plan_placement
from rlframe.trainer.rl_trainer import RLTrainer
from rlframe.trainer.tracking import Tracker


def start_stage_workers(cfg: RLConfig, roles: dict, main_role: str = "actor_rollout") -> Workers:
    """One colocated group of actor.world_size ranks hosting `roles` ({name: (class, kwargs)})."""
    start = time.perf_counter()
    nodes = list_nodes()
    request = cluster_request(cfg, nodes)
    chosen = check_cluster(request, nodes)
    plans = plan_placement(cfg)
    pools = [make_pool(plans[0], request, chosen)]
    try:
        group = WorkerGroup(pools[0], roles, backend=process_group_backend(bool(request.gpus)), name=plans[0].name,
                            default_timeout_s=cfg.trainer.timeouts.init)
    except BaseException:
        pools[0].remove()
        raise
    workers = Workers([group], pools, actor_rollout=group.role(main_role),
                      ref=group.role("ref") if "ref" in roles else None,
                      placement=describe_placement(plans, [group], chosen))
    print(f"workers: stage={cfg.stage}, {cfg.actor.world_size} x {'+'.join(roles)} "
          f"in {time.perf_counter() - start:.1f}s", flush=True)
    return workers


def reward_manager(cfg: RLConfig) -> RewardManager:
    return RewardManager(
        [RewardSpec(path=f.path, name=f.name, weight=f.weight, data_sources=f.data_sources, kwargs=dict(f.kwargs),
                    reward_type=f.reward_type) for f in cfg.reward.functions],
        num_workers=cfg.reward.num_workers, timeout_s=cfg.reward.timeout_s, batch_timeout_s=cfg.reward.batch_timeout_s,
        fallback_score=cfg.reward.fallback_score, fail_fast=cfg.reward.fail_fast)


def prompt_dataset(cfg: RLConfig, files: list[str], tokenizer) -> RLDataset | None:
    """The prompts (+ ground truth) of `files` for generation; None when they have no ground truth."""
    if not files or not cfg.reward.functions:
        return None
    data = cfg.data
    try:
        return RLDataset(files, tokenizer, prompt_key=data.prompt_key, answer_key=data.answer_key,
                         prompt_template=data.prompt_template, max_prompt_length=data.max_prompt_length,
                         overlong="filter", bad_rows="skip")
    except DatasetError as error:
        print(f"note: no generation on {files} (val/reward_mean, val/accuracy): {error}", flush=True)
        return None


class StageTrainer(RLTrainer):
    """The RL driver's validation, scoring, checkpoints and export, around a stage's own `train`.

    Subclasses set `self.roles` (the worker roles), call `setup`, then `plan_steps` once they know their rows.
    """

    def setup(self, cfg: RLConfig, model_path: str, tokenizer, val_files: list[str], run_dir: Path) -> None:
        """Validation prompts, rewards and the workers (`self.roles`); then `plan_steps`."""
        # (no RLTrainer.__init__: the prompt sampler, KL controller and algorithm plugins are RL's)
        self.cfg, self.model_path, self.tokenizer, self.run_dir = cfg, model_path, tokenizer, run_dir
        self.phase_times: dict[str, float] = {}
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.val_set = prompt_dataset(cfg, val_files, tokenizer)
        self.rewards = reward_manager(cfg)
        self.kl_ctrl = None
        self.step, self.first_val, self.last_metrics = 0, {}, {}
        self._start_workers()

    def plan_steps(self, num_rows: int, batch_size: int, epochs: int, unit: str) -> None:
        """epochs x (num_rows // batch_size) steps; the checkpointable sampler; the tracker; resume."""
        cfg = self.cfg
        steps_per_epoch = num_rows // batch_size
        if steps_per_epoch < 1:
            raise ValueError(f"{num_rows} {unit} cannot fill one batch of {batch_size} ({cfg.stage}.batch_size). "
                             f"Fix: a smaller {cfg.stage}.batch_size or more data")
        cfg.trainer.total_steps = epochs * steps_per_epoch
        self.sampler = StatefulSampler(num_rows, batch_size, shuffle=cfg.data.shuffle, seed=cfg.data.seed)
        self.batches = self.sampler.forever()
        self.resume_from = checkpoint.resolve_resume(cfg.trainer.resume, self.run_dir)
        if self.resume_from is not None:
            checkpoint.trim_metrics_log(self.run_dir, self.resume_from.step)
        self.tracker = Tracker(self.run_dir, list(cfg.trainer.loggers), cfg.trainer.project_name,
                               cfg.trainer.experiment_name, to_container(cfg), total_steps=cfg.trainer.total_steps)
        print(f"{cfg.stage}: {num_rows} {unit}, {epochs} epoch(s) x {steps_per_epoch} steps of {batch_size}", flush=True)

    def _start_workers(self) -> None:
        with self.timed("init_workers"):
            self.workers = start_stage_workers(self.cfg, self.roles)

    def validate(self) -> dict[str, float]:
        """The RL driver's generation validation (when the validation prompts have ground truth)."""
        if self.val_set is None:
            return {}
        with self.timed("weight_sync"):
            self.actor_rollout.sync_weights(_timeout=self.cfg.trainer.timeouts.weight_sync)
        return super().validate()

    def finish(self, export: bool = True) -> dict:
        summary = {"run_dir": str(self.run_dir), "val_before": self.first_val, "val_after": {
            k: v for k, v in self.last_metrics.items() if k.startswith("val/")}}
        if export and self.cfg.trainer.export_hf:
            export_dir = self.run_dir / "hf_model"
            self.actor_rollout.save_hf(str(export_dir))
            summary["hf_model"] = str(export_dir)
        import json

        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary


def prompts_batch(dataset: RLDataset, indices: list[int], pad_token_id: int) -> DataProto:
    batch = collate_prompts([dataset[i] for i in indices], pad_token_id)
    batch.non_tensor_batch["uid"] = np.array([str(i) for i in indices], dtype=object)
    return batch
