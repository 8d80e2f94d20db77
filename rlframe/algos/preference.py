"""Preference losses: DPO and its relatives, and the Bradley-Terry loss of reward models.

All inputs are per-pair tensors [P]: the policy's and the reference's log-likelihoods of the chosen
(w) and rejected (l) responses, each either a SUM over response tokens or, length-normalised, a MEAN
(see `sequence_log_probs`). With  r_w = pi_w - ref_w,  r_l = pi_l - ref_l  (implicit rewards / beta):

    sigmoid (DPO, Rafailov et al. 2023):  loss = -(1 - eps) log s(beta (r_w - r_l)) - eps log s(-beta (r_w - r_l))
                                          (eps = label_smoothing: conservative DPO; eps = 0: plain DPO)
    ipo (Azar et al. 2023):               loss = (r_w - r_l - 1 / (2 beta))^2
    simpo (Meng et al. 2024):             loss = -log s(beta (pi_w - pi_l) - gamma)   (no reference model;
                                          SimPO uses length-normalised log-likelihoods: length_normalize=true)
    orpo (Hong et al. 2024):              loss = -pi_w - beta log s(log odds_w - log odds_l),
                                          log odds = pi - log(1 - exp(pi))   (no reference model; pi are
                                          per-token MEAN log-probs, so -pi_w is the chosen reply's NLL)

and, for UNPAIRED rows (`kto_loss`; Ethayarajh et al. 2024), each reply y labelled desirable or not:

    kto:   r = pi - ref,  z0 = max(0, mean over the batch of r) (detached: the KL reference point)
           desirable:    loss = w_D (1 - s(beta (r - z0)))
           undesirable:  loss = w_U (1 - s(beta (z0 - r)))

and the ranking loss of RRHF (Yuan et al. 2023, `rrhf_loss`) over a group of replies to one prompt with
reward scores q_i and per-token mean log-probs p_i:

    rrhf:  loss = sum_{i, j: q_j > q_i} max(0, p_i - p_j)  -  p_best      (p_best: the top-scored reply's)

where s is the logistic sigmoid. "Length-normalised variants" are any of the three on per-token MEAN
log-probs (LN-DPO; IPO as TRL runs it; SimPO). Bradley-Terry, for a scalar reward model r(x, y):

    loss = -log s(r(x, y_w) - r(x, y_l) - margin)

Each function returns the per-pair losses [P]; the caller reduces (a mean over the global number of pairs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PREFERENCE_LOSSES = ("sigmoid", "ipo", "simpo", "orpo", "kto")
PAIRED_LOSSES = ("sigmoid", "ipo", "simpo", "orpo")  # chosen/rejected pairs; kto reads unpaired labelled rows
REFERENCE_FREE = ("simpo", "orpo")
ALWAYS_LENGTH_NORMALISED = ("orpo",)  # its odds are of the per-token mean likelihood


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
    if loss_type not in PAIRED_LOSSES:
        raise ValueError(f"unknown preference loss '{loss_type}' for pairs; choose one of {', '.join(PAIRED_LOSSES)}"
                         + (" (kto reads unpaired rows: kto_loss)" if loss_type == "kto" else ""))
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
    elif loss_type == "simpo":
        losses = -F.logsigmoid(beta * diff - gamma)
    else:  # orpo: the chosen reply's NLL + the odds-ratio term
        losses = -policy_chosen - beta * F.logsigmoid(log_odds(policy_chosen) - log_odds(policy_rejected))
    stats = {"chosen_rewards": beta * chosen.detach(), "rejected_rewards": beta * rejected.detach()}
    return losses, stats


def log_odds(mean_log_probs: torch.Tensor) -> torch.Tensor:
    """log(p / (1 - p)) of p = exp(mean token log-prob) (< 1): log p - log(1 - exp(log p)); p -> 1 is clamped."""
    log_p = mean_log_probs.clamp(max=-1e-6)
    return log_p - torch.log1p(-torch.exp(log_p))


def kto_loss(policy: torch.Tensor, reference: torch.Tensor, desirable: torch.Tensor, *, beta: float = 0.1,
             desirable_weight: float = 1.0, undesirable_weight: float = 1.0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KTO on unpaired rows [B] (module docstring): per-row losses [B] and {"kl", "rewards"}.

    z0 is estimated from the batch's own rows (TRL estimates it from mismatched prompt/reply pairs, an
    extra forward pass): the mean implicit reward, detached and clamped at 0.
    """
    rewards = policy - reference
    kl = rewards.detach().mean().clamp(min=0.0)
    desirable = desirable.bool()
    losses = torch.where(desirable, desirable_weight * (1.0 - torch.sigmoid(beta * (rewards - kl))),
                         undesirable_weight * (1.0 - torch.sigmoid(beta * (kl - rewards))))
    return losses, {"kl": kl, "rewards": beta * rewards.detach()}


def rrhf_loss(mean_log_probs: torch.Tensor, scores: torch.Tensor, group: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """RRHF over rows [B] grouped by `group` (ids; replies to one prompt share one): the summed hinge
    ranking loss + the NLL (token mean) of each group's top-scored reply (ties: the first). Returns the
    loss summed over groups (the caller divides by the number of groups) and {"rank_loss", "nll_best"}."""
    same = group.unsqueeze(0) == group.unsqueeze(1)  # [i, j]
    better = (scores.unsqueeze(0) > scores.unsqueeze(1)) & same  # q_j > q_i
    rank = (torch.relu(mean_log_probs.unsqueeze(1) - mean_log_probs.unsqueeze(0)) * better).sum()
    best = torch.zeros_like(scores, dtype=torch.bool)
    for g in torch.unique(group):
        rows = (group == g).nonzero().flatten()
        best[rows[torch.argmax(scores[rows])]] = True
    nll = -(mean_log_probs * best).sum()
    return rank + nll, {"rank_loss": rank.detach(), "nll_best": nll.detach()}


def bradley_terry_loss(chosen_scores: torch.Tensor, rejected_scores: torch.Tensor,
                       margin: torch.Tensor | float = 0.0) -> torch.Tensor:
    """Per-pair -log s(r_w - r_l - margin) [P] (InstructGPT's reward-model loss; Llama-2's margin)."""
    return -F.logsigmoid(chosen_scores - rejected_scores - margin)


def sft_loss(log_probs: torch.Tensor, loss_mask: torch.Tensor, agg: dict) -> torch.Tensor:
    """Supervised fine-tuning: the negative log-likelihood of the masked tokens, aggregated by `agg`
    (`rlframe.algos.agg_loss` kwargs; token-mean: -sum_{i,t} m log p / num_tokens)."""
    from rlframe.algos.losses import agg_loss

    return agg_loss(-log_probs, loss_mask, **agg)
