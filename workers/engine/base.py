"""The training-engine interface: what every training backend (FSDP2, DeepSpeed ZeRO, Megatron-core;
LoRA adapters on FSDP) offers the roles.

    engine = build_engine(settings, profile)           # build + shard the model (+ optimizer)
    out = engine.forward(data, forward_settings)         # no grad: {"log_probs", "entropy"} or {"values"}
    metrics = engine.train_step(data, loop, loss_fn)     # epochs x mini-batches x micro-batches, guarded steps
    engine.offload() / engine.reload()                   # optimizer state off / onto the device between phases
    engine.save_state(dir) / engine.load_state(dir)      # through the atomic checkpoint protocol
    for name, tensor in engine.iter_full_weights(): ...  # HF names, full tensors (weight sync, export)

A role never knows which engine it holds beyond `settings.strategy`. The update loop and its loss
normalisation live here, once, for every engine: an engine supplies `forward_micro` (one
micro-batch through its model), `backward` and `clip_norm` (or its own `guarded_step`, as
DeepSpeed, which owns the optimizer step).
"""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from rlframe.algos.batching import split_by_token_budget
from rlframe.device import DeviceProfile
from rlframe.protocol import DataProto
from rlframe.workers.distributed import all_reduce_max, all_reduce_sum, world_size
from rlframe.workers.settings import EngineSettings, ForwardSettings, UpdateLoop

MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids")


@dataclass
class LossOutput:
    """What a loss function returns for one micro-batch.

    `terms`: loss terms computed against the mini-batch's global normalisers; summed over
    micro-batches and ranks they give the mini-batch's value (reported as the mean over
    mini-batches). `stats`: per-micro-batch statistics (clip fractions, ...), reported as means.
    """

    loss: torch.Tensor  # (a float in what `accumulate_gradients` returns: the value only)
    terms: dict[str, float] = field(default_factory=dict)
    stats: dict[str, float] = field(default_factory=dict)


# loss_fn(outputs of forward_micro, the micro-batch, global agg_loss kwargs) -> LossOutput
LossFn = Callable[[dict[str, torch.Tensor], DataProto, dict], LossOutput]


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
    target = all_reduce_max(len(groups))
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
    return {"mode": mode, "num_tokens": all_reduce_sum(float(mask.sum())) / replicas,
            "num_seqs": all_reduce_sum(float((mask.sum(-1) > 0).sum())) / replicas, "horizon": horizon}


class TrainingEngine(ABC):
    """One rank's model (+ optimizer) of a role; see the module docstring for the interface."""

    settings: EngineSettings
    profile: DeviceProfile
    device: torch.device
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | None
    scheduler: torch.optim.lr_scheduler.LRScheduler | None
    name: str  # the config section that owns it (actor, critic): named in errors
    optimizer_steps: int = 0  # these two, with the model/optimizer/scheduler, are what checkpoints hold
    consecutive_skips: int = 0

    # ------------------------------------------------------------------ what an engine implements
    @abstractmethod
    def forward_micro(self, micro: DataProto, response_width: int, temperature: float,
                      with_entropy: bool) -> dict[str, torch.Tensor]:
        """One micro-batch through the model: {"log_probs", "entropy"?} or {"values"}, each [B, R]."""

    @abstractmethod
    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate the gradient of this rank's share of the global mini-batch loss."""

    @abstractmethod
    def clip_norm(self, max_norm: float) -> float:
        """Clip the accumulated gradient to `max_norm`; returns the (global) norm before clipping."""

    @abstractmethod
    def iter_full_weights(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) one at a time; every rank must iterate (gathering is a collective)."""

    @abstractmethod
    def save_state(self, out_dir: str, tokenizer_source: str | None = None) -> None: ...

    @abstractmethod
    def load_state(self, in_dir: str) -> dict: ...

    def offload(self) -> None:
        """Free device memory between phases (optimizer state to host); a no-op where not configured."""

    def reload(self) -> None:
        """Undo `offload` before the next update or save."""

    @property
    def sequence_parallel_size(self) -> int:
        return 1

    def gather_sequence_parallel(self, data: DataProto) -> tuple[DataProto, slice]:
        """Sequence parallelism: the rows of every rank of this rank's group, and where its own sit."""
        return data, slice(0, len(data))

    # ------------------------------------------------------------------ shared by every engine
    @torch.no_grad()
    def forward(self, data: DataProto, settings: ForwardSettings, with_entropy: bool = False) -> dict[str, torch.Tensor]:
        """Micro-batched forward without gradients; outputs in the input's row order, on the CPU."""
        was_training = self.model.training
        self.model.eval()
        data, own_rows = self.gather_sequence_parallel(data)
        response_width = data.batch["responses"].size(1)
        parts: dict[str, list[torch.Tensor]] = {}
        micros = micro_batch_indices(data, settings.micro_batch_size, settings.max_tokens_per_micro_batch)
        order = [row for indices in micros for row in indices]
        for out in self.forward_micros([data[indices] for indices in micros], response_width, settings.temperature,
                                       with_entropy):
            for key, value in out.items():
                parts.setdefault(key, []).append(value.cpu())
        self.model.train(was_training)
        restore = torch.argsort(torch.tensor(order))  # back to the input row order
        return {key: torch.cat(values)[restore][own_rows] for key, values in parts.items()}

    def train_step(self, data: DataProto, loop: UpdateLoop, loss_fn: LossFn, *, seed: int = 0,
                   temperature: float = 1.0, with_entropy: bool = False) -> dict[str, float]:
        """For each epoch and mini-batch: accumulate micro-batch gradients of `loss_fn`, clip, step.

        Loss normalisers (tokens, sequences) are counted over the whole mini-batch on every rank, so
        the summed micro-batch losses equal the loss of the global mini-batch; data parallelism
        averages gradients over ranks, so each rank scales its loss by the world size to get the sum.
        Returns `<name>/<metric>` means, reduced over ranks, plus the LR, skips and throughput.
        """
        assert self.optimizer is not None, f"train_step on the frozen {self.name} engine"
        world, replicas = world_size(), self.sequence_parallel_size
        data, _ = self.gather_sequence_parallel(data)
        response_width = data.batch["responses"].size(1)
        recorded = MetricSums()
        term_keys: set[str] = set()
        start, tokens_trained = time.perf_counter(), 0
        for epoch in range(loop.epochs):
            minis = data.mini_batches(loop.mini_batch_size * replicas, shuffle=loop.shuffle, seed=seed * 1000 + epoch)
            for mini_index, mini in enumerate(minis):
                agg = global_agg_kwargs(mini, loop.loss_agg_mode, response_width, replicas)
                self.optimizer.zero_grad(set_to_none=True)
                micros = micro_batch_indices(mini, loop.micro_batch_size, loop.max_tokens_per_micro_batch)
                tokens_trained += int(mini.batch["attention_mask"].sum())
                first_bad = None  # where the loss first went non-finite in this mini-batch
                for micro_index, (indices, out) in enumerate(zip(micros, self.accumulate_gradients(
                        [mini[indices] for indices in micros], response_width, loss_fn, agg, temperature,
                        with_entropy))):
                    if first_bad is None and not math.isfinite(out.loss):
                        values = ", ".join(f"{k.split('/')[-1]}={v}" for k, v in out.terms.items())
                        first_bad = (f"epoch {epoch}, mini-batch {mini_index}, micro-batch {micro_index} "
                                     f"(rows {indices} of the mini-batch; {values}, loss={out.loss})")
                    for key, value in out.terms.items():
                        recorded.record(key, value)
                        term_keys.add(key)
                    for key, value in out.stats.items():
                        recorded.record(key, value)
                recorded.record(f"{self.name}/grad_norm", self.guarded_step(first_bad))
        self.optimizer.zero_grad(set_to_none=True)  # free the gradients until the next update, not after it
        metrics = recorded.means()
        # Terms were computed against global normalisers: summing over micro-batches and ranks gives
        # the mini-batch value; the per-step figure is the mean over mini-batches.
        n_minis = max(recorded.counts.get(f"{self.name}/grad_norm", 1), 1)
        for key in metrics:
            if key in term_keys:
                metrics[key] = all_reduce_sum(recorded.sums[key]) / n_minis / replicas
            elif key != f"{self.name}/grad_norm":
                metrics[key] = all_reduce_sum(metrics[key]) / world
        metrics[f"{self.name}/lr"] = self.scheduler.get_last_lr()[0]
        metrics[f"{self.name}/skipped_updates"] = float(self.consecutive_skips)
        metrics[f"perf/{self.name}_train_tokens_per_s"] = (
            all_reduce_sum(tokens_trained) / replicas / max(time.perf_counter() - start, 1e-9))
        return metrics

    def forward_micros(self, micros: list[DataProto], response_width: int, temperature: float,
                       with_entropy: bool) -> list[dict[str, torch.Tensor]]:
        """`forward_micro` on each micro-batch in turn (an engine with a pipeline schedule runs them its way)."""
        return [self.forward_micro(micro, response_width, temperature, with_entropy) for micro in micros]

    def accumulate_gradients(self, micros: list[DataProto], response_width: int, loss_fn: LossFn, agg: dict,
                             temperature: float, with_entropy: bool) -> list[LossOutput]:
        """Accumulate the gradients of one mini-batch's micro-batches; their losses as floats (for the
        metrics and the non-finite check), in micro-batch order. Each micro-batch's loss is its share of
        the global mini-batch loss; `backward` gets it times the world size (see `train_step`)."""
        world, results = world_size(), []
        for micro in micros:
            out = loss_fn(self.forward_micro(micro, response_width, temperature, with_entropy), micro, agg)
            self.backward(out.loss * world)
            results.append(LossOutput(float(out.loss.detach()), out.terms, out.stats))
        return results

    def guarded_step(self, first_bad: str | None = None) -> float:
        """Clip and step; a non-finite gradient norm skips the step, and too many in a row stop the run."""
        optim = self.settings.optim
        grad_norm = self.clip_norm(optim.grad_clip)
        if not math.isfinite(grad_norm):
            # Skip the update rather than poison the weights; stop after too many in a row.
            self.optimizer.zero_grad(set_to_none=True)
            self.count_skipped_step(grad_norm, first_bad)
            return grad_norm
        self.consecutive_skips = 0
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer_steps += 1
        return grad_norm

    def count_skipped_step(self, grad_norm: float, first_bad: str | None) -> None:
        """One more skipped (non-finite) update in a row; too many in a row stop the run."""
        self.consecutive_skips += 1
        if self.consecutive_skips >= self.settings.optim.max_consecutive_skips:
            cause = (f"the loss first went non-finite at {first_bad}" if first_bad else
                     "the loss stayed finite, so the gradient itself overflowed")
            raise FloatingPointError(
                f"{self.name}: gradient norm was {grad_norm} for {self.consecutive_skips} optimiser steps in a "
                f"row (optimiser step {self.optimizer_steps}); in the last one {cause}. "
                f"Fix: lower {self.name}.optim.lr or check the data/rewards.")
