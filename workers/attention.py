"""Padding-free attention for packed rows where flash-attn is not available (CPU, or GPU without it).

A packed row holds several sequences back to back, their position ids restarting at 0. The linear
layers and the MLP (nearly all the FLOPs) then run on real tokens only. Attention must not cross
sequence borders; a block-diagonal mask over the whole row would cost (sum of lengths)^2, so this
function instead scatters the row into one [sequences, heads, longest, head_dim] block per tensor,
runs causal SDPA on it (right padding is invisible to a causal query) and gathers the real tokens
back: attention costs sum of longest^2 per sequence, as with flash-attn varlen.

Registered with transformers as ``VARLEN_SDPA``; a model loaded with
``attn_implementation=VARLEN_SDPA`` expects packed input (batch 1, position ids given).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VARLEN_SDPA = "rlframe_varlen_sdpa"


def packed_layout(position_ids: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """For a packed row's position ids [N]: each token's slot in a [sequences x longest] grid,
    the number of sequences and the longest length.

    Sequence s starts where the position id is 0; token j goes to slot s * longest + position_ids[j].
    """
    sequence = torch.cumsum(position_ids == 0, 0) - 1
    num_sequences = int(sequence[-1]) + 1
    longest = int(position_ids.max()) + 1
    return sequence * longest + position_ids, num_sequences, longest


def varlen_sdpa_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                          position_ids: torch.Tensor | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention interface: query [1, H, N, D], key/value [1, H_kv, N, D] of one packed
    row -> output [1, N, H, D] (the layout the model's output projection expects)."""
    if query.size(0) != 1 or position_ids is None:
        raise ValueError(f"{VARLEN_SDPA} takes one packed row with position ids "
                         f"(got batch {query.size(0)}, position_ids {'missing' if position_ids is None else 'given'})")
    slots, num_sequences, longest = packed_layout(position_ids[0])

    def to_grid(x: torch.Tensor) -> torch.Tensor:
        tokens = x[0].transpose(0, 1)  # [N, heads, D]
        grid = tokens.new_zeros(num_sequences * longest, *tokens.shape[1:]).index_copy(0, slots, tokens)
        return grid.view(num_sequences, longest, *tokens.shape[1:]).transpose(1, 2)

    q, k, v = to_grid(query), to_grid(key), to_grid(value)
    if k.size(1) != q.size(1):  # grouped-query attention
        repeat = q.size(1) // k.size(1)
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling,
                                         dropout_p=dropout if module.training else 0.0)
    out = out.transpose(1, 2).reshape(num_sequences * longest, q.size(1), q.size(-1))
    return out.index_select(0, slots).unsqueeze(0), None


def _no_mask(*args, **kwargs) -> None:
    return None  # the attention function derives sequence borders from the position ids


def register_varlen_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(VARLEN_SDPA, varlen_sdpa_attention)
    AttentionMaskInterface.register(VARLEN_SDPA, _no_mask)
