"""KL divergence between the policy and the reference model, and the KL coefficient controllers.

Per-token estimators of KL(pi || pi_ref) from the log-probs of the sampled tokens
(see http://joschu.net/blog/kl-approx.html). With p = log pi(y_t), q = log pi_ref(y_t):

    k1   ("k1", "kl"):           p - q                      unbiased, high variance, can be < 0
    abs  ("abs"):                |p - q|
    k2   ("k2", "mse"):          0.5 * (p - q)^2            biased, low variance, >= 0
    k3   ("k3", "low_var_kl"):   exp(q - p) - (q - p) - 1   unbiased, low variance, >= 0

The KL can be used two ways: as a reward penalty (token_level_rewards = scores - beta * kl, the
classic PPO-RLHF recipe, with a Fixed or Adaptive controller for beta) or as a loss term in the
actor (GRPO's "use_kl_loss", usually with k3).
"""

from __future__ import annotations

import torch

KL_KINDS = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl")


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate, same shape as the inputs ([B, T]).

        k1:  p - q
        abs: |p - q|
        k2:  0.5 * (p - q)^2
        k3:  exp(q - p) - (q - p) - 1, with (q - p) clamped to [-20, 20] before the exp and
             the result clamped to [-10, 10] (keeps one wild token from blowing up the loss)

    p = log_prob (policy), q = ref_log_prob (reference). Not masked: multiply by the response mask
    or aggregate with `agg_loss`.
    """
    log_ratio = log_prob - ref_log_prob
    if kind in ("k1", "kl"):
        return log_ratio
    if kind == "abs":
        return log_ratio.abs()
    if kind in ("k2", "mse"):
        return 0.5 * log_ratio.square()
    if kind in ("k3", "low_var_kl"):
        ref_minus_policy = torch.clamp(-log_ratio, min=-20.0, max=20.0)
        kl = torch.exp(ref_minus_policy) - ref_minus_policy - 1.0
        return torch.clamp(kl, min=-10.0, max=10.0)
    raise ValueError(f"unknown KL kind {kind!r}; choose one of {', '.join(KL_KINDS)}")


class FixedKLController:
    """A constant KL coefficient: `.value` never changes."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Nothing to do; present so both controllers can be used the same way."""


class AdaptiveKLController:
    """Proportional controller that steers the measured KL towards `target_kl` (Ziegler et al., 2019).

        error  = clip(current_kl / target_kl - 1, -0.2, 0.2)
        value *= 1 + error * n_steps / horizon

    `n_steps` is the number of samples (or steps) the KL was measured over; `horizon` sets how
    fast the coefficient moves.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float):
        if target_kl <= 0:
            raise ValueError(f"target_kl must be > 0 for the adaptive KL controller, got {target_kl}")
        if horizon <= 0:
            raise ValueError(f"horizon must be > 0 for the adaptive KL controller, got {horizon}")
        self.value = float(init_kl_coef)
        self.target_kl = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(float(current_kl) / self.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


def build_kl_controller(
    kind: str, kl_coef: float, target_kl: float | None = None, horizon: float | None = None
) -> FixedKLController | AdaptiveKLController:
    """"fixed" -> FixedKLController(kl_coef); "adaptive" -> AdaptiveKLController(kl_coef, target_kl, horizon)."""
    if kind == "fixed":
        return FixedKLController(kl_coef)
    if kind == "adaptive":
        if target_kl is None or horizon is None:
            raise ValueError("the adaptive KL controller needs both target_kl and horizon; set them in the config")
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"unknown KL controller {kind!r}; choose 'fixed' or 'adaptive'")


def kl_penalized_rewards(token_level_scores: torch.Tensor, log_prob: torch.Tensor, ref_log_prob: torch.Tensor,
                         response_mask: torch.Tensor, beta: float, kind: str = "k1") -> tuple[torch.Tensor, torch.Tensor]:
    """KL inside the reward (PPO-RLHF, Ziegler et al. 2019): -> (token_level_rewards, mean sequence KL).

        kl[i, t]      = kl_penalty(log_prob, ref_log_prob, kind)[i, t] * m[i, t]
        rewards[i, t] = scores[i, t] - beta * kl[i, t]
        mean_kl       = mean_i ( sum_t kl[i, t] / max(n_i, 1) )      (what the adaptive controller steers)

    log_prob is the policy that sampled the batch (the old log-probs); all tensors [B, T].
    """
    mask = response_mask.to(token_level_scores.dtype)
    kl = kl_penalty(log_prob, ref_log_prob, kind).to(token_level_scores.dtype) * mask
    per_sequence = kl.sum(-1) / mask.sum(-1).clamp_min(1.0)
    return token_level_scores - beta * kl, per_sequence.mean()
