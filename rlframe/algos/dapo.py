"""DAPO's two data-side tricks (Yu et al., 2025), as pure functions.

Overlong reward shaping: a soft length penalty inside a buffer of `buffer_len` tokens before the
response limit L_max, instead of a cliff at the limit. With L = the response length:

    penalty(L) = 0                                          if L <= L_max - buffer_len
               = (L_max - buffer_len - L) / buffer_len      if L_max - buffer_len < L <= L_max
               = -1                                         if L > L_max
    shaped score = score + penalty_factor * penalty(L)

(a response the engine cut at the limit has L = L_max and gets the full -1 * penalty_factor).

Dynamic sampling: a group whose n rewards all agree has zero advantage under any group-relative
estimator and only dilutes the batch; `informative_groups` finds the groups worth keeping.
"""

from __future__ import annotations

import numpy as np
import torch


def overlong_penalty(response_lengths: torch.Tensor, max_response_length: int, buffer_len: int) -> torch.Tensor:
    """Per-sequence penalty in [-1, 0] (formula above); [B] float tensor."""
    if buffer_len <= 0:
        raise ValueError(f"the overlong buffer must be > 0 tokens, got {buffer_len}")
    if buffer_len > max_response_length:
        raise ValueError(f"the overlong buffer ({buffer_len}) is longer than max_response_length ({max_response_length})")
    lengths = response_lengths.to(torch.float32)
    start = max_response_length - buffer_len
    penalty = (start - lengths) / buffer_len
    penalty = torch.clamp(penalty, max=0.0)
    return torch.where(lengths > max_response_length, torch.full_like(lengths, -1.0), penalty.clamp(min=-1.0))


def informative_groups(group_index, scores, atol: float = 1e-6) -> np.ndarray:
    """Boolean mask [B]: True for samples whose group's scores do NOT all agree (within atol).

    group_index: [B] hashable ids (the uid of each sample's prompt); scores: [B] outcome scores.
    A group of one sample always agrees with itself and is dropped.
    """
    ids = np.asarray(group_index, dtype=object).reshape(-1)
    values = np.asarray(scores, dtype=np.float64).reshape(-1)
    if len(ids) != len(values):
        raise ValueError(f"group_index has {len(ids)} entries but scores has {len(values)}")
    keep = np.zeros(len(ids), dtype=bool)
    groups: dict = {}
    for i, gid in enumerate(ids):
        groups.setdefault(gid, []).append(i)
    for members in groups.values():
        group_scores = values[members]
        keep[members] = (group_scores.max() - group_scores.min()) > atol
    return keep
