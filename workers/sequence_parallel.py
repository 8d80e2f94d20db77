"""Ulysses sequence parallelism: the ranks of a sequence-parallel (SP) group share one packed row.

Each of the P ranks of a group holds 1/P of the row's tokens through the embeddings, the linear
layers, the MLP and the LM head. Attention needs every token of a sequence, so around it an
all-to-all trades the split: [tokens/P, all heads] -> [all tokens, heads/P], attention runs on
full sequences for its share of the heads (VARLEN_SDPA), and a second all-to-all trades back.
Activation memory per rank falls by P; long sequences that do not fit one device fit P of them.

Inside a worker, the P ranks of a group first exchange their data-parallel chunks (`gather_rows`),
so the group trains on the union of its chunks and the driver dispatches exactly as without SP.
Each rank's log-probs are all-gathered so that every rank of the group computes the same loss;
the backward of that gather hands each rank only its own tokens' gradient, and the gradient
reduction over ranks then sums the partial parameter gradients into the gradient of the loss.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from rlframe.protocol import DataProto
from rlframe.workers.attention import varlen_sdpa_attention

ULYSSES_SDPA = "rlframe_ulysses_sdpa"


@dataclass
class SequenceParallelGroup:
    """This rank's SP group: consecutive global ranks [k * size, (k + 1) * size)."""

    group: dist.ProcessGroup
    size: int
    rank: int  # rank inside the group

    @classmethod
    def create(cls, size: int) -> SequenceParallelGroup:
        world, rank = dist.get_world_size(), dist.get_rank()
        if world % size:
            raise ValueError(f"ulysses_sequence_parallel_size={size} does not divide the world size {world}")
        mine = None
        for first in range(0, world, size):  # every rank creates every group, in the same order
            group = dist.new_group(list(range(first, first + size)))
            if first <= rank < first + size:
                mine = group
        return cls(mine, size, rank % size)


def all_to_all(x: torch.Tensor, sp: SequenceParallelGroup, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Split `x` into P pieces along scatter_dim, send piece j to group rank j, and concatenate the
    pieces received (in group-rank order) along gather_dim. Differentiable."""
    return _AllToAll.apply(x, sp, scatter_dim, gather_dim)


def _all_to_all(x: torch.Tensor, sp: SequenceParallelGroup, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    send = torch.stack(x.chunk(sp.size, dim=scatter_dim)).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=sp.group)
    return torch.cat(received.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sp, scatter_dim, gather_dim):
        ctx.sp, ctx.dims = sp, (scatter_dim, gather_dim)
        return _all_to_all(x, sp, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, ctx.sp, gather_dim, scatter_dim), None, None, None


class _GatherTokens(torch.autograd.Function):
    """All-gather along dim 0; the backward keeps this rank's slice of the (identical) gradient."""

    @staticmethod
    def forward(ctx, x, sp):
        ctx.sp, ctx.local = sp, x.size(0)
        pieces = [torch.empty_like(x) for _ in range(sp.size)]
        dist.all_gather(pieces, x.contiguous(), group=sp.group)
        return torch.cat(pieces)

    @staticmethod
    def backward(ctx, grad):
        start = ctx.sp.rank * ctx.local
        return grad[start: start + ctx.local], None


def gather_tokens(x: torch.Tensor, sp: SequenceParallelGroup) -> torch.Tensor:
    return _GatherTokens.apply(x, sp)


# The group and the whole row's position ids, for the attention function during one forward.
_active: tuple[SequenceParallelGroup, torch.Tensor] | None = None


@contextlib.contextmanager
def sequence_parallel_forward(sp: SequenceParallelGroup, full_position_ids: torch.Tensor) -> Iterator[None]:
    global _active
    _active = (sp, full_position_ids)
    try:
        yield
    finally:
        _active = None


def ulysses_sdpa_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                           **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention interface on this rank's token slice: q [1, H, N/P, D] -> [1, N/P, H, D]."""
    if _active is None:
        raise RuntimeError(f"a model loaded with {ULYSSES_SDPA} runs only inside sequence_parallel_forward()")
    sp, full_position_ids = _active
    if query.size(1) % sp.size:
        raise ValueError(f"{query.size(1)} attention heads do not split over ulysses_sequence_parallel_size={sp.size}")
    if key.size(1) % sp.size:  # too few key/value heads to split: give every query head its own copy
        repeat = query.size(1) // key.size(1)
        key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    # [1, heads, N/P, D] -> [1, heads/P, N, D]
    query, key, value = (all_to_all(t, sp, scatter_dim=1, gather_dim=2) for t in (query, key, value))
    out, _ = varlen_sdpa_attention(module, query, key, value, None, dropout, scaling, position_ids=full_position_ids)
    # [1, N, heads/P, D] -> [1, N/P, heads, D]
    return all_to_all(out, sp, scatter_dim=1, gather_dim=2), None


def register_ulysses_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ULYSSES_SDPA, ulysses_sdpa_attention)
    AttentionMaskInterface.register(ULYSSES_SDPA, lambda *args, **kwargs: None)


def gather_rows(data: DataProto, sp: SequenceParallelGroup) -> tuple[DataProto, slice]:
    """Concatenate the data-parallel chunks of the SP group (in group-rank order) on every rank of
    it; also returns this rank's own rows inside the result."""
    chunks: list[DataProto | None] = [None] * sp.size
    dist.all_gather_object(chunks, data, group=sp.group)
    start = sum(len(c) for c in chunks[: sp.rank])
    return DataProto.concat(chunks), slice(start, start + len(data))
