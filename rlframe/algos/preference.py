"""Preference losses: DPO and its relatives, and the Bradley-Terry loss of reward models.

All inputs are per-pair tensors [P]: the policy's and the reference's log-likelihoods of the chosen
(w) and rejected (l) responses, each either a SUM over response tokens or, length-normalised, a MEAN
(see `sequence_log_probs`). With  r_w = pi_w - ref_w,  r_l = pi_l - ref_l  (implicit rewards / beta):

    sigmoid (DPO, Rafailov et al. 2023):  loss = -(1 - eps) log s(beta (r_w - r_l)) - eps log s(-beta (r_w - r_l))
                                          (eps = label_smoothing: conservative DPO; eps = 0: plain DPO)
    ipo (Azar et al. 2023):               loss = (r_w - r_l - 1 / (2 beta))^2
    simpo (Meng et al. 2024):             loss = -log s(beta (pi_w - pi_l) - gamma)   (no reference model;
                                          SimPO uses length-normalised log-likelihoods: length_normalize=true)

where s is the logistic sigmoid. "Length-normalised variants" are any of the three on per-token MEAN
log-probs (LN-DPO; IPO as TRL runs it; SimPO). Bradley-Terry, for a scalar reward model r(x, y):

    loss = -log s(r(x, y_w) - r(x, y_l) - margin)

Each function returns the per-pair losses [P]; the caller reduces (a mean over the global number of pairs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PREFERENCE_LOSSES = ("sigmoid", "ipo", "simpo")
REFERENCE_FREE = ("simpo",)


def sequence_log_probs(log_probs: torch.Tensor, mask: torch.Tensor, length_normalize: bool = False) -> torch.Tensor:
    """[B, T] token log-probs -> [B]: sum_t m_t log p_t, or (length_normalize) that sum / max(sum_t m_t, 1)."""
    mask = mask.to(log_probs.dtype)
    total = (log_probs * mask).sum(-1)
    return total / mask.sum(-1).clamp(min=1.0) if length_normalize else total


def preference_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor,
                    ref_chosen: torch.Tensor | None, ref_rejected: torch.Tensor | None, *,
                    loss_type: str = "sigmoid", beta: float = 0.1, gamma: float = 0.5,
                    label_smoothing: float = 0.0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-pair loss [P] and the pair statistics (see the module docstring for the formulas).

    Returns (losses, {"chosen_rewards", "rejected_rewards"}): beta * (pi - ref) per side (beta * pi for
    the reference-free simpo); accuracy = chosen > rejected, margin = chosen - rejected.
    """
    if loss_type not in PREFERENCE_LOSSES:
        raise ValueError(f"unknown preference loss '{loss_type}'; choose one of {', '.join(PREFERENCE_LOSSES)}")
    if loss_type in REFERENCE_FREE:
        chosen, rejected = policy_chosen, policy_rejected
    else:
        if ref_chosen is None or ref_rejected is None:
            raise ValueError(f"the {loss_type} loss needs the reference log-probs")
        chosen, rejected = policy_chosen - ref_chosen, policy_rejected - ref_rejected
    diff = chosen - rejected
    if loss_type == "sigmoid":
        losses = -(1.0 - label_smoothing) * F.logsigmoid(beta * diff) - label_smoothing * F.logsigmoid(-beta * diff)
    elif loss_type == "ipo":
        losses = (diff - 1.0 / (2.0 * beta)) ** 2
    else:  # simpo
        losses = -F.logsigmoid(beta * diff - gamma)
    stats = {"chosen_rewards": beta * chosen.detach(), "rejected_rewards": beta * rejected.detach()}
    return losses, stats


def bradley_terry_loss(chosen_scores: torch.Tensor, rejected_scores: torch.Tensor,
                       margin: torch.Tensor | float = 0.0) -> torch.Tensor:
    """Per-pair -log s(r_w - r_l - margin) [P] (InstructGPT's reward-model loss; Llama-2's margin)."""
    return -F.logsigmoid(chosen_scores - rejected_scores - margin)


def sft_loss(log_probs: torch.Tensor, loss_mask: torch.Tensor, agg: dict) -> torch.Tensor:
    """Supervised fine-tuning: the negative log-likelihood of the masked tokens, aggregated by `agg`
    (`rlframe.algos.agg_loss` kwargs; token-mean: -sum_{i,t} m log p / num_tokens)."""
    from rlframe.algos.losses import agg_loss

    return agg_loss(-log_probs, loss_mask, **agg)
