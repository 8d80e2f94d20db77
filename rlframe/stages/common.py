"""What the stage drivers (SFT, DPO, RM) share: starting their workers, and validation by generation.

A stage driver is the shared run loop (rlframe/trainer/run_loop.py: steps, validation cadence, metrics,
checkpoints, restarts, export) with its own data and `train_step`; it validates as the RL driver does
(greedy generation scored by reward.functions: val/reward_mean, val/accuracy) when its validation prompts
have ground truth.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from rlframe.config import RLConfig
from rlframe.controller import WorkerGroup, process_group_backend
from rlframe.controller.cluster import check_cluster, list_nodes
from rlframe.controller.placement import make_pool
from rlframe.data.dataset import RLDataset, collate_prompts
from rlframe.data.files import DatasetError
from rlframe.data.sampler import StatefulSampler
from rlframe.protocol import DataProto
from rlframe.trainer.launch import Workers, cluster_request, describe_placement, plan_placement
from rlframe.trainer.run_loop import RunLoop
from rlframe.trainer.scorer import Scorer


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


def capped_steps(cfg: RLConfig, planned: int, how: str, more_key: str) -> int:
    """A stage's step count: `planned` (its epochs' or rounds' steps, `how` says which), capped by trainer.total_steps
    when that is set (0, the stage recipes' value: no cap). One note when the two differ."""
    cap = cfg.trainer.total_steps
    if cap <= 0 or cap == planned:
        return planned
    if cap < planned:
        print(f"note: trainer.total_steps={cap} caps {cfg.stage}'s {planned} steps ({how}); "
              "trainer.total_steps=0 runs them all", flush=True)
        return cap
    print(f"note: trainer.total_steps={cap}, but {cfg.stage} has {planned} steps ({how}): running {planned}. "
          f"Fix: raise {more_key} for more steps (trainer.total_steps=0: always as many as it has)", flush=True)
    return planned


class StageTrainer(RunLoop):
    """The run loop (trainer/run_loop.py) with the RL driver's validation by generation and its scorer.

    A subclass calls `__init__`, sets `self.roles` (the worker roles), calls `start`, then `plan_steps` once it
    knows its rows (its epochs' steps, capped by trainer.total_steps: capped_steps), and implements `train_step`.
    """

    main_role = "actor_rollout"

    def __init__(self, cfg: RLConfig, model_path: str, tokenizer, run_dir: Path):
        super().__init__(cfg, model_path, tokenizer, run_dir)
        self.val_set: RLDataset | None = None

    def start(self, val_files: list[str]) -> None:
        """Validation prompts, rewards and the workers (`self.roles`); then `plan_steps`."""
        self.val_set = prompt_dataset(self.cfg, val_files, self.tokenizer)
        self.scorer = Scorer(self.cfg, self.tokenizer, self.clock)
        self.launch_workers()

    def plan_steps(self, num_rows: int, batch_size: int, epochs: int, unit: str) -> None:
        """epochs x (num_rows // batch_size) steps; the checkpointable sampler; the tracker; resume."""
        cfg = self.cfg
        steps_per_epoch = num_rows // batch_size
        if steps_per_epoch < 1:
            raise ValueError(f"{num_rows} {unit} cannot fill one batch of {batch_size} ({cfg.stage}.batch_size). "
                             f"Fix: a smaller {cfg.stage}.batch_size or more data")
        self.sampler = StatefulSampler(num_rows, batch_size, shuffle=cfg.data.shuffle, seed=cfg.data.seed)
        self.batches = self.sampler.forever()
        print(f"{cfg.stage}: {num_rows} {unit}, {epochs} epoch(s) x {steps_per_epoch} steps of {batch_size}", flush=True)
        self.plan_run(capped_steps(cfg, epochs * steps_per_epoch, f"{cfg.stage}.epochs={epochs} x {steps_per_epoch}",
                                   f"{cfg.stage}.epochs"))

    def start_workers(self) -> Workers:
        return start_stage_workers(self.cfg, self.roles, main_role=self.main_role)

    def validate(self) -> dict[str, float]:
        """The RL driver's generation validation (when the validation prompts have ground truth)."""
        if self.val_set is None:
            return {}
        with self.clock.timed("weight_sync"):
            self.actor_rollout.sync_weights(_timeout=self.cfg.trainer.timeouts.weight_sync)
        return self.validate_by_generation()

    def driver_state(self) -> dict:
        return {"sampler": self.sampler.state_dict(), "kl_coef": None}

    def load_driver_state(self, state: dict) -> None:
        self.sampler.load_state_dict(state["sampler"])
        self.batches = self.sampler.forever()


def prompts_batch(dataset: RLDataset, indices: list[int], pad_token_id: int) -> DataProto:
    batch = collate_prompts([dataset[i] for i in indices], pad_token_id)
    batch.non_tensor_batch["uid"] = np.array([str(i) for i in indices], dtype=object)
    return batch
