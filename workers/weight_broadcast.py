"""Trainer -> rollout engines weight sync for disaggregated placement, over a standalone process group.

In the colocated (hybrid) engine the weights move inside one process. When the rollout engines
live on their own devices (their own nodes), the trainer's rank 0 broadcasts the full weights to
every rollout rank after each update:

    group ranks:   0 = trainer rank 0,   1 .. R = rollout ranks 0 .. R-1

The group is built directly from a ``TCPStore`` (hosted by trainer rank 0) and
``ProcessGroupGloo`` / ``ProcessGroupNCCL``, so neither side's default process group (the trainer's
FSDP world, the engines' own world) is touched or even needs to know about the other.

Weights travel in buckets: consecutive tensors of one dtype are flattened into one buffer of about
``bucket_bytes``, so a model of thousands of small tensors costs a few dozen collectives, not
thousands. The tensor list (names, shapes, dtypes) is fixed for a run: the trainer computes it
once (``weight_spec``) and both sides derive the same buckets from it (``plan_buckets``); only raw
bytes cross the wire afterwards. Receivers hand each bucket to ``engine.load_weights`` as views of
the buffer (no extra copy on the receiving side).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

DEFAULT_BUCKET_BYTES = 64 << 20


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


def weight_spec(state_dict: dict, dtype: torch.dtype | None = None) -> list[TensorSpec]:
    """The (name, global shape, wire dtype) of every tensor, in ``iter_full_weights`` order.

    FSDP2 DTensors report their global shape, so no gather is needed. Floating tensors travel in
    ``dtype`` when given (what ``iter_full_weights(model, dtype)`` yields).
    """
    specs = []
    for name, tensor in state_dict.items():
        wire = dtype if (dtype is not None and tensor.is_floating_point()) else tensor.dtype
        specs.append(TensorSpec(name, tuple(tensor.shape), wire))
    return specs


def plan_buckets(specs: list[TensorSpec], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[list[TensorSpec]]:
    """Split the tensor list into consecutive runs of one dtype of about ``bucket_bytes`` each.

    A tensor larger than a bucket gets a bucket of its own. Both sides call this on the same list,
    so they agree on the buckets without exchanging anything.
    """
    buckets: list[list[TensorSpec]] = []
    current: list[TensorSpec] = []
    size = 0
    for spec in specs:
        if current and (spec.dtype != current[0].dtype or size + spec.nbytes > bucket_bytes):
            buckets.append(current)
            current, size = [], 0
        current.append(spec)
        size += spec.nbytes
    if current:
        buckets.append(current)
    return buckets


def make_process_group(host: str, port: int, rank: int, world_size: int, backend: str = "gloo",
                       timeout_s: float = 600, group_name: str = "rlframe_weight_sync"):
    """A process group of its own (not registered as any default group), rendezvous at host:port.

    Rank 0 hosts the TCPStore. Every rank must call this at about the same time: the constructor
    waits for all ``world_size`` members.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    store = torch.distributed.TCPStore(host, port, world_size, is_master=(rank == 0), timeout=timeout,
                                       wait_for_workers=False)
    store = torch.distributed.PrefixStore(group_name, store)
    if backend == "nccl":
        options = torch.distributed.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return torch.distributed.ProcessGroupNCCL(store, rank, world_size, options)
    return torch.distributed.ProcessGroupGloo(store, rank, world_size, timeout)


class _BucketedEndpoint:
    """One end of the weight broadcast: the group, the tensor layout and its bucket plan (same on both ends)."""

    def __init__(self, process_group, specs: list[TensorSpec], device: str = "cpu",
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        self.process_group = process_group
        self.specs = specs
        self.device = torch.device(device)
        self.buckets = plan_buckets(specs, bucket_bytes)


class WeightSender(_BucketedEndpoint):
    """Trainer side (group rank 0): broadcast the full weights bucket by bucket."""

    def send(self, weights: Iterable[tuple[str, torch.Tensor]]) -> dict:
        """Broadcast ``weights`` (an iterator in spec order, e.g. ``iter_full_weights``); returns stats."""
        stream = iter(weights)
        sent_bytes = 0
        for bucket in self.buckets:
            parts = []
            for spec in bucket:
                name, tensor = next(stream)
                if name != spec.name or tuple(tensor.shape) != spec.shape:
                    raise RuntimeError(f"weight stream out of order: got {name} {tuple(tensor.shape)}, "
                                       f"expected {spec.name} {spec.shape} (did the model change after setup?)")
                parts.append(tensor.to(device=self.device, dtype=spec.dtype).reshape(-1))
            flat = torch.cat(parts) if len(parts) > 1 else parts[0].contiguous()
            self.process_group.broadcast([flat], _root(0)).wait()
            sent_bytes += flat.numel() * flat.element_size()
        return {"buckets": len(self.buckets), "tensors": len(self.specs), "bytes": sent_bytes}


class WeightReceiver(_BucketedEndpoint):
    """Rollout side (group rank >= 1): receive each bucket and load it into the engine."""

    def receive(self, load_weights: Callable[[Iterable[tuple[str, torch.Tensor]]], int],
                per_bucket: bool = True) -> dict:
        """Receive all buckets, calling ``load_weights(list of (name, tensor))`` once per bucket.

        ``per_bucket=False`` calls it once with every tensor instead, for engines whose reload wants
        the whole model at once (vLLM's ``reload_weights`` post-processes, e.g. repacks, after each call).
        """
        loaded = 0
        received_bytes = 0
        pending: list[tuple[str, torch.Tensor]] = []
        for bucket in self.buckets:
            numel = sum(spec.numel for spec in bucket)
            flat = torch.empty(numel, dtype=bucket[0].dtype, device=self.device)  # fresh: views stay valid
            self.process_group.broadcast([flat], _root(0)).wait()
            received_bytes += flat.numel() * flat.element_size()
            if per_bucket:
                loaded += load_weights(list(_unflatten(flat, bucket))) or 0
            else:
                pending.extend(_unflatten(flat, bucket))
        if pending:
            loaded += load_weights(pending) or 0
        return {"buckets": len(self.buckets), "tensors": len(self.specs), "loaded": loaded, "bytes": received_bytes}


def _unflatten(flat: torch.Tensor, bucket: list[TensorSpec]) -> Iterator[tuple[str, torch.Tensor]]:
    offset = 0
    for spec in bucket:
        yield spec.name, flat[offset: offset + spec.numel].view(spec.shape)
        offset += spec.numel


def _root(rank: int):
    opts = torch.distributed.BroadcastOptions()
    opts.rootRank = rank
    opts.rootTensor = 0
    return opts


def specs_to_wire(specs: list[TensorSpec]) -> list[tuple[str, tuple[int, ...], str]]:
    """A plain-Python form (for Ray arguments); ``specs_from_wire`` reverses it."""
    return [(s.name, s.shape, str(s.dtype).removeprefix("torch.")) for s in specs]


def specs_from_wire(wire: list) -> list[TensorSpec]:
    return [TensorSpec(name, tuple(shape), getattr(torch, dtype)) for name, shape, dtype in wire]


# ---------------------------------------------------------------------------- sync checksums
# After a weight sync the trainer's weights and the engine's must agree. Comparing them in full costs a
# pass over the whole model on each side (about the price of the sync itself on a CPU); a strided sample
# of each tensor costs a few thousand elements per tensor, and an optimizer step (which moves nearly
# every element) still moves the sample's sum. Both sides sample the same elements: the stride depends on
# the tensor's size alone.
CHECKSUM_SAMPLES = 4096  # elements sampled per tensor (at most 2x this many)
CHECKSUM_RTOL = 1e-9  # float64 sums of the same float values agree far closer than one optimizer step moves them


def tensor_checksum(tensor: torch.Tensor) -> tuple[float, float]:
    """(sum, sum of squares) in float64 of every s-th element of the flattened tensor, s = max(1, numel //
    CHECKSUM_SAMPLES): the same elements on both sides of a sync, whatever dtype, device or layout."""
    flat = tensor.detach().reshape(-1)
    stride = max(1, flat.numel() // CHECKSUM_SAMPLES)
    sample = flat[::stride].to(torch.float64)
    return float(sample.sum()), float(sample.square().sum())


def checksums_of(weights: Iterable[tuple[str, torch.Tensor]]) -> dict[str, tuple[float, float]]:
    return {name: tensor_checksum(tensor) for name, tensor in weights}


def checksum_close(a: tuple[float, float], b: tuple[float, float], rtol: float = CHECKSUM_RTOL) -> bool:
    """Equal up to float64 rounding: |sum_a - sum_b| <= rtol * sqrt(n * sumsq) (a bound on the sum of |x| over the
    n <= 2 * CHECKSUM_SAMPLES sampled elements) and |sumsq_a - sumsq_b| <= rtol * sumsq."""
    scale = max(a[1], b[1])
    return (abs(a[0] - b[0]) <= rtol * (2 * CHECKSUM_SAMPLES * scale) ** 0.5 + 1e-30
            and abs(a[1] - b[1]) <= rtol * scale + 1e-30)


def compare_checksums(trainer: dict, engine: dict, previous_trainer: dict | None = None,
                      previous_engine: dict | None = None) -> dict:
    """What a sync did, from the checksums (name -> (sum, sumsq)) of the trainer's weights and the engine's after it,
    and of both after the previous sync (None: unknown).

    streamed: the trainer's tensors; missing: those the engine's side does not hold under that name (its loader
    never took them); checked: the others; unequal: the missing ones and the checked ones that differ (first_unequal
    names one); engine_changed / trainer_changed: 1 when some tensor moved since the previous sync, 0 when none
    did, -1 unknown. A healthy sync: unequal == 0, and engine_changed == 1 whenever trainer_changed == 1."""
    missing = [name for name in trainer if name not in engine]
    checked = [name for name in trainer if name in engine]
    unequal = missing + [name for name in checked if not checksum_close(trainer[name], engine[name])]

    def changed(now: dict, before: dict | None) -> int:
        common = [name for name in now if before is not None and name in before]
        if not common:
            return -1
        return int(any(not checksum_close(now[name], before[name]) for name in common))

    return {"streamed": len(trainer), "checked": len(checked), "missing": len(missing), "unequal": len(unequal),
            "first_unequal": unequal[0] if unequal else "",
            "engine_changed": changed({n: engine[n] for n in checked}, previous_engine),
            "trainer_changed": changed(trainer, previous_trainer)}
