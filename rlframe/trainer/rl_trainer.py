"""The driver: the RL dataflow as a plain loop over named primitives on worker groups.

    for step in steps:
        batch  = next prompts
        batch  = batch.union(actor_rollout.generate_sequences(batch))   # n samples per prompt
        scores = start_scoring(batch)                                   # user reward functions, in a thread
        batch  = batch.union(actor_rollout.compute_log_prob(batch))
        batch  = batch.union(ref.compute_ref_log_prob(batch))           # when KL is used
        batch  = batch.union(critic.compute_values(batch))              # PPO (gae) only
        batch  = join_scores(batch, scores)                             # token_level_scores
        batch  = token_level_rewards(batch)                             # scores (- beta * KL in reward)
        batch  = compute_advantage(batch)                               # pure function, here
        critic.update_critic(batch)                                     # PPO (gae) only
        actor_rollout.update_actor(batch)                               # after trainer.critic_warmup steps
        actor_rollout.sync_weights()                                    # new weights -> engines

DAPO's dynamic sampling repeats the first two lines until the batch holds train_batch_size
prompts whose rewards differ (`rollout_batch`); ReMax adds one greedy sample per prompt.

Scoring overlaps the log-prob passes (reward.overlap, the default): the reward functions run in
a background thread of this process (their process pool does the work) and the scores are joined
before the advantage; with reward.overlap=false, or when the step needs its rewards first (dynamic
sampling), the scores are joined at once. Every phase's start and end go to <run_dir>/timeline.jsonl.

Workers compute; this file decides what to compute.
"""

from __future__ import annotations

import json
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf

from rlframe.algos import AdvantageConfig, get_advantage_estimator
from rlframe.algos.batching import balanced_equal_size_partition
from rlframe.algos.plugins import register_configured_plugins
from rlframe.config import RLConfig, to_container
from rlframe.controller import WorkerError
from rlframe.data.dataset import RLDataset, collate_prompts
from rlframe.data.multimodal import share_multi_modal_fields
from rlframe.data.sampler import StatefulSampler
from rlframe.protocol import DataProto
from rlframe.reward.manager import RewardManager, RewardResult, RewardSpec
from rlframe.rng import sample_seeds
from rlframe.memory_plan import read_shape
from rlframe.trainer import algorithm_steps, checkpoint, fault, perf
from rlframe.trainer.partial import pool_from_config
from rlframe.trainer.launch import DisaggregatedActorRollout, Workers, start_workers
from rlframe.trainer.tracking import Tracker

logger = logging.getLogger(__name__)


def compute_advantage(batch: DataProto, cfg: RLConfig) -> DataProto:
    """Advantages and returns from token-level rewards, by the configured estimator."""
    estimator = get_advantage_estimator(cfg.algorithm.adv_estimator)
    advantages, returns = estimator(
        batch.batch["token_level_rewards"], batch.batch["response_mask"], batch.non_tensor_batch["uid"],
        config=AdvantageConfig(gamma=cfg.algorithm.gamma, lam=cfg.algorithm.lam,
                               norm_by_std=cfg.algorithm.norm_adv_by_std, whiten=cfg.algorithm.whiten_advantages,
                               turn_gamma=cfg.algorithm.turn_gamma),
        values=batch.batch["values"] if "values" in batch else None,
        baseline_rewards=batch.batch["baseline_rewards"] if "baseline_rewards" in batch else None)
    batch.batch["advantages"] = advantages
    batch.batch["returns"] = returns
    return batch


def reported_accuracy(result: RewardResult) -> np.ndarray | None:
    """Per-response accuracy: the `acc` the reward functions report, or None when none reports one.

    One function: its `acc`. Several (keys `<label>/acc`): the mean of the ones that scored the
    response (NaN where none did, left out of the mean over responses); logged once.
    """
    keys = ["acc"] if "acc" in result.extras else sorted(k for k in result.extras if k.endswith("/acc"))
    if not keys:
        return None
    if keys != ["acc"]:
        log_once(f"accuracy: per response, the mean of {', '.join(keys)} over the functions that scored it")
    values = np.stack([result.extras[key].astype(float) for key in keys])
    reported = ~np.isnan(values)
    counts = reported.sum(axis=0)
    return np.where(counts > 0, np.where(reported, values, 0.0).sum(axis=0) / np.maximum(counts, 1), np.nan)


_LOGGED: set[str] = set()


def log_once(message: str) -> None:
    if message not in _LOGGED:
        _LOGGED.add(message)
        logger.info(message)


def place_scores_on_last_token(scores: np.ndarray, response_mask: torch.Tensor) -> torch.Tensor:
    """An outcome reward becomes a token-level reward on the last generated token."""
    token_scores = torch.zeros_like(response_mask, dtype=torch.float32)
    # the last trained token (with multi-turn tool tokens the mask has holes: not mask.sum() - 1)
    positions = torch.arange(response_mask.size(-1), device=response_mask.device)
    last = (positions * (response_mask > 0)).max(dim=-1).values
    token_scores[torch.arange(len(last)), last] = torch.as_tensor(scores, dtype=torch.float32)
    return token_scores * (response_mask.sum(-1, keepdim=True) > 0)


def add_environment_rows(prompts: DataProto, batch: DataProto, cfg: RLConfig) -> None:
    """A multi-turn environment's `reset(row)` gets the row's ground truth, data source and extra info."""
    if not (cfg.rollout.multi_turn.enable and cfg.rollout.multi_turn.environment.path):
        return
    nt = batch.non_tensor_batch
    rows = [{"ground_truth": nt["ground_truth"][i], "data_source": nt["data_source"][i],
             "extra_info": nt["extra_info"][i]} for i in range(len(batch))]
    prompts.non_tensor_batch["env_row"] = np.array(rows, dtype=object)


class RLTrainer:
    def __init__(self, cfg: RLConfig, model_path: str, tokenizer, train_files: list[str], val_files: list[str],
                 run_dir: Path):
        self.cfg = cfg
        self.model_path = model_path
        self.tokenizer = tokenizer
        self.run_dir = run_dir
        self.phase_times: dict[str, float] = {}
        self.timeline: list[tuple[str, float, float]] = []  # (phase, start, end) of this step, perf_counter
        self.clock_start = time.perf_counter()
        self.scoring_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlframe-reward")
        data = cfg.data
        dataset_kwargs = dict(prompt_key=data.prompt_key, answer_key=data.answer_key, prompt_template=data.prompt_template,
                              max_prompt_length=data.max_prompt_length, overlong=data.overlong, bad_rows=data.bad_rows,
                              image_key=data.image_key, min_pixels=data.min_pixels, max_pixels=data.max_pixels,
                              resize_images=data.resize_images)
        self.train_set = RLDataset(train_files, tokenizer, **dataset_kwargs)
        if cfg.trainer.total_epochs:  # epochs (verl/EasyR1) -> steps, from the dataset's size
            cfg.trainer.total_steps = cfg.trainer.total_epochs * max(1, len(self.train_set) // data.train_batch_size)
            logger.info("trainer.total_epochs=%d: %d steps", cfg.trainer.total_epochs, cfg.trainer.total_steps)
        self.val_set = RLDataset(val_files, tokenizer, **dataset_kwargs) if val_files else None
        self.sampler = StatefulSampler(len(self.train_set), data.train_batch_size, shuffle=data.shuffle, seed=data.seed)
        self.batches = self.sampler.forever()
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.rewards = RewardManager(
            [RewardSpec(path=f.path, name=f.name, weight=f.weight, data_sources=f.data_sources, kwargs=dict(f.kwargs),
                        reward_type=f.reward_type) for f in cfg.reward.functions],
            num_workers=cfg.reward.num_workers, timeout_s=cfg.reward.timeout_s, batch_timeout_s=cfg.reward.batch_timeout_s,
            fallback_score=cfg.reward.fallback_score, fail_fast=cfg.reward.fail_fast)
        # Where to start (trainer.resume): a checkpoint of this run; metrics logged after it are dropped.
        self.resume_from = checkpoint.resolve_resume(cfg.trainer.resume, run_dir)
        if self.resume_from is not None:
            checkpoint.trim_metrics_log(run_dir, self.resume_from.step)
        self.step, self.first_val, self.last_metrics = 0, {}, {}
        self.tracker = Tracker(run_dir, list(cfg.trainer.loggers), cfg.trainer.project_name, cfg.trainer.experiment_name,
                               to_container(cfg), total_steps=cfg.trainer.total_steps)
        # trainer.async_rollout: generation runs this many steps ahead of the update (0: as the synchronous loop)
        self.async_depth = cfg.trainer.max_staleness if cfg.trainer.async_rollout else 0
        self.ahead: list[PendingRollout] = []  # the next steps' generations, in flight on the engines (oldest first)
        self.weight_loads: list = []  # max_staleness >= 2: the engines' loads of staged weights, queued (Futures)
        self.policy_version = 0  # actor updates applied so far: the version of the trainer's weights
        # rollout.partial: responses generated a budget at a time across steps (rlframe/trainer/partial.py)
        self.partial = pool_from_config(cfg, model_path)
        self.staleness_bound = cfg.rollout.partial.max_token_staleness if self.partial else self.async_depth
        self.on_policy_update = (cfg.actor.skip_old_log_prob_when_on_policy and cfg.actor.ppo_epochs == 1
                                 and cfg.actor.ppo_mini_batch_size == cfg.data.train_batch_size
                                 and not cfg.algorithm.use_kl_in_reward)  # the reward KL needs old log-probs
        register_configured_plugins(to_container(cfg)["algorithm"])  # user estimator/loss files, before workers
        self.kl_ctrl = algorithm_steps.make_kl_controller(cfg)
        self.model_shape = read_shape(model_path)  # for perf/mfu (rlframe/trainer/perf.py)
        self.peak_tflops, self.devices = perf.device_peak(cfg)
        self._start_workers()

    # ------------------------------------------------------------------ workers
    def _start_workers(self) -> None:
        with self.timed("init_workers"):
            self.workers: Workers = start_workers(self.cfg, self.model_path)

    @property
    def actor_rollout(self):
        return self.workers.actor_rollout

    @property
    def ref(self):
        return self.workers.ref

    @property
    def critic(self):
        return self.workers.critic

    @property
    def reward_model(self):
        return self.workers.reward_model

    @contextmanager
    def naming_failures(self, phase: str, step: int | None = None):
        """A worker's failure inside names the step (default: the current one) and the phase; a timeout also
        dumps the stuck stacks (fault.annotate)."""
        try:
            yield
        except WorkerError as error:
            raise fault.annotate(error, phase, self.step if step is None else step, getattr(self, "workers", None))

    @contextmanager
    def timed(self, phase: str):
        start = time.perf_counter()
        with self.naming_failures(phase):
            yield
        self.record_phase(phase, start, time.perf_counter())

    def record_phase(self, phase: str, start: float, end: float) -> None:
        self.phase_times[phase] = self.phase_times.get(phase, 0.0) + end - start
        self.timeline.append((phase, start, end))

    def write_timeline(self, step: int, step_start: float) -> None:
        """<run_dir>/timeline.jsonl: the step's span and one row per phase, in seconds on one clock (from the
        driver's start). With trainer.async_rollout a step's `rollout` began during the previous step."""
        with open(self.run_dir / "timeline.jsonl", "a") as f:
            for phase, start, end in [("step", step_start, time.perf_counter()), *self.timeline]:
                f.write(json.dumps({"step": step, "phase": phase, "start": round(start - self.clock_start, 6),
                                    "end": round(end - self.clock_start, 6)}) + "\n")

    # ------------------------------------------------------------------ the loop
    def fit(self) -> dict:
        """Train from `resume_from` (or step 0); a dead or stuck worker restarts up to max_restarts times."""
        restarts = 0
        while True:
            try:
                return self.train(start_step=self.restore(self.resume_from))
            except fault.RESTARTABLE as error:
                if restarts >= self.cfg.trainer.max_restarts:
                    raise
                restarts += 1
                print(f"restart {restarts}/{self.cfg.trainer.max_restarts} after: {error.summary}", flush=True)
                self.workers.shutdown()
                self._start_workers()
                self.resume_from = checkpoint.find_latest_complete(self.run_dir)

    def save_checkpoint(self, step: int) -> None:
        # (the prompts of a generation in flight are drawn again after a resume)
        sampler = self.ahead[0].sampler_state if self.ahead else self.sampler.state_dict()
        driver_state = {"sampler": sampler, "val_before": self.first_val,
                        "last_metrics": self.last_metrics, "kl_coef": getattr(self.kl_ctrl, "value", None)}
        if self.partial is not None:  # the held-back responses (not the groups of a generation in flight)
            driver_state["partial_pool"] = self.partial.state_dict(
                exclude={uid for pending in self.ahead for uid in pending.partial_drawn})
        t = self.cfg.trainer
        checkpoint.save_checkpoint(self.workers, self.run_dir, step, driver_state,
                                   OmegaConf.to_yaml(OmegaConf.structured(self.cfg)), keep=t.max_checkpoints_to_keep,
                                   timeout_s=t.timeouts.update)

    def restore(self, ckpt: checkpoint.Checkpoint | None) -> int:
        """Load `ckpt` into the workers and the driver; returns the step to continue after (0: fresh)."""
        if self.partial is not None:
            self.partial.groups.clear()
        if ckpt is None:
            return 0
        if isinstance(self.actor_rollout, DisaggregatedActorRollout):  # the engines record the restored version
            self.actor_rollout.policy_version = self.updates_after(ckpt.step)
        state = checkpoint.restore_checkpoint(self.workers, ckpt, timeout_s=self.cfg.trainer.timeouts.init)
        if state.get("kl_coef") is not None and self.kl_ctrl is not None:
            self.kl_ctrl.value = float(state["kl_coef"])  # the adaptive controller's beta
        self.sampler.load_state_dict(state["sampler"])
        self.batches = self.sampler.forever()
        self.first_val, self.last_metrics = state["val_before"], state["last_metrics"]
        if self.partial is not None and "partial_pool" in state:
            self.partial.load_state_dict(state["partial_pool"])
        return int(state["step"])

    def train(self, start_step: int) -> dict:
        cfg = self.cfg
        timeouts = cfg.trainer.timeouts
        self.ahead, self.weight_loads, self.policy_version = [], [], self.updates_after(start_step)
        if start_step == 0 and cfg.trainer.val_before_train and self.val_set:
            self.first_val = self.validate()
            self.tracker.log(0, self.first_val)
        for step in range(start_step + 1, cfg.trainer.total_steps + 1):
            self.step = step
            step_start = time.perf_counter()
            self.phase_times, self.timeline = {}, []
            batch, reward_metrics, scores = self.rollout_batch(step)
            if self.async_depth and step < cfg.trainer.total_steps:  # the engines start on the next batch(es) now
                self.launch_ahead(step)
            reward_metrics.update(self.staleness_metrics(batch))
            if cfg.trainer.balance_batch:
                order = balanced_order(batch, cfg.actor.world_size)
                if order is not None:
                    batch.reorder(order)
                    scores.reorder(order)
            if not self.on_policy_update:
                with self.timed("old_log_prob"):
                    batch = batch.union(self.actor_rollout.compute_log_prob(batch, _timeout=timeouts.log_prob))
            if self.ref is not None:
                with self.timed("ref_log_prob"):
                    batch = batch.union(self.ref.compute_ref_log_prob(batch, _timeout=timeouts.log_prob))
            if self.critic is not None:
                with self.timed("values"):
                    batch = batch.union(self.critic.compute_values(batch, _timeout=timeouts.log_prob))
            reward_metrics.update(self.join_scores(batch, scores))
            kl_metrics = algorithm_steps.token_level_rewards(batch, self.kl_ctrl, cfg.algorithm.kl_penalty)
            with self.timed("advantage"):
                batch = compute_advantage(batch, cfg)
            train_metrics = {}
            if self.critic is not None:
                with self.timed("update_critic"):
                    train_metrics.update(self.critic.update_critic(batch, _timeout=timeouts.update).meta_info["metrics"])
            if step > cfg.trainer.critic_warmup:  # PPO: the first critic_warmup steps train only the critic
                with self.timed("update"):
                    train_metrics.update(self.actor_rollout.update_actor(batch, _timeout=timeouts.update).meta_info["metrics"])
                self.policy_version += 1
            if self.async_depth < 2:
                self.finish_generation_ahead()  # the engines are idle before they receive weights
            if step > cfg.trainer.critic_warmup:
                with self.timed("weight_sync"):
                    if self.async_depth >= 2:  # staged: the engines load them after the generations already sent
                        sync = self.stage_weights()
                    else:
                        sync = self.actor_rollout.sync_weights(_timeout=timeouts.weight_sync, **self.version_arg())[0]
                train_metrics["weight_sync/seconds"] = sync["timing/weight_sync_s"]
                if "weight_sync/bytes" in sync:
                    train_metrics["weight_sync/bytes"] = float(sync["weight_sync/bytes"])

            metrics = {**reward_metrics, **kl_metrics, **train_metrics, **batch_metrics(batch)}
            metrics.update({f"timing/{k}": v for k, v in self.phase_times.items()})
            metrics["timing/step"] = time.perf_counter() - step_start
            generated = metrics.get("partial/generated_tokens", float(batch.batch["response_mask"].sum()))
            metrics["perf/generated_tokens_per_s"] = generated / max(
                self.phase_times["rollout"] + self.phase_times.get("rollout_rounds", 0.0), 1e-9)
            forward_passes = sum(phase in self.phase_times for phase in ("old_log_prob", "ref_log_prob", "values"))
            trained_passes = sum(phase in self.phase_times for phase in ("update", "update_critic"))
            metrics.update(perf.step_perf(self.model_shape, batch.batch["attention_mask"], batch.batch["response_mask"],
                                          self.phase_times, metrics["timing/step"], forward_passes, trained_passes,
                                          self.peak_tflops, self.devices, samples_per_prompt=cfg.rollout.n))
            metrics.update(perf.peak_memory_metrics(self.workers.memory_peaks()))
            if cfg.trainer.val_every and step % cfg.trainer.val_every == 0 and step != cfg.trainer.total_steps:
                metrics.update(self.validate())
            if step == cfg.trainer.total_steps and cfg.trainer.val_at_end and self.val_set:
                metrics.update(self.validate())
            self.tracker.log(step, metrics)
            self.write_timeline(step, step_start)
            self.last_metrics = metrics
            if checkpoint.should_save(step, cfg.trainer.total_steps, cfg.trainer.save_every):
                self.save_checkpoint(step)
        self.check_weight_loads(wait=True)
        summary = {"run_dir": str(self.run_dir), "val_before": self.first_val, "val_after": {
            k: v for k, v in self.last_metrics.items() if k.startswith("val/")}}
        if cfg.trainer.export_hf:
            export_dir = self.run_dir / "hf_model"
            self.actor_rollout.save_hf(str(export_dir))
            summary["hf_model"] = str(export_dir)
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        try:  # the HTML report (rlframe/report.py); a failure here must not fail the run
            from rlframe.report import write_report

            print(f"report: {write_report(self.run_dir)}", flush=True)
        except Exception as error:
            logger.warning("could not write the run report: %s: %s", type(error).__name__, error)
        return summary

    def rollout_batch(self, step: int) -> tuple[DataProto, dict[str, float], PendingScores]:
        """A batch of train_batch_size prompts x n samples, its metrics, and its scores (pending with
        reward.overlap: `join_scores` adds them to the batch).

        With dynamic sampling (DAPO) only groups whose rewards differ are kept, and more prompts are
        drawn and generated until the batch is full (so the scores are needed at once); the reward
        metrics are those of the first round.
        """
        sampling = self.cfg.algorithm.dynamic_sampling
        if not sampling.enable:
            return self.generate_and_score(step, overlap=self.cfg.reward.overlap)
        wanted = self.cfg.data.train_batch_size * self.cfg.rollout.n
        kept, first_metrics = [], None
        for attempt in range(1, sampling.max_attempts + 1):
            batch, metrics, scores = self.generate_and_score(step, overlap=False)
            metrics.update(self.join_scores(batch, scores))
            first_metrics = first_metrics or metrics
            kept.append(algorithm_steps.keep_informative(batch))
            if sum(len(part) for part in kept) >= wanted:
                batch = algorithm_steps.concat_rollouts(kept, self.pad_token_id)[:wanted]
                batch.meta_info["step"] = step
                return batch, {**first_metrics, "dynamic_sampling/rounds": float(attempt),
                               "dynamic_sampling/kept_frac": float(len(kept[0]) / wanted)}, PendingScores.joined()
        raise RuntimeError(
            f"dynamic sampling: after {sampling.max_attempts} rollout rounds only "
            f"{sum(len(p) for p in kept) // self.cfg.rollout.n} of {self.cfg.data.train_batch_size} prompts had "
            "rewards that differ within their group (all others were all-correct or all-wrong). Fix: raise "
            "algorithm.dynamic_sampling.max_attempts, raise rollout.n or rollout.temperature, use easier/harder "
            "data, or turn it off with algorithm.dynamic_sampling.enable=false.")

    def generate_and_score(self, step: int, overlap: bool) -> tuple[DataProto, dict[str, float], PendingScores]:
        """Next prompts -> n samples each -> their scores, pending in a thread when `overlap`
        (+ ReMax's greedy baseline, DAPO's overlong shaping)."""
        cfg = self.cfg
        if self.ahead and self.ahead[0].step == step:  # generated while the previous step(s) trained
            pending = self.ahead.pop(0)
            if pending.span is None:  # max_staleness >= 2: not waited for before the sync, maybe not yet done
                with self.timed("rollout_wait"):
                    batch = self.take_generation(pending)
                self.check_weight_loads()
                generating = pending.result.meta_info.get("timing/generate_rank0", 0.0)
                pending.span = (pending.started, pending.started + generating)  # (from its launch; it may have queued)
            else:
                batch = self.take_generation(pending)
            self.record_phase("rollout", *pending.span)  # (it ran during the previous step)
            if pending.rounds_span is not None:  # partial rollouts: the rounds after the first, run now
                self.record_phase("rollout_rounds", *pending.rounds_span)
        else:
            pending = self.start_generation(step)
            batch = self.take_generation(pending)
            self.record_phase("rollout", pending.started, time.perf_counter())
        scores = self.start_scoring(batch, overlap)
        reward_metrics = dict(pending.metrics)
        if cfg.rollout.multi_turn.enable:
            from rlframe.workers.rollout.agent_loop import agent_metrics

            reward_metrics.update(agent_metrics(batch.non_tensor_batch, batch.batch["response_mask"],
                                                batch.batch["attention_mask"]))
        if pending.baseline is not None:
            batch.batch["baseline_rewards"] = pending.baseline.repeat_interleave(cfg.rollout.n)
            reward_metrics["reward/greedy_baseline_mean"] = float(pending.baseline.mean())
        return batch, reward_metrics, scores

    def start_generation(self, step: int) -> PendingRollout:
        """Draw the step's prompts and send them to the engines (+ ReMax's greedy baseline, generated here)."""
        cfg, timeouts = self.cfg, self.cfg.trainer.timeouts
        if self.partial is not None:
            return self.start_partial_generation(step)
        sampler_state = self.sampler.state_dict()
        batch = self.next_prompts()
        batch.meta_info["step"] = step
        prompts = batch.pop(batch_keys=["input_ids", "attention_mask", "position_ids"])
        share_multi_modal_fields(prompts, batch)  # rows with images: the rollout engine needs them
        add_environment_rows(prompts, batch, cfg)
        baseline = self.greedy_baseline(batch, prompts) if cfg.algorithm.adv_estimator == "remax" else None
        prompts = prompts.repeat(cfg.rollout.n, interleave=True)
        batch = batch.repeat(cfg.rollout.n, interleave=True)
        if cfg.rollout.seed_each_sample:  # sampling independent of the engine's RNG history: exact resume
            prompts.non_tensor_batch["sample_seed"] = sample_seeds(cfg.trainer.seed, step, batch.non_tensor_batch["uid"])
        # The engine's next use is the weight load after this step's update (one rollout round, the actor
        # trains this step): on GPU it may discard its weights while it sleeps (vLLM sleep level 2).
        prompts.meta_info["update_follows"] = not cfg.algorithm.dynamic_sampling.enable and step > cfg.trainer.critic_warmup
        started = time.perf_counter()
        generation = self.actor_rollout.generate_sequences(prompts, _blocking=False, _timeout=timeouts.rollout)
        return PendingRollout(step, batch, generation, sampler_state, started, baseline)

    def take_generation(self, pending: PendingRollout) -> DataProto:
        """The prompts' rows joined with what the engines generated for them (waits for it)."""
        if self.partial is not None:
            return self.take_partial_generation(pending)
        if pending.result is None:
            with self.naming_failures("rollout", pending.step):
                pending.result = pending.generation.result()
        return pending.batch.union(pending.result)

    def finish_generation_ahead(self) -> None:
        """Asynchronous loop: wait until the engines have generated the next step's batch (they must be idle
        before they receive weights). timing/rollout_wait: the driver's wait; the generation's own span
        (from its start, in the previous step) goes to the next step's timeline as `rollout`."""
        pending = self.ahead[0] if self.ahead else None
        if pending is None or pending.result is not None or pending.generation is None:
            return
        with self.timed("rollout_wait"):
            with self.naming_failures("rollout", pending.step):
                pending.result = pending.generation.result()
        generating = pending.result.meta_info.get("timing/generate_rank0", time.perf_counter() - pending.started)
        pending.span = (pending.started, pending.started + generating)

    def launch_ahead(self, step: int) -> None:
        """Asynchronous loop: keep the generations of steps step+1 .. step+max_staleness in flight (each sent once,
        in order; the engines run them one after another)."""
        last = self.ahead[-1].step if self.ahead else step
        for ahead_step in range(last + 1, min(step + self.async_depth, self.cfg.trainer.total_steps) + 1):
            self.ahead.append(self.start_generation(ahead_step))

    def stage_weights(self) -> dict:
        """trainer.max_staleness >= 2: the actor puts its weights in Ray's object store and the engines load them
        after the generations already sent to them (recording the new version); neither side waits for the other.
        A step's samples are then generated by weights at most max_staleness updates old (async/staleness_max)."""
        timeouts = self.cfg.trainer.timeouts
        queued = None if timeouts.rollout is None or timeouts.weight_sync is None else (
            len(self.ahead) * timeouts.rollout + timeouts.weight_sync)
        sync, loading = self.actor_rollout.stage_weights(self.policy_version, _timeout=timeouts.weight_sync,
                                                         _load_timeout=queued)
        self.weight_loads.append(loading)
        return sync

    def check_weight_loads(self, wait: bool = False) -> None:
        """Surface a failed load of staged weights (max_staleness >= 2); with `wait`, wait for every queued one."""
        while self.weight_loads and (wait or self.weight_loads[0].done()):
            with self.naming_failures("weight_sync"):
                self.weight_loads.pop(0).result()

    def staleness_metrics(self, batch: DataProto) -> dict[str, float]:
        """async/staleness_{max,mean}: the trainer's version - the version of the weights that generated each sample
        (recorded by disaggregated engines; with partial rollouts its oldest token's); with trainer.async_rollout never
        above trainer.max_staleness (rollout.partial.max_token_staleness with partial rollouts)."""
        if "policy_version" not in batch.non_tensor_batch:
            return {}
        versions = batch.non_tensor_batch["policy_version"].astype(np.int64)
        staleness = self.policy_version - versions
        if int(staleness.max()) > self.staleness_bound or int(staleness.min()) < 0:
            raise RuntimeError(f"step {self.step}: samples of policy versions {sorted(set(versions.tolist()))} for a "
                               f"trainer at version {self.policy_version}: staleness outside [0, {self.staleness_bound}]")
        return {"async/staleness_max": float(staleness.max()), "async/staleness_mean": float(staleness.mean()),
                "async/policy_version": float(self.policy_version), "async/sample_version_min": float(versions.min()),
                "async/sample_version_max": float(versions.max())}

    # ------------------------------------------------------------------ partial rollouts (rollout.partial)
    def start_partial_generation(self, step: int) -> PendingRollout:
        """Restart the groups too stale for the step's update, fill the pool with new prompts, and send every
        unfinished response (prompt + tokens so far) to the engines for one round of at most the budget."""
        pool = self.partial
        sampler_state = self.sampler.state_dict()
        pool.expire(train_version=self.updates_after(step - 1))
        drawn = []
        for _ in range(pool.batches_to_draw()):
            rows = self.next_prompts()
            pool.draw(rows, rows.pop(batch_keys=["input_ids", "attention_mask", "position_ids"]))
            drawn += [str(uid) for uid in rows.non_tensor_batch["uid"]]
        samples = pool.unfinished()
        started = time.perf_counter()
        generation = self.actor_rollout.generate_sequences(
            pool.requests(samples, step, 0), _blocking=False, _timeout=self.cfg.trainer.timeouts.rollout) if samples else None
        pending = PendingRollout(step, None, generation, sampler_state, started)
        if generation is None:  # every response in the pool had finished
            pending.span = (started, started)
        pending.partial = (samples, self.policy_version)  # the engines hold the trainer's last synced weights
        pending.partial_drawn = drawn
        return pending

    def take_partial_generation(self, pending: PendingRollout) -> DataProto:
        """The round sent by start_partial_generation, more rounds (now's weights) while fewer than
        data.train_batch_size groups have finished, then the batch of finished groups (partial/* metrics)."""
        pool, step = self.partial, pending.step
        if pending.generation is not None:
            if pending.result is None:
                with self.naming_failures("rollout", step):
                    pending.result = pending.generation.result()
            samples, version = pending.partial
            pool.absorb(samples, pending.result, version, step)
        max_rounds = -(-pool.response_length // pool.budget) + 1
        start = time.perf_counter()
        for round_index in range(1, max_rounds + 1):
            if len(pool.ready_groups()) >= pool.batch_size:
                break
            samples = pool.unfinished()
            with self.naming_failures("rollout", step):
                generated = self.actor_rollout.generate_sequences(pool.requests(samples, step, round_index),
                                                                  _timeout=self.cfg.trainer.timeouts.rollout)
            pool.absorb(samples, generated, self.policy_version, step)
            pending.rounds_span = (start, time.perf_counter())
        batch, pending.metrics = pool.take_batch(train_version=self.policy_version, step=step)
        batch.meta_info["step"] = step
        return batch

    def updates_after(self, step: int) -> int:
        """The actor updates applied after `step` steps (the first trainer.critic_warmup steps update none)."""
        return max(0, step - self.cfg.trainer.critic_warmup)

    def version_arg(self) -> dict:
        """Disaggregated engines record the version of the weights they receive."""
        return {"policy_version": self.policy_version} if isinstance(self.actor_rollout, DisaggregatedActorRollout) else {}

    def greedy_baseline(self, batch: DataProto, prompts: DataProto) -> torch.Tensor:
        """ReMax: the score of one greedy response per prompt, [B]."""
        greedy_prompts = prompts.select(meta_info_keys=[])
        greedy_prompts.meta_info["greedy"] = True
        with self.timed("rollout_greedy"):
            greedy = batch.select(batch_keys=[]).union(
                self.actor_rollout.generate_sequences(greedy_prompts, _timeout=self.cfg.trainer.timeouts.rollout))
        greedy, _ = self.score(greedy)
        algorithm_steps.shape_overlong(greedy, self.cfg)  # the same reward as the samples it is compared with
        return greedy.batch["token_level_scores"].sum(-1)

    def next_prompts(self) -> DataProto:
        position = self.sampler.state_dict()  # (epoch, batch) names the prompts: uids replay on resume
        indices = next(self.batches)
        batch = collate_prompts([self.train_set[i] for i in indices], self.pad_token_id)
        uids = [f"e{position['epoch']}b{position['position']}-{i}" for i in range(len(indices))]
        batch.non_tensor_batch["uid"] = np.array(uids, dtype=object)
        return batch

    # ------------------------------------------------------------------ rewards
    def start_scoring(self, batch: DataProto, overlap: bool) -> PendingScores:
        """Score `batch` (its rows in their present order): in the scoring thread when `overlap`,
        else here and now. The scoring works on a shallow copy: `batch` is not changed."""
        start = time.perf_counter()
        scored, texts = batch.select(), self.decode_responses(batch)

        def score() -> tuple[DataProto, dict[str, float], float, float]:
            scored_batch, metrics = self.score(scored, texts)
            metrics.update(algorithm_steps.shape_overlong(scored_batch, self.cfg))
            return scored_batch, metrics, start, time.perf_counter()

        if overlap:
            return PendingScores(self.scoring_thread.submit(score), batch, sequential=False)
        done: Future = Future()
        with self.naming_failures("reward"):  # (the reward model runs on a worker)
            done.set_result(score())
        return PendingScores(done, batch, sequential=True)

    def join_scores(self, batch: DataProto, scores: PendingScores) -> dict[str, float]:
        """Wait for the scores and add their columns (token_level_scores, ...) to `batch`; the reward metrics.

        timing/reward: the scoring's own seconds; timing/reward_wait_s: how long the driver blocked here
        (with reward.overlap=false: the whole scoring, which ran before the log-prob passes).
        """
        if scores.future is None:  # joined already (dynamic sampling)
            return {}
        wait_start = time.perf_counter()
        with self.naming_failures("reward"):  # (the reward model runs on a worker)
            scored, metrics, start, end = scores.future.result()
        waited = end - start if scores.sequential else time.perf_counter() - wait_start
        self.record_phase("reward", start, end)
        columns = scored.select(batch_keys=scores.new_keys, non_tensor_keys=[], meta_info_keys=[])
        if scores.order is not None:
            columns.reorder(scores.order)
        batch.union(columns)
        scores.future = None
        return {**metrics, "timing/reward_wait_s": waited}

    def decode_responses(self, batch: DataProto) -> list[str]:
        responses, mask = batch.batch["responses"], batch.batch["response_mask"]
        # up to the last trained token: multi-turn responses hold tool tokens (mask 0) between model turns
        positions = torch.arange(mask.size(-1))
        lengths = ((positions + 1) * (mask > 0)).max(dim=-1).values.tolist()
        return self.tokenizer.batch_decode([r[:n].tolist() for r, n in zip(responses, lengths)],
                                           skip_special_tokens=True)

    def rule_and_model_scores(self, batch: DataProto, texts: list[str]) -> tuple[RewardResult, np.ndarray, dict]:
        """(the reward functions' result, score = rule-based + reward_model.weight * RM score [B], metrics)."""
        nt = batch.non_tensor_batch
        result = self.rewards.score(texts, list(nt["ground_truth"]), list(nt["data_source"]), list(nt["extra_info"]),
                                    response_lengths=batch.batch["response_mask"].sum(-1).long().tolist())
        scores = result.scores
        if "agent_env_reward" in nt:  # a multi-turn environment's rewards (summed over the turns)
            scores = scores + np.asarray(nt["agent_env_reward"], dtype=float)
        metrics = dict(result.metrics)
        if self.reward_model is not None:  # model-based reward on top of the rule-based ones
            rm_input = DataProto.from_dict(non_tensors={"raw_prompt": list(nt["raw_prompt"]), "responses_text": texts})
            rm_scores = self.reward_model.compute_rm_score(rm_input).batch["rm_scores"].double().numpy()
            scores = scores + self.cfg.reward_model.weight * rm_scores
            metrics["reward/rm_score_mean"] = float(rm_scores.mean())
        return result, scores, metrics

    def score(self, batch: DataProto, texts: list[str] | None = None) -> tuple[DataProto, dict[str, float]]:
        """token_level_scores: the score (rule-based + RM) on each response's last token."""
        texts = self.decode_responses(batch) if texts is None else texts
        result, scores, metrics = self.rule_and_model_scores(batch, texts)
        batch.batch["token_level_scores"] = place_scores_on_last_token(scores, batch.batch["response_mask"])
        nt = batch.non_tensor_batch
        if self.cfg.rollout.multi_turn.turn_rewards == "per_turn" and "agent_turn_reward_positions" in nt:
            from rlframe.workers.rollout.agent_loop import place_turn_rewards

            batch.batch["token_level_scores"] = place_turn_rewards(
                batch.batch["token_level_scores"], nt["agent_turn_rewards"], nt["agent_turn_reward_positions"],
                batch.batch["response_mask"])
        metrics["critic/score/mean"] = float(np.mean(scores))
        accuracy = reported_accuracy(result)
        if accuracy is not None:
            metrics["critic/accuracy"] = float(np.nanmean(accuracy))
        return batch, metrics

    # ------------------------------------------------------------------ validation
    def validate(self) -> dict[str, float]:
        """Greedy generation on the held-out split.

        val/reward_mean: the rule-based reward functions' score; val/score_mean: the score training
        uses (+ reward_model.weight * RM score + overlong shaping); val/accuracy: see reported_accuracy.
        """
        start = time.perf_counter()
        n = min(len(self.val_set), self.cfg.data.val_max_samples or len(self.val_set))
        batch = collate_prompts([self.val_set[i] for i in range(n)], self.pad_token_id)
        prompts = batch.pop(batch_keys=["input_ids", "attention_mask", "position_ids"])
        share_multi_modal_fields(prompts, batch)  # rows with images: the rollout engine needs them
        add_environment_rows(prompts, batch, self.cfg)
        prompts.meta_info["validate"] = True
        batch = batch.union(self.actor_rollout.generate_sequences(prompts, _timeout=self.cfg.trainer.timeouts.rollout))
        texts = self.decode_responses(batch)
        result, scores, reward_metrics = self.rule_and_model_scores(batch, texts)
        penalty = algorithm_steps.overlong_penalties(batch.batch["response_mask"], self.cfg)
        accuracy = reported_accuracy(result)
        if accuracy is None:
            log_once("no reward function returns an 'acc' key: val/accuracy is the share of responses whose "
                     "rule-based reward is >= 1")
            accuracy = (result.scores >= 1.0).astype(float)
        nt = batch.non_tensor_batch
        self.write_samples("validation", texts[:8], list(nt["ground_truth"][:8]), result.scores[:8])
        metrics = {"val/reward_mean": float(np.mean(result.scores)),
                   "val/score_mean": float(np.mean(scores + (0.0 if penalty is None else penalty.double().numpy()))),
                   "val/accuracy": float(np.nanmean(accuracy)),
                   "val/response_length": float(batch.batch["response_mask"].sum(-1).mean()),
                   "timing/validation": time.perf_counter() - start}
        if "reward/rm_score_mean" in reward_metrics:
            metrics["val/rm_score_mean"] = reward_metrics["reward/rm_score_mean"]
        return metrics

    def write_samples(self, kind: str, texts: list[str], truths: list, scores) -> None:
        rows = [{"step": self.step, "response": text, "ground_truth": str(truth), "score": float(score)}
                for text, truth, score in zip(texts, truths, scores)]
        with open(self.run_dir / f"{kind}_samples.jsonl", "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        self.tracker.log_samples(self.step, kind, rows)

    def close(self) -> None:
        self.scoring_thread.shutdown(wait=True, cancel_futures=True)  # before its reward workers stop
        self.rewards.close()
        self.tracker.close()
        self.workers.shutdown()


class PendingRollout:
    """One step's generation in flight: the prompts' rows, the engines' Future, the sampler's state before
    the prompts were drawn (what a checkpoint saves while it is in flight), when it started, and ReMax's
    greedy baseline [B] (None for other estimators)."""

    def __init__(self, step: int, batch: DataProto, generation, sampler_state: dict, started: float,
                 baseline: torch.Tensor | None = None):
        self.step, self.batch, self.generation = step, batch, generation
        self.sampler_state, self.started, self.baseline = sampler_state, started, baseline
        self.result: DataProto | None = None
        self.span: tuple[float, float] | None = None  # (start, end) of the generation, when run ahead
        self.partial: tuple[list, int] | None = None  # partial rollouts: (the samples sent, the engines' version)
        self.partial_drawn: list[str] = []  # partial rollouts: the uids of the prompts drawn for it
        self.rounds_span: tuple[float, float] | None = None  # partial rollouts: (start, end) of the rounds after it
        self.metrics: dict[str, float] = {}  # partial rollouts: partial/*


class PendingScores:
    """The scores of one batch: a Future of (scored copy, metrics, start, end), from the scoring
    thread or already set (`sequential`). `reorder` records a reordering of the batch's rows made
    after the scoring started, so that `RLTrainer.join_scores` puts each score on its row."""

    def __init__(self, future: Future | None, batch: DataProto | None = None, sequential: bool = True):
        self.future, self.sequential = future, sequential
        self.old_keys = set(batch.batch.keys()) if batch is not None else set()
        self.order: list[int] | None = None

    @classmethod
    def joined(cls) -> PendingScores:
        return cls(None)

    @property
    def new_keys(self) -> list[str]:
        """The columns the scoring added (token_level_scores, outcome_scores with overlong shaping)."""
        scored = self.future.result()[0]
        return [key for key in scored.batch.keys() if key not in self.old_keys]

    def reorder(self, order: list[int]) -> None:
        self.order = list(order) if self.order is None else [self.order[i] for i in order]


def balanced_order(batch: DataProto, world_size: int) -> list[int] | None:
    """A row order that gives each rank's contiguous chunk a near-equal number of tokens (None: keep)."""
    if world_size == 1 or len(batch) % world_size:
        return None
    lengths = batch.batch["attention_mask"].sum(-1).tolist()
    groups = balanced_equal_size_partition(lengths, world_size)
    return [i for group in groups for i in group]


def balance_across_ranks(batch: DataProto, world_size: int) -> DataProto:
    """Reorder rows so each rank's contiguous chunk holds a near-equal number of tokens."""
    order = balanced_order(batch, world_size)
    return batch if order is None else batch.reorder(order)


def batch_metrics(batch: DataProto) -> dict[str, float]:
    """Per-step statistics of the rollout batch, incl. the engine/trainer log-prob agreement."""
    mask = batch.batch["response_mask"]
    lengths = mask.sum(-1)
    max_len = mask.size(1)
    metrics = {
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        "response_length/clip_ratio": float((lengths >= max_len).float().mean()),
        "critic/advantages/mean": float((batch.batch["advantages"] * mask).sum() / mask.sum().clamp(min=1)),
    }
    if "entropy" in batch:
        metrics["actor/entropy_old"] = float((batch.batch["entropy"] * mask).sum() / mask.sum().clamp(min=1))
    if "rollout_log_probs" in batch and "old_log_probs" in batch:
        diff = (batch.batch["rollout_log_probs"] - batch.batch["old_log_probs"]).abs() * mask
        metrics["rollout/logprob_abs_diff"] = float(diff.sum() / mask.sum().clamp(min=1))
        metrics["rollout/logprob_abs_diff_max"] = float(diff.max())
    return metrics
