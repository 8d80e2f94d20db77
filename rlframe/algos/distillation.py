"""On-policy distillation: the student samples, a frozen teacher pi_T scores every sampled token.

Shapes: B sequences, T response tokens, K top-k tokens per position. All log-probs are natural logs at
temperature 1 for the teacher. Every top-k loss compares two distributions over K + 1 buckets: the K
listed tokens and one tail bucket holding the rest of the mass (1 - sum_k p_k), so that each is an exact
divergence between two distributions: >= 0, and 0 when the two models agree on the listed tokens and the
tail (TRL's server teacher does the same).

Two kinds of entries:

- `reverse_kl_advantage` (k1): the per-token reverse KL estimate log pi(y_t) - log pi_T(y_t) as a dense
  advantage, mixed with the configured estimator's advantages (slime's A_t - lambda (log pi - log pi_T)).
- the loss terms of `DISTILLATION_LOSSES` (k3, forward_kl_topk, jsd, reverse_kl_student_topk): each a
  per-token loss matrix [B, T] from a `DistillationInputs`; the actor's objective aggregates it with
  `agg_loss` like any other term and adds coef times it to the loss.

    per_token = get_distillation_loss("forward_kl_topk")(inputs, beta=0.5)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

TAIL_FLOOR = 1e-8  # the smallest tail-bucket mass (a top-k holding all the mass leaves log 0 otherwise)


@dataclass
class DistillationInputs:
    """What a distillation loss may read, for one micro-batch (None: not computed for this loss mode).

    log_prob                   [B, T]     the student's log-prob of the sampled token (with gradient)
    teacher_log_prob           [B, T]     the teacher's log-prob of the sampled token
    teacher_topk_log_probs     [B, T, K]  the teacher's top-k log-probs
    student_at_teacher_topk    [B, T, K]  the student's log-probs of the teacher's top-k tokens (with gradient)
    student_topk_log_probs     [B, T, K]  the student's log-probs of its own top-k tokens (with gradient)
    teacher_at_student_topk    [B, T, K]  the teacher's log-probs of the student's top-k tokens
    """

    log_prob: torch.Tensor
    teacher_log_prob: torch.Tensor
    teacher_topk_log_probs: torch.Tensor | None = None
    student_at_teacher_topk: torch.Tensor | None = None
    student_topk_log_probs: torch.Tensor | None = None
    teacher_at_student_topk: torch.Tensor | None = None


def with_tail(topk_log_probs: torch.Tensor) -> torch.Tensor:
    """[.., K] log-probs -> [.., K + 1]: the K entries and log(max(1 - sum_k exp(l_k), TAIL_FLOOR))."""
    mass = torch.exp(topk_log_probs).sum(-1, keepdim=True)
    tail = torch.log(torch.clamp(1.0 - mass, min=TAIL_FLOOR))
    return torch.cat([topk_log_probs, tail], dim=-1)


def bucket_kl(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """KL(p || q) = sum_j p_j (log p_j - log q_j) over the last dim, for log-probs of two distributions."""
    return (torch.exp(log_p) * (log_p - log_q)).sum(-1)


# ----------------------------------------------------------------------------------------------
# k1: the reverse KL as a dense advantage


def reverse_kl_advantage(advantages: torch.Tensor, log_prob: torch.Tensor, teacher_log_prob: torch.Tensor,
                         response_mask: torch.Tensor, coef: float, use_task_reward: bool) -> torch.Tensor:
    """k1: A'_t = [A_t if use_task_reward else 0] - coef * (log pi(y_t) - log pi_T(y_t)), 0 outside the mask.

    log pi - log pi_T is the single-sample (k1) estimate of the per-token reverse KL(pi || pi_T) on the
    student's own samples: the policy gradient with this advantage minimises the sequence reverse KL (no
    discount, no baseline; each token is credited with its own KL only, as slime and verl's k1 do).
    The log-probs are treated as constants (no gradient flows through the advantage).
    """
    kl = (log_prob - teacher_log_prob).detach()
    task = advantages if use_task_reward else torch.zeros_like(advantages)
    return (task - coef * kl) * response_mask.to(advantages.dtype)


# ----------------------------------------------------------------------------------------------
# loss terms: per-token [B, T] matrices


DistillationLoss = Callable[..., torch.Tensor]
DISTILLATION_LOSSES: dict[str, DistillationLoss] = {}
NEEDS_TEACHER_TOPK = {"forward_kl_topk", "jsd"}  # read the student's log-probs at the teacher's top-k
NEEDS_STUDENT_TOPK = {"reverse_kl_student_topk"}  # read the teacher's log-probs at the student's top-k


def register_distillation_loss(name: str) -> Callable[[DistillationLoss], DistillationLoss]:
    """Decorator: make `fn(inputs: DistillationInputs, *, beta) -> [B, T]` available as `get_distillation_loss(name)`."""

    def decorator(fn: DistillationLoss) -> DistillationLoss:
        if name in DISTILLATION_LOSSES:
            raise ValueError(f"distillation loss {name!r} is already registered")
        DISTILLATION_LOSSES[name] = fn
        return fn

    return decorator


def get_distillation_loss(name: str) -> DistillationLoss:
    try:
        return DISTILLATION_LOSSES[name]
    except KeyError:
        raise KeyError(f"unknown distillation loss {name!r}; available: {', '.join(sorted(DISTILLATION_LOSSES))}") from None


@register_distillation_loss("k3")
def k3_loss(inputs: DistillationInputs, **_) -> torch.Tensor:
    """k3 (Schulman's low-variance estimator) of the per-token reverse KL(pi || pi_T) on the sampled token:

        r   = log pi_T(y_t) - log pi(y_t)
        l_t = exp(r) - 1 - r                      (>= 0; its expectation under pi is KL(pi || pi_T))
    """
    r = inputs.teacher_log_prob - inputs.log_prob
    return torch.exp(r) - 1.0 - r


@register_distillation_loss("forward_kl_topk")
def forward_kl_topk_loss(inputs: DistillationInputs, **_) -> torch.Tensor:
    """GKD's forward KL over the teacher's top-k (+ tail bucket), per position:

        t = with_tail(log pi_T(v_1..v_K)),  s = with_tail(log pi(v_1..v_K)),   v = the teacher's top-k tokens
        l_t = sum_j exp(t_j) (t_j - s_j)         = KL(teacher || student) over the K + 1 buckets
    """
    return bucket_kl(with_tail(inputs.teacher_topk_log_probs), with_tail(inputs.student_at_teacher_topk))


@register_distillation_loss("jsd")
def jsd_loss(inputs: DistillationInputs, *, beta: float = 0.5, **_) -> torch.Tensor:
    """Generalized Jensen-Shannon divergence (GKD, Agarwal et al. 2024) over the teacher's top-k (+ tail):

        P = teacher buckets, Q = student buckets (as forward_kl_topk),  M = beta P + (1 - beta) Q
        l_t = beta KL(P || M) + (1 - beta) KL(Q || M)          0 < beta < 1 (0.5: the symmetric JSD)
    """
    log_p = with_tail(inputs.teacher_topk_log_probs)
    log_q = with_tail(inputs.student_at_teacher_topk)
    log_m = torch.logsumexp(torch.stack([log_p + math.log(beta), log_q + math.log(1.0 - beta)]), dim=0)
    return beta * bucket_kl(log_p, log_m) + (1.0 - beta) * bucket_kl(log_q, log_m)


@register_distillation_loss("reverse_kl_student_topk")
def reverse_kl_student_topk_loss(inputs: DistillationInputs, **_) -> torch.Tensor:
    """Reverse KL over the student's own top-k (+ tail), per position:

        s = with_tail(log pi(u_1..u_K)),  t = with_tail(log pi_T(u_1..u_K)),   u = the student's top-k tokens
        l_t = sum_j exp(s_j) (s_j - t_j)         = KL(student || teacher) over the K + 1 buckets

    The mode-seeking direction of k1/k3 with K tokens per position instead of one sample: lower variance.
    """
    return bucket_kl(with_tail(inputs.student_topk_log_probs), with_tail(inputs.teacher_at_student_topk))


# ----------------------------------------------------------------------------------------------
# top-k helpers (used inside the engines' forward) and the per-step metrics


def log_probs_at(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[ids]: logits [.., V], ids [.., K] -> [.., K] (float32)."""
    logits = logits.float()
    return logits.gather(-1, ids) - torch.logsumexp(logits, dim=-1, keepdim=True)


def top_k_log_probs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k most likely tokens of softmax(logits): (ids [.., k] int64, log-probs [.., k] float32)."""
    logits = logits.float()
    values, ids = torch.topk(logits, k, dim=-1)
    return ids, values - torch.logsumexp(logits, dim=-1, keepdim=True)


def topk_overlap(ids_a: torch.Tensor, ids_b: torch.Tensor) -> torch.Tensor:
    """|A ∩ B| / K per position, for two top-k id sets [.., K] (ids within a set are distinct)."""
    return (ids_a.unsqueeze(-1) == ids_b.unsqueeze(-2)).any(-1).float().mean(-1)


__all__ = ["DISTILLATION_LOSSES", "DistillationInputs", "NEEDS_STUDENT_TOPK", "NEEDS_TEACHER_TOPK", "bucket_kl",
           "forward_kl_topk_loss", "get_distillation_loss", "jsd_loss", "k3_loss", "log_probs_at",
           "register_distillation_loss", "reverse_kl_advantage", "reverse_kl_student_topk_loss", "top_k_log_probs",
           "topk_overlap", "with_tail"]
