"""Distributed helpers every worker uses: where this process is, and small collectives on scalars.

All of them work without a process group (one plain process: rank 0 of 1), so roles and engines
can be built and tested as ordinary objects. Scalars travel as tensors on `collective_device()`:
NCCL only reduces CUDA tensors, gloo only CPU ones.
"""

from __future__ import annotations

import random

import numpy as np
import torch
import torch.distributed as dist


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def collective_device() -> torch.device:
    """Where the default group's collectives need their tensors: cuda for an NCCL-only group, else
    cpu (gloo, or the workers' cpu:gloo,cuda:nccl group, which takes CPU tensors over gloo)."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_sum(value: float) -> float:
    """The sum of `value` over all ranks (float64 on the wire)."""
    if world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=collective_device())
    dist.all_reduce(t)
    return float(t.item())


def all_reduce_max(value: int) -> int:
    if world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def seed_everything(seed: int) -> None:
    """Python, numpy and torch RNGs of this process."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
