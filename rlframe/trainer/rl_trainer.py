"""The RL driver: one step of the RL dataflow as a plain sequence of named primitives on worker groups.

    batch, scores = rollouts.next(step)                              # prompts -> n samples each; scoring starts
    batch = batch.union(actor_rollout.compute_log_prob(batch))       # (skipped when the update is on-policy)
    batch = batch.union(ref.compute_ref_log_prob(batch))             # when KL is used
    batch = batch.union(teacher.compute_teacher_log_prob(batch))     # on-policy distillation (teacher.path)
    batch = batch.union(critic.compute_values(batch))                # when the estimator needs values (gae)
    scorer.join(batch, scores)                                       # token_level_scores
    token_level_rewards(batch)                                       # scores (- beta * KL in reward)
    batch = compute_advantage(batch)                                 # pure function, here
    critic.update_critic(batch)                                      # with a critic
    actor_rollout.update_actor(batch)                                # after trainer.critic_warmup steps
    rollouts.sync_weights()                                          # new weights -> engines
    gates.check(step, metrics, sync)                                 # warn about / stop a silently broken run

`rollouts` (trainer/rollout_source.py) hides how the samples are made (synchronous, generated ahead,
partial, dynamic sampling, ReMax's greedy baseline); `scorer` (trainer/scorer.py) runs the reward functions
in a background thread while the log-prob passes run (reward.overlap); `gates` (trainer/gates.py,
trainer.gates) read the step's metrics and the sync's weight checksums. The run loop around the step
(validation, metrics, checkpoints, restarts) is the one every stage shares (trainer/run_loop.py).

Workers compute; this file decides what to compute.
"""

from __future__ import annotations

import logging
from pathlib import Path

from rlframe.algos import AdvantageConfig, get_advantage_estimator
from rlframe.algos.batching import balanced_equal_size_partition
from rlframe.algos.distillation import NEEDS_STUDENT_TOPK
from rlframe.algos.plugins import register_configured_plugins
from rlframe.config import RLConfig, to_container
from rlframe.config.actor import skips_old_log_prob_pass
from rlframe.data.dataset import RLDataset
from rlframe.protocol import DataProto
from rlframe.reward.judge import build_judge
from rlframe.memory_plan import plans_gpu, read_shape
from rlframe.trainer import algorithm_steps, perf
from rlframe.trainer.gates import Gates, GateStopped, run_dtype, step_signals, sync_check_metrics
from rlframe.trainer.launch import start_workers
from rlframe.trainer.rollout_source import RolloutSource
from rlframe.trainer.run_loop import RunLoop
from rlframe.trainer.scorer import Scorer
from rlframe.trainer.worker_settings import judge_engine_settings

logger = logging.getLogger(__name__)


def compute_advantage(batch: DataProto, cfg: RLConfig) -> DataProto:
    """Advantages and returns from token-level rewards, by the configured estimator."""
    estimator = get_advantage_estimator(cfg.algorithm.adv_estimator)
    # an LLM judge's unscorable samples (column `scorable`): out of the baselines, advantage 0
    unscorable = {"scorable": batch.batch["scorable"]} if "scorable" in batch else {}
    if unscorable and "baseline_rewards" in batch:  # ReMax: a prompt whose greedy baseline the judge did not score
        unscorable["scorable"] = unscorable["scorable"] & batch.batch["baseline_rewards"].isfinite()
    advantages, returns = estimator(
        batch.batch["token_level_rewards"], batch.batch["response_mask"], batch.non_tensor_batch["uid"],
        config=AdvantageConfig(gamma=cfg.algorithm.gamma, lam=cfg.algorithm.lam,
                               norm_by_std=cfg.algorithm.norm_adv_by_std, whiten=cfg.algorithm.whiten_advantages,
                               turn_gamma=cfg.algorithm.turn_gamma),
        values=batch.batch["values"] if "values" in batch else None,
        baseline_rewards=batch.batch["baseline_rewards"] if "baseline_rewards" in batch else None, **unscorable)
    batch.batch["advantages"] = advantages
    batch.batch["returns"] = returns
    return batch


def dataset_options(cfg: RLConfig) -> dict:
    data = cfg.data
    return dict(prompt_key=data.prompt_key, answer_key=data.answer_key, prompt_template=data.prompt_template,
                max_prompt_length=data.max_prompt_length, overlong=data.overlong, bad_rows=data.bad_rows,
                image_key=data.image_key, min_pixels=data.min_pixels, max_pixels=data.max_pixels,
                resize_images=data.resize_images, video_key=data.video_key, video_fps=data.video_fps,
                video_max_frames=data.video_max_frames, video_min_pixels=data.video_min_pixels,
                video_max_pixels=data.video_max_pixels, audio_key=data.audio_key)


class RLTrainer(RunLoop):
    writes_report = True

    def __init__(self, cfg: RLConfig, model_path: str, tokenizer, train_files: list[str], val_files: list[str],
                 run_dir: Path, datasets: dict | None = None):
        """`datasets`: "train" (and "val") already built from these files with dataset_options(cfg) (the pre-Ray
        checks, rlframe/preflight.py); built here when absent."""
        super().__init__(cfg, model_path, tokenizer, run_dir)
        datasets = datasets or {}
        self.train_set = datasets["train"] if "train" in datasets else RLDataset(train_files, tokenizer,
                                                                                  **dataset_options(cfg))
        if cfg.trainer.total_epochs:  # epochs (verl/EasyR1) -> steps, from the dataset's size
            cfg.trainer.total_steps = cfg.trainer.total_epochs * max(1, len(self.train_set) // cfg.data.train_batch_size)
            logger.info("trainer.total_epochs=%d: %d steps", cfg.trainer.total_epochs, cfg.trainer.total_steps)
        register_configured_plugins(to_container(cfg)["algorithm"])  # user estimator/loss files, before workers
        self.launch_workers_in_background()  # the configuration is final: the workers start while the rest is set up
        try:
            self.val_set = None if not val_files else (
                datasets["val"] if "val" in datasets else RLDataset(val_files, tokenizer, **dataset_options(cfg)))
            self.scorer = Scorer(cfg, tokenizer, self.clock)
            self.scorer.judge = build_judge(cfg, run_dir, lambda: judge_engine_settings(cfg))  # None without reward.judge
            self.plan_run(cfg.trainer.total_steps)
            self.rollouts = RolloutSource(cfg, self.train_set, self.scorer, self.clock, model_path, self.pad_token_id)
            self.on_policy_update = skips_old_log_prob_pass(cfg)  # the old log-probs are the update's first forward
            self.kl_ctrl = algorithm_steps.make_kl_controller(cfg)
            self.model_shape = read_shape(model_path)  # for perf/mfu (rlframe/trainer/perf.py)
            self.peak_tflops, self.devices = perf.device_peak(cfg)
            self.trained_batch: DataProto | None = None  # the last step's batch, for its throughput metrics
            self.gates = Gates(cfg.trainer.gates, run_dtype(cfg.model.dtype, plans_gpu(cfg)), run_dir)
        except BaseException:
            self.abandon_launch()
            if self.scorer is not None:
                self.scorer.close()
            raise
        self.launch_workers()

    def start_workers(self):
        return start_workers(self.cfg, self.model_path)

    def workers_started(self) -> None:
        self.scorer.reward_model = self.workers.reward_model
        self.rollouts.attach(self.actor_rollout, engines_record_versions=self.workers.disaggregated)

    # ------------------------------------------------------------------ one step
    def train_step(self, step: int) -> dict[str, float]:
        cfg, clock, timeouts = self.cfg, self.clock, self.cfg.trainer.timeouts
        batch, reward_metrics, scores = self.rollouts.next(step)
        if cfg.trainer.balance_batch:
            self.balance_across_ranks(batch, scores)
        if not self.on_policy_update:
            with clock.timed("old_log_prob"):
                batch = batch.union(self.actor_rollout.compute_log_prob(batch, _timeout=timeouts.log_prob))
        if self.ref is not None:
            with clock.timed("ref_log_prob"):
                batch = batch.union(self.ref.compute_ref_log_prob(batch, _timeout=timeouts.log_prob))
        if self.workers.teacher is not None:
            batch = self.compute_teacher_log_prob(batch)
        if self.critic is not None:
            with clock.timed("values"):
                batch = batch.union(self.critic.compute_values(batch, _timeout=timeouts.log_prob))
        reward_metrics.update(self.scorer.join(batch, scores))
        kl_metrics = algorithm_steps.token_level_rewards(batch, self.kl_ctrl, cfg.algorithm.kl_penalty)
        with clock.timed("advantage"):
            batch = compute_advantage(batch, cfg)
        if cfg.trainer.dump_rollouts:
            dump_rollouts(self.run_dir / "rollouts.jsonl", step, batch, self.scorer)
        train_metrics = {}
        if self.critic is not None:
            with clock.timed("update_critic"):
                train_metrics.update(self.critic.update_critic(batch, _timeout=timeouts.update).meta_info["metrics"])
        actor_moves = step > cfg.trainer.critic_warmup  # PPO: the first critic_warmup steps train only the critic
        if actor_moves:
            with clock.timed("update"):
                train_metrics.update(self.actor_rollout.update_actor(batch, _timeout=timeouts.update).meta_info["metrics"])
            self.rollouts.policy_updated()
        train_metrics.update(self.rollouts.sync_weights(updated=actor_moves))
        self.trained_batch = batch
        metrics = {**reward_metrics, **kl_metrics, **train_metrics, **batch_metrics(batch)}
        if cfg.trainer.gates.enable:
            metrics.update(self.check_gates(step, batch, metrics))
        return metrics

    def compute_teacher_log_prob(self, batch: DataProto) -> DataProto:
        """The teacher's log-probs of the sampled tokens and its top-k (rlframe/config/teacher.py); for
        reverse_kl_student_topk first the student's top-k ids, which the teacher then scores."""
        timeout = self.cfg.trainer.timeouts.log_prob
        if self.cfg.distillation.loss_mode in NEEDS_STUDENT_TOPK:
            with self.clock.timed("student_topk"):
                batch = batch.union(self.actor_rollout.compute_student_topk(batch, _timeout=timeout))
        with self.clock.timed("teacher_log_prob"):
            return batch.union(self.workers.teacher.compute_teacher_log_prob(batch, _timeout=timeout))

    def check_gates(self, step: int, batch: DataProto, metrics: dict[str, float]) -> dict[str, float]:
        """The gates' signals and verdicts (gates/<name>); a `stop` gate logs the step's metrics, then raises."""
        check = self.rollouts.last_sync_check
        signals = {**step_signals(batch), **sync_check_metrics(check)}
        try:
            return {**signals, **self.gates.check(step, {**metrics, **signals}, check)}
        except GateStopped:  # the step's metrics and the report still reach the run directory
            self.tracker.log(step, {**metrics, **signals})
            try:
                from rlframe.report import write_report

                write_report(self.run_dir)
            except Exception as error:  # (the gate's own message matters more)
                logger.warning("could not write the run report: %s: %s", type(error).__name__, error)
            raise

    def balance_across_ranks(self, batch: DataProto, scores) -> None:
        """Reorder the rows so that each rank's chunk holds a near-equal number of tokens (the pending scores follow)."""
        order = balanced_order(batch, self.cfg.actor.world_size)
        if order is not None:
            batch.reorder(order)
            scores.reorder(order)

    def step_extras(self, metrics: dict[str, float]) -> dict[str, float]:
        """Throughput (perf/*: tokens per second, MFU) and each role's peak memory."""
        batch, times = self.trained_batch, self.clock.times
        generated = metrics.get("partial/generated_tokens", float(batch.batch["response_mask"].sum()))
        extras = {"perf/generated_tokens_per_s": generated / max(times["rollout"] + times.get("rollout_rounds", 0.0), 1e-9)}
        forward_passes = sum(phase in times for phase in ("old_log_prob", "ref_log_prob", "values", "teacher_log_prob",
                                                          "student_topk"))
        trained_passes = sum(phase in times for phase in ("update", "update_critic"))
        extras.update(perf.step_perf(self.model_shape, batch.batch["attention_mask"], batch.batch["response_mask"],
                                     times, metrics["timing/step"], forward_passes, trained_passes,
                                     self.peak_tflops, self.devices, samples_per_prompt=self.cfg.rollout.n))
        extras.update(perf.peak_memory_metrics(self.workers.memory_peaks()))
        return extras

    # ------------------------------------------------------------------ validation and driver state
    def validate(self) -> dict[str, float]:
        return self.validate_by_generation()

    def has_validation(self) -> bool:
        return bool(self.val_set)

    def driver_state(self) -> dict:
        return {**self.rollouts.state_dict(), "kl_coef": getattr(self.kl_ctrl, "value", None),
                "gates": self.gates.state_dict()}

    def before_restore(self, ckpt) -> None:
        self.rollouts.before_restore(None if ckpt is None else ckpt.step)

    def load_driver_state(self, state: dict) -> None:
        if state.get("kl_coef") is not None and self.kl_ctrl is not None:
            self.kl_ctrl.value = float(state["kl_coef"])  # the adaptive controller's beta
        self.rollouts.load_state_dict(state)
        if "gates" in state:
            self.gates = Gates(self.cfg.trainer.gates, self.gates.dtype, self.run_dir)
            self.gates.load_state_dict(state["gates"])

    def begin(self, start_step: int) -> None:
        self.rollouts.reset(start_step)

    def end(self) -> None:
        self.rollouts.end()


def balanced_order(batch: DataProto, world_size: int) -> list[int] | None:
    """A row order that gives each rank's contiguous chunk a near-equal number of tokens (None: keep)."""
    if world_size == 1 or len(batch) % world_size:
        return None
    lengths = batch.batch["attention_mask"].sum(-1).tolist()
    groups = balanced_equal_size_partition(lengths, world_size)
    return [i for group in groups for i in group]


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


def dump_rollouts(path: Path, step: int, batch: DataProto, scorer: Scorer) -> None:
    """trainer.dump_rollouts: one line per trained sample (step, uid, response, score, scorable, advantage) to
    <run_dir>/rollouts.jsonl, as verl's rollout_data_dir: what the update saw, for a reader or a test."""
    import json

    mask = batch.batch["response_mask"]
    first = mask.float().argmax(-1)  # an outcome estimator's advantage is the same on every token of a response
    advantages = batch.batch["advantages"][range(len(batch)), first].tolist()
    scores = (batch.batch["token_level_scores"] * mask).sum(-1).tolist()
    scorable = batch.batch["scorable"].tolist() if "scorable" in batch else [True] * len(batch)
    uids = batch.non_tensor_batch.get("uid", [None] * len(batch))
    with open(path, "a") as f:
        for i, text in enumerate(scorer.decode(batch)):
            f.write(json.dumps({"step": step, "uid": None if uids[i] is None else str(uids[i]), "response": text,
                                "score": scores[i], "scorable": bool(scorable[i]), "advantage": advantages[i],
                                "response_tokens": int(mask[i].sum())}) + "\n")
