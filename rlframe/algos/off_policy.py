"""Off-policy correction: truncated importance sampling (TIS) against the behaviour policy.

The tokens of a batch were sampled by the rollout engine's weights (the behaviour policy mu, whose
per-token log-probs the engine returns as `rollout_log_probs`); the update's ratio is taken against
the trainer's recompute of the old policy (pi_old, `old_log_probs`). The two differ when generation
ran on older weights (asynchronous training: staleness >= 1) and, slightly, through engine/trainer
numerics. TIS reweights each token's policy-gradient term by the truncated ratio pi_old / mu
(Yao et al., 2025, "Your efficient RL framework secretly brings you off-policy RL training"):

    loss_t = w_t * l_t(pi_theta / pi_old),   w_t = min(pi_old(y_t) / mu(y_t), C)

so the update estimates the gradient of the on-policy objective under pi_old while the cap C keeps
a token that the behaviour policy found unlikely from dominating the variance.
"""

from __future__ import annotations

import torch

from rlframe.algos.utils import masked_mean

OFF_POLICY_CORRECTIONS = ("auto", "tis", "none")


def truncated_is_weights(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor,
                         cap: float) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token truncated importance weights [B, T], detached, 0 on padding.

        w_t = min(exp(old_log_prob_t - rollout_log_prob_t), C)     (log-ratio clamped to [-20, 20])

    old_log_prob: the trainer's recompute of the old policy; rollout_log_prob: the behaviour policy's
    (the engine's) log-probs of the same tokens; C = `cap` (> 0). Only the upper side is truncated.
    metrics: tis_weight_mean (masked mean of w), tis_capped_frac (tokens whose ratio exceeded C),
    tis_log_ratio_abs (masked mean of |old_log_prob - rollout_log_prob|).
    """
    if not cap > 0:
        raise ValueError(f"the truncated-IS cap must be > 0, got {cap}")
    mask = response_mask.to(torch.float32)
    log_ratio = torch.clamp(old_log_prob.detach().float() - rollout_log_prob.detach().float(), min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    weights = torch.clamp(ratio, max=cap) * mask
    metrics = {"tis_weight_mean": masked_mean(weights, mask).item(),
               "tis_capped_frac": masked_mean((ratio > cap).float(), mask).item(),
               "tis_log_ratio_abs": masked_mean(log_ratio.abs(), mask).item()}
    return weights, metrics
