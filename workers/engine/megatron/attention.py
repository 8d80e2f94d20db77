"""Core attention for the Megatron engine: torch SDPA in Megatron's core-attention slot, and context
parallelism (each sequence cut into 2 x CP chunks, the keys / values all-gathered over the CP group).

Megatron-core's own CP attention is transformer-engine's (its local spec's DotProductAttention asserts
CP == 1), so `SDPACoreAttention` does it: rank r holds chunks r and 2 CP - 1 - r (Megatron's causal load
balance; `cp_positions`); its queries attend to every chunk's keys / values, gathered over the CP group
(`GatherChunks`, a list all_gather; backward: each chunk's dK / dV summed over the CP ranks), under the
causal + padding mask of their global columns (`attention_mask_for`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from rlframe.workers.engine.megatron.parallel import import_megatron


class SDPACoreAttention(nn.Module):
    """Megatron's core-attention slot filled with torch SDPA: q [s, b, heads/tp, d], k/v [s, b, groups/tp, d]
    -> [s, b, heads/tp * d]. The mask is ours ([b, 1, s, s], True = masked, Megatron's convention)."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None, **_):
        super().__init__()
        self.softmax_scale = softmax_scale
        # Context parallelism: this rank holds 2 of the 2 x CP chunks of each sequence (see `cp_positions`);
        # its queries attend to the keys / values of every chunk, all-gathered over the CP group
        # (`GatherChunks`: the backward sums each chunk's dK / dV over the ranks whose queries used it).
        # The mask the model passes is [b, 1, local queries, all keys in global order].
        self.cp_group = None
        if config.context_parallel_size > 1:
            self.cp_group = import_megatron()[0].get_context_parallel_group()

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError("SDPACoreAttention takes padded rows with a mask only")
        if self.cp_group is not None:
            key = GatherChunks.apply(key, self.cp_group, 0, True)
            value = GatherChunks.apply(value, self.cp_group, 0, True)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        if k.size(1) != q.size(1):
            repeat = q.size(1) // k.size(1)
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=~attention_mask,
                                                               scale=self.softmax_scale)
        s, b = query.size(0), query.size(1)
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)


def cp_positions(length: int, cp: int, cp_rank: int, device=None) -> torch.Tensor:
    """The columns of a `length`-column sequence (a multiple of 2 x CP) that CP rank `cp_rank` holds:
    chunks `cp_rank` and `2 CP - 1 - cp_rank` of 2 x CP equal chunks (Megatron's load balance: under the
    causal mask every rank gets the same amount of attention work)."""
    chunk = length // (2 * cp)
    first, second = cp_rank * chunk, (2 * cp - 1 - cp_rank) * chunk
    return torch.cat((torch.arange(first, first + chunk, device=device),
                      torch.arange(second, second + chunk, device=device)))


class GatherChunks(torch.autograd.Function):
    """Every CP rank's local tensor (its two chunks, `cp_positions` order, along `dim`) -> the whole sequence in
    column order, on every rank of the CP group (a list all_gather: gloo-safe).

    backward: `reduce=True` (keys / values: every rank's queries used every chunk): each chunk's gradient
    summed over the CP ranks, this rank's chunks kept (a reduce-scatter; on gloo an all-reduce and a
    slice). `reduce=False` (per-token log-probs / entropy / values, from which every CP rank computes the
    same loss): this rank's chunks of the gradient only, which summed over the CP ranks (as the engine sums
    the gradients over data-parallel x CP ranks) is the loss's gradient once."""

    @staticmethod
    def forward(ctx, local, group, dim, reduce):
        ctx.group, ctx.dim, ctx.reduce = group, dim, reduce
        cp = dist.get_world_size(group)
        pieces = [torch.empty_like(local) for _ in range(cp)]
        dist.all_gather(pieces, local.contiguous(), group=group)
        chunks: list = [None] * (2 * cp)
        for rank, piece in enumerate(pieces):
            chunks[rank], chunks[2 * cp - 1 - rank] = piece.chunk(2, dim=dim)
        return torch.cat(chunks, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        group, dim = ctx.group, ctx.dim
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        chunks = grad.chunk(2 * cp, dim=dim)
        if not ctx.reduce:
            return torch.cat((chunks[rank], chunks[2 * cp - 1 - rank]), dim=dim).contiguous(), None, None, None
        per_rank = torch.stack([torch.cat((chunks[r], chunks[2 * cp - 1 - r]), dim=dim) for r in range(cp)])
        if dist.get_backend(group) == "nccl":
            mine = torch.empty_like(per_rank[0])
            dist.reduce_scatter_tensor(mine, per_rank.flatten(0, 1) if dim == 0 else per_rank, group=group)
            return mine, None, None, None
        dist.all_reduce(per_rank, group=group)
        return per_rank[rank].contiguous(), None, None, None


def attention_mask_for(attention_mask: torch.Tensor, queries: torch.Tensor | None = None) -> torch.Tensor:
    """[b, s] padding mask -> [b, 1, q, s] bool, True where a query may NOT attend (causal + padding).

    `queries`: the global positions of the query rows, by default all s of them; under context
    parallelism a rank's own (`cp_index`) against every key in column order (what `SDPACoreAttention`
    gathers), so the rank never builds the whole [b, 1, s, s]. Every position may attend to itself, so
    padding queries (whose outputs are never read) get no all-masked row (SDPA would give NaN there)."""
    columns = torch.arange(attention_mask.size(1), device=attention_mask.device)
    queries = (columns if queries is None else queries).unsqueeze(1)
    allowed = (columns <= queries).unsqueeze(0) & attention_mask.bool().unsqueeze(1)
    allowed |= (columns == queries).unsqueeze(0)
    return (~allowed).unsqueeze(1)
