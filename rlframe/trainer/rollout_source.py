"""The rollout source: where each RL step's batch of scored samples comes from.

    batch, metrics, scores = rollouts.next(step)     # train_batch_size prompts x rollout.n samples
    ...                                               # the step trains on it
    rollouts.sync_weights(updated)                    # the new policy -> the engines

`next` hides how the samples are made:
- synchronous: draw the prompts, generate, start scoring (rollout_batch);
- trainer.async_rollout: the next max_staleness steps' generations run on the engines while this step
  trains (launch_ahead); with max_staleness >= 2 the weights are staged and the engines load them after
  the generations already sent (stage_weights);
- rollout.partial: responses generated a budget at a time across steps (trainer/partial.py);
- DAPO's dynamic sampling: more rounds until the batch holds train_batch_size informative groups;
- ReMax: one greedy sample per prompt, scored, as the baseline.
It owns the prompt sampler (its checkpointed position) and the policy version (actor updates applied).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from rlframe.algos.plugins import configured_estimator_needs
from rlframe.config import RLConfig
from rlframe.data.dataset import RLDataset, collate_prompts
from rlframe.data.sampler import StatefulSampler
from rlframe.protocol import DataProto
from rlframe.rng import sample_seeds
from rlframe.trainer import algorithm_steps
from rlframe.trainer.agent_metrics import agent_metrics
from rlframe.trainer.partial import pool_from_config
from rlframe.trainer.phases import PhaseClock
from rlframe.trainer.scorer import PendingScores, Scorer, shape_overlong
from rlframe.trainer.validation import split_prompts


class PendingRollout:
    """One step's generation in flight: the prompts' rows, the engines' Future, the sampler's state before
    the prompts were drawn (what a checkpoint saves while it is in flight), when it started, and ReMax's
    greedy baseline [B] (None for other estimators)."""

    def __init__(self, step: int, batch: DataProto | None, generation, sampler_state: dict, started: float,
                 baseline: torch.Tensor | None = None):
        self.step, self.batch, self.generation = step, batch, generation
        self.sampler_state, self.started, self.baseline = sampler_state, started, baseline
        self.result: DataProto | None = None
        self.span: tuple[float, float] | None = None  # (start, end) of the generation, when run ahead
        self.partial: tuple[list, int] | None = None  # partial rollouts: (the samples sent, the engines' version)
        self.partial_drawn: list[str] = []  # partial rollouts: the uids of the prompts drawn for it
        self.rounds_span: tuple[float, float] | None = None  # partial rollouts: (start, end) of the rounds after it
        self.metrics: dict[str, float] = {}  # partial rollouts: partial/*


class RolloutSource:
    def __init__(self, cfg: RLConfig, train_set: RLDataset, scorer: Scorer, clock: PhaseClock, model_path: str,
                 pad_token_id: int):
        self.cfg, self.train_set, self.scorer, self.clock, self.pad_token_id = cfg, train_set, scorer, clock, pad_token_id
        data = cfg.data
        self.sampler = StatefulSampler(len(train_set), data.train_batch_size, shuffle=data.shuffle, seed=data.seed)
        self.batches = self.sampler.forever()
        # trainer.async_rollout: generation runs this many steps ahead of the update (0: as the synchronous loop)
        self.async_depth = cfg.trainer.max_staleness if cfg.trainer.async_rollout else 0
        self.ahead: list[PendingRollout] = []  # the next steps' generations, in flight on the engines (oldest first)
        self.weight_loads: list = []  # max_staleness >= 2: the engines' loads of staged weights, queued (Futures)
        self.policy_version = 0  # actor updates applied so far: the version of the trainer's weights
        # rollout.partial: responses generated a budget at a time across steps (rlframe/trainer/partial.py)
        self.partial = pool_from_config(cfg, model_path)
        self.staleness_bound = cfg.rollout.partial.max_token_staleness if self.partial else self.async_depth
        self.greedy_baseline_needed = configured_estimator_needs(cfg.algorithm).greedy_baseline  # ReMax
        self.engines = None
        self.engines_record_versions = False
        self.last_sync_check: dict | None = None  # the last sync's checksum report (workers/weight_broadcast.py)

    def attach(self, actor_rollout, engines_record_versions: bool) -> None:
        """The handle that generates (and syncs weights); whether its engines record the weights' version
        (disaggregated engines do)."""
        self.engines, self.engines_record_versions = actor_rollout, engines_record_versions

    # ------------------------------------------------------------------ what the loop calls
    def reset(self, start_step: int) -> None:
        """A (re)start after `start_step` steps: nothing in flight, the version of the restored weights."""
        self.ahead, self.weight_loads, self.policy_version = [], [], self.updates_after(start_step)

    def next(self, step: int) -> tuple[DataProto, dict[str, float], PendingScores]:
        """The step's batch, its metrics and its scores (pending with reward.overlap: Scorer.join adds them);
        with trainer.async_rollout the engines start on the next step(s) now."""
        batch, metrics, scores = self.rollout_batch(step)
        if self.async_depth and step < self.cfg.trainer.total_steps:
            self.launch_ahead(step)
        metrics.update(self.staleness_metrics(batch))
        return batch, metrics, scores

    def policy_updated(self) -> None:
        self.policy_version += 1

    def sync_weights(self, updated: bool) -> dict[str, float]:
        """After the update: the engines finish what they generate ahead (they must be idle before they receive
        weights, unless staged), then receive the new weights when the actor moved. weight_sync/* metrics."""
        if self.async_depth < 2:
            self.finish_generation_ahead()
        self.last_sync_check = None
        if not updated:
            return {}
        timeouts = self.cfg.trainer.timeouts
        with self.clock.timed("weight_sync"):
            if self.async_depth >= 2:  # staged: the engines load them after the generations already sent
                sync = self.stage_weights()
            else:
                sync = self.engines.sync_weights(_timeout=timeouts.weight_sync, **self.version_arg(),
                                                 **self.checksum_arg())[0]
        metrics = {"weight_sync/seconds": sync["timing/weight_sync_s"]}
        if "weight_sync/bytes" in sync:
            metrics["weight_sync/bytes"] = float(sync["weight_sync/bytes"])
        self.last_sync_check = sync.get("weight_sync/check")  # what the sync did to the engine (the weight_sync gate)
        return metrics

    def checksum_arg(self) -> dict:
        """Colocated engines compare their weights with the trainer's after each sync (trainer.gates: the
        weight_sync gate); the broadcast to disaggregated engines does not check yet."""
        gates = self.cfg.trainer.gates
        if self.engines_record_versions or not gates.enable or gates.weight_sync == "off":
            return {}
        return {"checksum": True}

    def end(self) -> None:
        """Surface any failed load of staged weights, waiting for every queued one."""
        self.check_weight_loads(wait=True)

    def state_dict(self) -> dict:
        """The sampler's position (before the prompts of a generation in flight: they are drawn again after a
        resume) and the partial pool's held-back responses (not the groups of a generation in flight)."""
        state = {"sampler": self.ahead[0].sampler_state if self.ahead else self.sampler.state_dict()}
        if self.partial is not None:
            state["partial_pool"] = self.partial.state_dict(
                exclude={uid for pending in self.ahead for uid in pending.partial_drawn})
        return state

    def before_restore(self, step: int | None) -> None:
        """Before the workers load a checkpoint of `step` (None: a fresh start)."""
        if self.partial is not None:
            self.partial.groups.clear()
        if step is not None and self.engines_record_versions:  # the engines record the restored version
            self.engines.policy_version = self.updates_after(step)

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state["sampler"])
        self.batches = self.sampler.forever()
        if self.partial is not None and "partial_pool" in state:
            self.partial.load_state_dict(state["partial_pool"])

    # ------------------------------------------------------------------ one step's samples
    def rollout_batch(self, step: int) -> tuple[DataProto, dict[str, float], PendingScores]:
        """A batch of train_batch_size prompts x n samples, its metrics, and its scores.

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
            metrics.update(self.scorer.join(batch, scores))
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
                with self.clock.timed("rollout_wait"):
                    batch = self.take_generation(pending)
                self.check_weight_loads()
                generating = pending.result.meta_info.get("timing/generate_rank0", 0.0)
                pending.span = (pending.started, pending.started + generating)  # (from its launch; it may have queued)
            else:
                batch = self.take_generation(pending)
            self.clock.record("rollout", *pending.span)  # (it ran during the previous step)
            if pending.rounds_span is not None:  # partial rollouts: the rounds after the first, run now
                self.clock.record("rollout_rounds", *pending.rounds_span)
        else:
            pending = self.start_generation(step)
            batch = self.take_generation(pending)
            self.clock.record("rollout", pending.started, time.perf_counter())
        scores = self.scorer.start(batch, overlap)
        metrics = dict(pending.metrics)
        if cfg.rollout.multi_turn.enable or cfg.rollout.agent_program.enabled:
            metrics.update(agent_metrics(batch.non_tensor_batch, batch.batch["response_mask"],
                                         batch.batch["attention_mask"]))
        if pending.baseline is not None:
            batch.batch["baseline_rewards"] = pending.baseline.repeat_interleave(cfg.rollout.n)
            metrics["reward/greedy_baseline_mean"] = float(pending.baseline.nanmean())  # (NaN: unscored by a judge)
        return batch, metrics, scores

    def next_prompts(self) -> DataProto:
        position = self.sampler.state_dict()  # (epoch, batch) names the prompts: uids replay on resume
        indices = next(self.batches)
        batch = collate_prompts([self.train_set[i] for i in indices], self.pad_token_id)
        uids = [f"e{position['epoch']}b{position['position']}-{i}" for i in range(len(indices))]
        batch.non_tensor_batch["uid"] = np.array(uids, dtype=object)
        return batch

    def start_generation(self, step: int) -> PendingRollout:
        """Draw the step's prompts and send them to the engines (+ ReMax's greedy baseline, generated here)."""
        cfg, timeouts = self.cfg, self.cfg.trainer.timeouts
        if self.partial is not None:
            return self.start_partial_generation(step)
        sampler_state = self.sampler.state_dict()
        batch = self.next_prompts()
        batch.meta_info["step"] = step
        prompts = split_prompts(batch, cfg)
        baseline = self.greedy_baseline(batch, prompts) if self.greedy_baseline_needed else None
        prompts = prompts.repeat(cfg.rollout.n, interleave=True)
        batch = batch.repeat(cfg.rollout.n, interleave=True)
        if cfg.rollout.seed_each_sample:  # sampling independent of the engine's RNG history: exact resume
            prompts.non_tensor_batch["sample_seed"] = sample_seeds(cfg.trainer.seed, step, batch.non_tensor_batch["uid"])
        # The engine's next use is the weight load after this step's update (one rollout round, the actor
        # trains this step): on GPU it may discard its weights while it sleeps (vLLM sleep level 2).
        prompts.meta_info["update_follows"] = not cfg.algorithm.dynamic_sampling.enable and step > cfg.trainer.critic_warmup
        started = time.perf_counter()
        generation = self.engines.generate_sequences(prompts, _blocking=False, _timeout=timeouts.rollout)
        return PendingRollout(step, batch, generation, sampler_state, started, baseline)

    def take_generation(self, pending: PendingRollout) -> DataProto:
        """The prompts' rows joined with what the engines generated for them (waits for it)."""
        if self.partial is not None:
            return self.take_partial_generation(pending)
        if pending.result is None:
            with self.clock.naming_failures("rollout", pending.step):
                pending.result = pending.generation.result()
        return pending.batch.union(pending.result)

    def greedy_baseline(self, batch: DataProto, prompts: DataProto) -> torch.Tensor:
        """ReMax: the score of one greedy response per prompt, [B], shaped like the samples it is compared with."""
        greedy_prompts = prompts.select(meta_info_keys=[])
        greedy_prompts.meta_info["greedy"] = True
        with self.clock.timed("rollout_greedy"):
            greedy = batch.select(batch_keys=[]).union(
                self.engines.generate_sequences(greedy_prompts, _timeout=self.cfg.trainer.timeouts.rollout))
        greedy, _ = self.scorer.score(greedy)
        shape_overlong(greedy, self.cfg)
        baseline = greedy.batch["token_level_scores"].sum(-1)
        if "scorable" in greedy.batch:  # a judge gave the greedy response no verdict: its prompt has no baseline
            baseline = torch.where(greedy.batch["scorable"], baseline, torch.full_like(baseline, float("nan")))
        return baseline

    # ------------------------------------------------------------------ generation ahead (trainer.async_rollout)
    def finish_generation_ahead(self) -> None:
        """Wait until the engines have generated the next step's batch (they must be idle before they receive
        weights). timing/rollout_wait: the driver's wait; the generation's own span (from its start, in the
        previous step) goes to the next step's timeline as `rollout`."""
        pending = self.ahead[0] if self.ahead else None
        if pending is None or pending.result is not None or pending.generation is None:
            return
        with self.clock.timed("rollout_wait"):
            with self.clock.naming_failures("rollout", pending.step):
                pending.result = pending.generation.result()
        generating = pending.result.meta_info.get("timing/generate_rank0", time.perf_counter() - pending.started)
        pending.span = (pending.started, pending.started + generating)

    def launch_ahead(self, step: int) -> None:
        """Keep the generations of steps step+1 .. step+max_staleness in flight (each sent once, in order; the
        engines run them one after another)."""
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
        sync, loading = self.engines.stage_weights(self.policy_version, _timeout=timeouts.weight_sync,
                                                   _load_timeout=queued)
        self.weight_loads.append(loading)
        return sync

    def check_weight_loads(self, wait: bool = False) -> None:
        """Surface a failed load of staged weights (max_staleness >= 2); with `wait`, wait for every queued one."""
        while self.weight_loads and (wait or self.weight_loads[0].done()):
            with self.clock.naming_failures("weight_sync"):
                self.weight_loads.pop(0).result()

    def updates_after(self, step: int) -> int:
        """The actor updates applied after `step` steps (the first trainer.critic_warmup steps update none)."""
        return max(0, step - self.cfg.trainer.critic_warmup)

    def version_arg(self) -> dict:
        """Disaggregated engines record the version of the weights they receive."""
        return {"policy_version": self.policy_version} if self.engines_record_versions else {}

    def staleness_metrics(self, batch: DataProto) -> dict[str, float]:
        """async/staleness_{max,mean}: the trainer's version - the version of the weights that generated each sample
        (recorded by disaggregated engines; with partial rollouts its oldest token's); with trainer.async_rollout never
        above trainer.max_staleness (rollout.partial.max_token_staleness with partial rollouts)."""
        if "policy_version" not in batch.non_tensor_batch:
            return {}
        versions = batch.non_tensor_batch["policy_version"].astype(np.int64)
        staleness = self.policy_version - versions
        if int(staleness.max()) > self.staleness_bound or int(staleness.min()) < 0:
            raise RuntimeError(f"step {self.clock.step}: samples of policy versions {sorted(set(versions.tolist()))} "
                               f"for a trainer at version {self.policy_version}: staleness outside "
                               f"[0, {self.staleness_bound}]")
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
        generation = self.engines.generate_sequences(
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
                with self.clock.naming_failures("rollout", step):
                    pending.result = pending.generation.result()
            samples, version = pending.partial
            pool.absorb(samples, pending.result, version, step)
        max_rounds = -(-pool.response_length // pool.budget) + 1
        start = time.perf_counter()
        for round_index in range(1, max_rounds + 1):
            if len(pool.ready_groups()) >= pool.batch_size:
                break
            samples = pool.unfinished()
            with self.clock.naming_failures("rollout", step):
                generated = self.engines.generate_sequences(pool.requests(samples, step, round_index),
                                                            _timeout=self.cfg.trainer.timeouts.rollout)
            pool.absorb(samples, generated, self.policy_version, step)
            pending.rounds_span = (start, time.perf_counter())
        batch, pending.metrics = pool.take_batch(train_version=self.policy_version, step=step)
        batch.meta_info["step"] = step
        return batch
