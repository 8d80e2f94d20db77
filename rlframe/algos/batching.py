"""Pure batching decisions: micro-batches by a token budget, and equal-work splits across ranks.

Both take sequence lengths (real tokens per row) and return lists of row indices; the caller
reorders or slices its batch accordingly. Because the loss normalisers are global (see
`agg_loss`), how rows are grouped into micro-batches or ranks does not change the gradient.
"""

from __future__ import annotations

import heapq


def split_by_token_budget(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Group rows into as few micro-batches as a first-fit-decreasing packing finds, each holding
    at most `max_tokens` real tokens (a row longer than the budget gets a micro-batch of its own).

    Returns index lists, each sorted ascending; every row appears exactly once.
    """
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for b, load in enumerate(loads):
            if load + lengths[i] <= max_tokens:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return [sorted(b) for b in bins]


def balanced_equal_size_partition(lengths: list[int], parts: int) -> list[list[int]]:
    """Split rows into `parts` groups of equal row count with near-equal token totals.

    Greedy longest-processing-time: rows in decreasing length go to the group with the smallest
    total that still has room. The spread between the largest and smallest group total stays
    within the longest row (checked on random batches in the tests), versus up to
    (rows / parts) x the length range for contiguous chunks.
    """
    if len(lengths) % parts:
        raise ValueError(f"{len(lengths)} rows do not split into {parts} equal groups")
    capacity = len(lengths) // parts
    groups: list[list[int]] = [[] for _ in range(parts)]
    heap = [(0, g) for g in range(parts)]  # (token total, group)
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        total, g = heapq.heappop(heap)
        groups[g].append(i)
        if len(groups[g]) < capacity:
            heapq.heappush(heap, (total + lengths[i], g))
    return [sorted(g) for g in groups]
