"""Tensor-parallel rollout: one vLLM engine spread over `tp` consecutive ranks of a worker group.

A policy too large for one device's engine runs with `rollout.tensor_parallel_size=tp`: ranks
[0, tp), [tp, 2tp), ... each drive one engine (vLLM's `external_launcher` mode: the engine joins the
process group the workers already have, no extra processes). Every rank of an engine must submit
the same requests, so each rank's share of the batch is gathered within its group, the engine
generates for the union, and each rank keeps its own rows. Weight sync needs nothing special: every
rank streams full tensors (gathered from the FSDP shards) and vLLM's loaders keep each rank's slice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch.distributed as dist

from rlframe.protocol import DataProto


@dataclass
class TensorParallelGroup:
    size: int
    index: int  # which engine of the worker group (rank // size)
    local_rank: int  # position inside it
    group: object  # a gloo process group over the engine's ranks (prompts travel as Python objects)

    @classmethod
    def create(cls, size: int) -> "TensorParallelGroup":
        """Every rank of the worker group calls this together (new_group is collective)."""
        world, rank = dist.get_world_size(), dist.get_rank()
        if world % size:
            raise ValueError(f"rollout.tensor_parallel_size={size} does not divide the {world} ranks that run "
                             "rollout engines. Fix: a divisor of the rollout world size")
        mine = None
        for start in range(0, world, size):
            group = dist.new_group(list(range(start, start + size)), backend="gloo")
            if start <= rank < start + size:
                mine = group
        return cls(size=size, index=rank // size, local_rank=rank % size, group=mine)

    def generate(self, prompts: DataProto, generate: Callable[[DataProto], DataProto]) -> DataProto:
        """Gather the group's prompts, generate them all on this rank's part of the engine, keep ours."""
        shares: list = [None] * self.size
        dist.all_gather_object(shares, prompts, group=self.group)
        everything = DataProto.concat(shares)
        everything.meta_info = dict(prompts.meta_info)
        out = generate(everything)
        start = sum(len(share) for share in shares[: self.local_rank])
        mine = out[start:start + len(prompts)]
        mine.meta_info = dict(out.meta_info)
        return mine
