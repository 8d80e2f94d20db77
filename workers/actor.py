"""The policy trainer inside an actor worker: log-probs and PPO-style updates on one rank.

`PolicyModel` owns one (possibly FSDP-sharded) HF causal LM. With an optimizer it is the actor;
without, it is the frozen reference policy. All arithmetic of the losses lives in `rlframe.algos`;
this module only moves micro-batches through the model and the optimizer.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from rlframe.algos import PolicyLossConfig, agg_loss, get_policy_loss, kl_penalty
from rlframe.algos.batching import split_by_token_budget
from rlframe.device import DeviceProfile
from rlframe.protocol import DataProto
from rlframe.workers.model import build_causal_lm, forward_response_log_probs, needs_sharding, shard_model
from rlframe.workers.sequence_parallel import SequenceParallelGroup, gather_rows

MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids", "responses")


@dataclass
class UpdateSettings:
    """What `PolicyModel.update` needs from the config (plain fields: workers never see the trainer)."""

    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = 0
    grad_clip: float = 1.0
    mini_batch_size: int = 8  # sequences per optimiser step, on this rank
    micro_batch_size: int = 4  # sequences per forward/backward
    epochs: int = 1
    shuffle: bool = True
    policy_loss: str = "vanilla"
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.28
    clip_ratio_c: float = 3.0
    loss_agg_mode: str = "token-mean"
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.0
    kl_loss_type: str = "low_var_kl"
    max_consecutive_skips: int = 3
    max_tokens_per_micro_batch: int = 0  # > 0: dynamic micro-batches by token budget instead of a fixed count


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _all_reduce_sum(value: float) -> float:
    if _world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t.item())


def micro_batch_indices(data: DataProto, micro_batch_size: int, max_tokens: int = 0) -> list[list[int]]:
    """Rows of each micro-batch: a fixed count, or (max_tokens > 0) at most max_tokens real tokens each.

    Fixed-count micro-batches take the rows in order of length, so rows of similar length share a
    micro-batch and less compute goes to padding (the loss normalisers are global, so the grouping
    does not change the gradient).
    """
    lengths = data.batch["attention_mask"].sum(-1).tolist()
    if max_tokens <= 0:
        by_length = sorted(range(len(data)), key=lambda i: lengths[i])
        return [sorted(by_length[i:i + micro_batch_size]) for i in range(0, len(data), micro_batch_size)]
    groups = split_by_token_budget(lengths, max_tokens)
    # Sharded models run collectives in every forward: all ranks need the same number of micro-batches.
    target = _all_reduce_max(len(groups))
    while len(groups) < target:
        largest = max(groups, key=len)
        if len(largest) < 2:
            raise ValueError(f"cannot make {target} micro-batches from {len(data)} rows on this rank")
        groups.remove(largest)
        groups += [largest[: len(largest) // 2], largest[len(largest) // 2:]]
    return groups


def global_agg_kwargs(mini: DataProto, mode: str, horizon: int, replicas: int = 1) -> dict:
    """`agg_loss` keyword args with the token / sequence counts of the WHOLE mini-batch over all ranks.

    With these normalisers, summing micro-batch losses (and gradients over ranks) gives the loss of
    the global mini-batch, however it was split. `replicas`: how many ranks hold each row (the
    sequence-parallel size), so that no row is counted twice.
    """
    mask = mini.batch["response_mask"]
    return {"mode": mode, "num_tokens": _all_reduce_sum(float(mask.sum())) / replicas,
            "num_seqs": _all_reduce_sum(float((mask.sum(-1) > 0).sum())) / replicas, "horizon": horizon}


class MetricSums:
    """Running per-key sums and counts of the scalars an update records; `means()` at the end."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.counts: dict[str, int] = {}

    def record(self, key: str, value: float) -> None:
        self.sums[key] = self.sums.get(key, 0.0) + value
        self.counts[key] = self.counts.get(key, 0) + 1

    def means(self) -> dict[str, float]:
        return {k: self.sums[k] / self.counts[k] for k in self.sums}


def _all_reduce_max(value: int) -> int:
    if _world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


class PolicyModel:
    def __init__(self, model_path: str, profile: DeviceProfile, *, train: UpdateSettings | None = None,
                 gradient_checkpointing: bool = False, offload_params: bool = False,
                 offload_optimizer: bool = False, trust_remote_code: bool = False, packed: bool = False,
                 sequence_parallel_size: int = 1):
        self.profile = profile
        # Ulysses: the ranks of an SP group train on the union of their chunks, each on 1/P of every row.
        self.sp = SequenceParallelGroup.create(sequence_parallel_size) if sequence_parallel_size > 1 else None
        self.packed = packed or self.sp is not None
        self.device = torch.device(profile.device)
        # fp32 master weights; on GPU, FSDP's mixed precision computes in bf16.
        master_dtype = torch.float32 if (train is not None or not profile.is_gpu) else profile.dtype
        self.model = build_causal_lm(model_path, profile, gradient_checkpointing=gradient_checkpointing and train is not None,
                                     trust_remote_code=trust_remote_code, dtype=master_dtype, packed=self.packed,
                                     sequence_parallel=self.sp is not None)
        if self.sp is not None and self.model.config.num_attention_heads % self.sp.size:
            raise ValueError(f"actor.ulysses_sequence_parallel_size={self.sp.size} must divide the model's "
                             f"{self.model.config.num_attention_heads} attention heads")
        if profile.is_gpu and not offload_params:
            self.model.to(self.device)
        self.sharded = needs_sharding(profile)
        if self.sharded:
            shard_model(self.model, profile, offload_params=offload_params)
        self.train_settings = train
        self.offload_optimizer = offload_optimizer and profile.is_gpu
        self.optimizer_steps = 0
        self.consecutive_skips = 0
        if train is None:
            self.model.eval()
            self.model.requires_grad_(False)
            self.optimizer = None
        else:
            self.model.train()
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=train.lr, betas=tuple(train.betas),
                                               weight_decay=train.weight_decay)
            warmup = max(train.warmup_steps, 0)
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(
                self.optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0)

    # ------------------------------------------------------------------ log-probs
    def _model_inputs(self, micro: DataProto) -> dict[str, torch.Tensor]:
        return {k: micro.batch[k].to(self.device) for k in ("input_ids", "attention_mask", "position_ids")}

    @torch.no_grad()
    def compute_log_prob(self, data: DataProto, micro_batch_size: int, temperature: float = 1.0,
                         with_entropy: bool = False, max_tokens: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
        was_training = self.model.training
        self.model.eval()
        own_rows = slice(0, len(data))
        if self.sp is not None:
            data, own_rows = gather_rows(data, self.sp)
        response_width = data.batch["responses"].size(1)
        log_probs, entropies, order = [], [], []
        for indices in micro_batch_indices(data, micro_batch_size, max_tokens):
            micro = data[indices]
            order += indices
            lp, ent = forward_response_log_probs(self.model, **self._model_inputs(micro), response_width=response_width,
                                                 temperature=temperature, with_entropy=with_entropy, packed=self.packed,
                                                 sp=self.sp)
            log_probs.append(lp.cpu())
            if ent is not None:
                entropies.append(ent.cpu())
        self.model.train(was_training)
        restore = torch.argsort(torch.tensor(order))  # back to the input row order
        log_probs = torch.cat(log_probs)[restore][own_rows]
        return log_probs, (torch.cat(entropies)[restore][own_rows] if with_entropy else None)

    # ------------------------------------------------------------------ update
    def update(self, data: DataProto, temperature: float = 1.0, seed: int = 0) -> dict[str, float]:
        """PPO-style update: for each epoch and mini-batch, accumulate micro-batch gradients, clip, step.

        Loss normalisers (tokens, sequences) are counted over the whole mini-batch on every rank, so
        the summed micro-batch losses equal the loss of the global mini-batch; FSDP averages
        gradients over ranks, so each rank scales its loss by the world size to get the sum.
        """
        cfg = self.train_settings
        assert cfg is not None and self.optimizer is not None, "update() on a model built without train settings"
        loss_fn = get_policy_loss(cfg.policy_loss)
        loss_cfg = PolicyLossConfig(clip_ratio_low=cfg.clip_ratio_low, clip_ratio_high=cfg.clip_ratio_high,
                                    clip_ratio_c=cfg.clip_ratio_c)
        world = _world_size()
        replicas = self.sp.size if self.sp is not None else 1
        if self.sp is not None:
            data, _ = gather_rows(data, self.sp)
        mini_batch_size = cfg.mini_batch_size * replicas
        response_width = data.batch["responses"].size(1)
        recorded = MetricSums()
        record = recorded.record

        # On-policy shortcut: with one epoch and one mini-batch, every forward below runs before the
        # only optimiser step, so the current log-probs ARE the old log-probs (no extra pass needed).
        on_policy = "old_log_probs" not in data.batch.keys()
        if on_policy and (cfg.epochs != 1 or mini_batch_size < len(data)):
            raise ValueError("update without old_log_probs is only exact for one epoch and one mini-batch "
                             f"(epochs={cfg.epochs}, mini-batch {mini_batch_size} < batch {len(data)}). "
                             "Fix: compute old log-probs first (actor.skip_old_log_prob_when_on_policy=false).")
        drift_sum = drift_tokens = 0.0
        start = time.perf_counter()
        tokens_trained = 0
        for epoch in range(cfg.epochs):
            for mini_index, mini in enumerate(data.mini_batches(mini_batch_size, shuffle=cfg.shuffle,
                                                                seed=seed * 1000 + epoch)):
                agg = global_agg_kwargs(mini, cfg.loss_agg_mode, response_width, replicas)
                self.optimizer.zero_grad(set_to_none=True)
                first_bad = None  # where the loss first went non-finite in this mini-batch
                for micro_index, indices in enumerate(
                        micro_batch_indices(mini, cfg.micro_batch_size, cfg.max_tokens_per_micro_batch)):
                    micro = mini[indices]
                    micro_mask = micro.batch["response_mask"].to(self.device)
                    tokens_trained += int(micro.batch["attention_mask"].sum())
                    log_prob, entropy = forward_response_log_probs(
                        self.model, **self._model_inputs(micro), response_width=response_width,
                        temperature=temperature, with_entropy=cfg.entropy_coeff != 0, packed=self.packed, sp=self.sp)
                    if on_policy:
                        old_log_prob = log_prob.detach()
                        if "rollout_log_probs" in micro.batch.keys():
                            drift = (micro.batch["rollout_log_probs"].to(self.device) - old_log_prob).abs() * micro_mask
                            drift_sum += float(drift.sum())
                            drift_tokens += float(micro_mask.sum())
                    else:
                        old_log_prob = micro.batch["old_log_probs"].to(self.device)
                    pg_loss, pg_metrics = loss_fn(old_log_prob, log_prob,
                                                  micro.batch["advantages"].to(self.device), micro_mask,
                                                  config=loss_cfg, agg=agg)
                    loss = pg_loss
                    if cfg.use_kl_loss:
                        kl = kl_penalty(log_prob, micro.batch["ref_log_prob"].to(self.device), cfg.kl_loss_type)
                        kl_loss = agg_loss(kl, micro_mask, **agg)
                        loss = loss + cfg.kl_loss_coef * kl_loss
                        record("actor/kl_loss", kl_loss.item())
                    if entropy is not None:
                        entropy_loss = agg_loss(entropy, micro_mask, **agg)
                        loss = loss - cfg.entropy_coeff * entropy_loss
                        record("actor/entropy", entropy_loss.item())
                    if first_bad is None and not torch.isfinite(loss.detach()):
                        first_bad = (f"epoch {epoch}, mini-batch {mini_index}, micro-batch {micro_index} "
                                     f"(rows {indices} of the mini-batch; pg_loss={pg_loss.item()}, loss={loss.item()})")
                    (loss * world).backward()
                    record("actor/pg_loss", pg_loss.item())
                    for key, value in pg_metrics.items():
                        record(f"actor/{key}", float(value))
                grad_norm = self._clip_and_step(cfg.grad_clip, first_bad)
                record("actor/grad_norm", grad_norm)
        metrics = recorded.means()
        # Loss terms were computed against global normalisers: summing over micro-batches and
        # ranks gives the mini-batch loss; the per-step figure is the mean over mini-batches.
        n_minis = max(recorded.counts.get("actor/grad_norm", 1), 1)
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy"):
            if key in recorded.sums:
                metrics[key] = _all_reduce_sum(recorded.sums[key]) / n_minis / replicas
        for key in list(metrics):
            if key not in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm"):
                metrics[key] = _all_reduce_sum(metrics[key]) / world
        if on_policy and drift_tokens:
            metrics["rollout/logprob_abs_diff"] = _all_reduce_sum(drift_sum) / max(_all_reduce_sum(drift_tokens), 1.0)
        metrics["actor/lr"] = self.scheduler.get_last_lr()[0]
        metrics["actor/skipped_updates"] = float(self.consecutive_skips)
        metrics["perf/train_tokens_per_s"] = _all_reduce_sum(tokens_trained) / replicas / max(time.perf_counter() - start, 1e-9)
        return metrics

    def _clip_and_step(self, max_norm: float, first_bad: str | None = None) -> float:
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        grad_norm = float(grad_norm)
        if not math.isfinite(grad_norm):
            # Skip the update rather than poison the weights; stop after too many in a row.
            self.optimizer.zero_grad(set_to_none=True)
            self.consecutive_skips += 1
            if self.consecutive_skips >= self.train_settings.max_consecutive_skips:
                cause = (f"the loss first went non-finite at {first_bad}" if first_bad else
                         "the loss stayed finite, so the gradient itself overflowed")
                raise FloatingPointError(
                    f"gradient norm was {grad_norm} for {self.consecutive_skips} optimiser steps in a row "
                    f"(optimiser step {self.optimizer_steps}); in the last one {cause}. "
                    "Fix: lower actor.optim.lr or check the data/rewards.")
            return grad_norm
        self.consecutive_skips = 0
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer_steps += 1
        return grad_norm

    # ------------------------------------------------------------------ offload (GPU)
    def offload_optimizer_state(self) -> None:
        if self.offload_optimizer and self.optimizer is not None:
            _move_optimizer_state(self.optimizer, torch.device("cpu"))

    def load_optimizer_state(self) -> None:
        if self.offload_optimizer and self.optimizer is not None:
            _move_optimizer_state(self.optimizer, self.device)


def _move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                state[key] = value.to(device, non_blocking=True)
