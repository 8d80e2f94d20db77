"""Ulysses attention over a real 2-process gloo group equals single-process packed attention, in the
output and in the gradients of every rank's token slice, with grouped-query attention (one key/value
head for four query heads, so the key/value heads are repeated before the all-to-all)."""

import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from rlframe.workers.attention import varlen_sdpa_attention
from rlframe.workers.sequence_parallel import (SequenceParallelGroup, sequence_parallel_forward,
                                               ulysses_sdpa_attention)

TOKENS, HEADS, KV_HEADS, HEAD_DIM = 10, 4, 1, 8
POSITIONS = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5]])  # two packed sequences: 4 and 6 tokens


def _tensors():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, HEADS, TOKENS, HEAD_DIM, generator=g)
    k = torch.randn(1, KV_HEADS, TOKENS, HEAD_DIM, generator=g)
    v = torch.randn(1, KV_HEADS, TOKENS, HEAD_DIM, generator=g)
    weights = torch.randn(1, TOKENS, HEADS, HEAD_DIM, generator=g)
    return q, k, v, weights


def _rank_main(rank: int, port: int, results) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        sp = SequenceParallelGroup.create(2)
        q, k, v, weights = (t.requires_grad_(i < 3) for i, t in enumerate(_tensors()))
        mine = slice(rank * TOKENS // 2, (rank + 1) * TOKENS // 2)
        local = [t[:, :, mine].detach().requires_grad_() for t in (q, k, v)]
        with sequence_parallel_forward(sp, POSITIONS):
            out, _ = ulysses_sdpa_attention(nn.Module().eval(), *local, None, scaling=0.5)
        (out * weights[:, mine]).sum().backward()
        results.put((rank, out.detach(), [t.grad for t in local]))
    finally:
        dist.destroy_process_group()


def test_ulysses_attention_matches_single_process():
    q, k, v, weights = (t.requires_grad_(i < 3) for i, t in enumerate(_tensors()))
    expected, _ = varlen_sdpa_attention(nn.Module().eval(), q, k, v, None, scaling=0.5, position_ids=POSITIONS)
    (expected * weights).sum().backward()

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(rank, port, results)) for rank in range(2)]
    for p in procs:
        p.start()
    outputs = dict((rank, (out, grads)) for rank, out, grads in (results.get(timeout=120) for _ in procs))
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0

    for rank, (out, grads) in outputs.items():
        mine = slice(rank * TOKENS // 2, (rank + 1) * TOKENS // 2)
        torch.testing.assert_close(out, expected[:, mine].detach())
        for got, full in zip(grads, (q.grad, k.grad, v.grad)):
            torch.testing.assert_close(got, full[:, :, mine])
