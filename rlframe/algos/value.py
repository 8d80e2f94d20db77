"""The critic's loss: clipped value regression (PPO, Schulman et al., 2017; as in OpenAI baselines).

With V = the critic's current prediction, V_old = its prediction when the batch was collected
(`values`), G = the regression target (`returns`, from the advantage estimator, e.g. GAE's A + V_old)
and eps = cliprange_value:

    V_clip  = clip(V, V_old - eps, V_old + eps)
    loss_t  = 0.5 * max((V - G)^2, (V_clip - G)^2)
    loss    = agg_loss(loss_t, mask, mode, ...)

The max of the two makes the clipping pessimistic: a prediction that moved more than eps away from
V_old gets no credit for moving towards G, so one critic update cannot run away from the values the
advantages were computed with. `agg` takes the same global normalisers as the policy loss (see
`rlframe.algos.losses.agg_loss`), so the summed micro-batch losses equal the mini-batch loss.
"""

from __future__ import annotations

import torch

from rlframe.algos.losses import agg_loss


def compute_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                       response_mask: torch.Tensor, cliprange_value: float | None,
                       agg: dict | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped value loss -> (scalar loss, metrics).

    values, old_values, returns, response_mask: [B, T]. cliprange_value None (or <= 0) disables the
    clipping (plain 0.5 * (V - G)^2). agg: keyword arguments of `agg_loss` (mode, num_tokens,
    num_seqs, horizon); default token-mean over this call's tokens.

    metrics: "vf_clipfrac" (share of unmasked tokens where the clipped term was the larger one) and
    "vpred_mean" (masked mean of V), both local to this call.
    """
    agg = dict(agg or {})
    mode = agg.pop("mode", "token-mean")
    unclipped = (values - returns).square()
    if cliprange_value is not None and cliprange_value > 0:
        clipped_values = old_values + (values - old_values).clamp(-cliprange_value, cliprange_value)
        clipped = (clipped_values - returns).square()
        per_token = 0.5 * torch.maximum(unclipped, clipped)
        clip_used = (clipped > unclipped).to(values.dtype)
    else:
        per_token = 0.5 * unclipped
        clip_used = torch.zeros_like(values)
    loss = agg_loss(per_token, response_mask, mode, **agg)
    mask = response_mask.to(values.dtype)
    count = mask.sum().clamp_min(1.0)
    metrics = {"vf_clipfrac": float((clip_used * mask).sum() / count),
               "vpred_mean": float((values.detach() * mask).sum() / count)}
    return loss, metrics
