"""Policy losses, loss aggregation and the log-prob / entropy helpers the workers use.

Shapes: B sequences, T response tokens; `loss_mask`/`response_mask` [B, T] is 1 on real tokens.

Every policy loss has the same signature

    loss, metrics = fn(old_log_prob, log_prob, advantages, response_mask, config=PolicyLossConfig(), agg=agg)

where `agg` holds the keyword arguments of `agg_loss` (mode, num_tokens, num_seqs, horizon, and
`weights` under an off-policy correction: a loss passes `**agg` on to agg_loss, and so applies them).
`metrics` are plain floats computed on the tensors given (a micro-batch): the worker averages them.

Register your own with `@register_policy_loss("name")` or through `rlframe.algos.plugins`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from rlframe.algos.utils import masked_mean

# ----------------------------------------------------------------------------------------------
# aggregation

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    mode: str = "token-mean",
    *,
    num_tokens: float | torch.Tensor | None = None,
    num_seqs: float | torch.Tensor | None = None,
    horizon: int | None = None,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss matrix [B, T] to a scalar.

    With l = loss_mat (times `weights` [B, T] when given: per-token weights such as the truncated
    importance weights of rlframe/algos/off_policy.py; they do not change the normalisers),
    m = loss_mask, n_i = sum_t m[i, t]:

        "token-mean":               sum_{i,t} l*m / num_tokens
        "seq-mean-token-sum":       sum_i (sum_t l*m) / num_seqs
        "seq-mean-token-mean":      sum_i (sum_t l*m / max(n_i, 1)) / num_seqs
        "seq-mean-token-sum-norm":  sum_{i,t} l*m / (num_seqs * horizon)      (Dr. GRPO)

    The split contract (why the normalisers are arguments):
        A mini-batch is cut into micro-batches (gradient accumulation) and spread over
        data-parallel ranks. Pass `num_tokens` = the number of unmasked tokens and `num_seqs`
        = the number of sequences in the WHOLE mini-batch (all micro-batches, all ranks), and
        `horizon` = one fixed length for all of them. Then every mode is a plain sum over
        micro-batches, so

            sum over micro-batches and ranks of agg_loss(micro-batch)  ==  agg_loss(mini-batch)

        and so are the gradients: accumulate micro-batch gradients with `loss.backward()` (no
        division by the number of micro-batches) and SUM gradients over ranks. DDP/FSDP average
        over ranks instead, so a worker using them multiplies the loss by the data-parallel
        world size.

    Defaults (when a normaliser is None) are the local counts of this call:
        num_tokens = sum(m);  num_seqs = number of rows with at least one unmasked token (fully
        masked rows, e.g. padding rows added to divide the batch evenly, do not count);
        horizon = T (loss_mat.shape[-1]).
    A normaliser below 1 is treated as 1, so an all-masked input gives loss 0, never NaN.
    """
    mask = loss_mask.to(loss_mat.dtype)
    if weights is not None:
        loss_mat = loss_mat * weights.to(loss_mat.dtype)
    masked_loss = loss_mat * mask
    if mode == "token-mean":
        if num_tokens is None:
            num_tokens = mask.sum()
        return masked_loss.sum() / _as_denominator(num_tokens, loss_mat)
    if num_seqs is None:
        num_seqs = (mask.sum(dim=-1) > 0).sum()
    if mode == "seq-mean-token-sum":
        return masked_loss.sum() / _as_denominator(num_seqs, loss_mat)
    if mode == "seq-mean-token-mean":
        per_sequence = masked_loss.sum(dim=-1) / mask.sum(dim=-1).clamp_min(1.0)
        return per_sequence.sum() / _as_denominator(num_seqs, loss_mat)
    if mode == "seq-mean-token-sum-norm":
        if horizon is None:
            horizon = loss_mat.shape[-1]
        return masked_loss.sum() / (_as_denominator(num_seqs, loss_mat) * horizon)
    raise ValueError(f"unknown loss aggregation mode {mode!r}; choose one of {', '.join(AGG_MODES)}")


def _as_denominator(count, like: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(count, dtype=like.dtype, device=like.device).clamp_min(1.0)


# ----------------------------------------------------------------------------------------------
# policy losses


@dataclass
class PolicyLossConfig:
    """The clipping bounds of a policy loss; each loss reads them in its own way (see its docstring).

    clip_ratio_low / clip_ratio_high: the ratio range [1 - low, 1 + high]. vanilla: the token ratio
        (high > low is DAPO's "clip-higher", e.g. 0.2 / 0.28); gspo: the sequence ratio (the paper's
        3e-4 / 4e-4); cispo: the bounds of the importance weight, low = None for no lower bound.
    clip_ratio_c: vanilla's dual-clip bound (Ye et al., 2020): for A < 0 the loss is capped at -A * c,
        so a huge ratio on a negative-advantage token cannot dominate. Must be > 1; None disables.

    The defaults are vanilla PPO's; `policy_loss_config(name)` gives another loss's published ones.
    """

    clip_ratio_low: float | None = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float | None = 3.0


# Each built-in loss's published defaults, keyed by the `actor.*` option. A key a loss does not list is
# one it ignores (configuring it is an error, see rlframe.config); None is a real value (no bound).
POLICY_LOSS_DEFAULTS: dict[str, dict] = {
    # PPO (Schulman et al., 2017): epsilon = 0.2; dual clip c = 3 (Ye et al., 2020); token-mean as verl.
    "vanilla": {"clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 3.0, "loss_agg_mode": "token-mean"},
    # GSPO (Zheng et al., 2025): the sequence-ratio range of its experiments, 3e-4 / 4e-4; per-sequence mean.
    "gspo": {"clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4, "loss_agg_mode": "seq-mean-token-mean"},
    # CISPO (MiniMax-M1, 2025, eq. 4-5): no lower bound on the weight, only the upper one is tuned (the
    # paper gives no value; 0.28 as DAPO's clip-higher); normalised by all tokens of the batch.
    "cispo": {"clip_ratio_low": None, "clip_ratio_high": 0.28, "loss_agg_mode": "token-mean"},
}


def policy_loss_defaults(name: str) -> dict:
    """The published defaults of policy loss `name` ({actor key: value}), only for the keys it reads.

    A loss registered without an entry (a user's) receives a whole PolicyLossConfig: vanilla's numbers.
    """
    return dict(POLICY_LOSS_DEFAULTS.get(name, POLICY_LOSS_DEFAULTS["vanilla"]))


def policy_loss_config(name: str, **overrides) -> PolicyLossConfig:
    """PolicyLossConfig with the published defaults of loss `name`, then `overrides` (e.g. for tests)."""
    defaults = policy_loss_defaults(name)
    defaults.pop("loss_agg_mode")
    defaults.setdefault("clip_ratio_c", None)
    return PolicyLossConfig(**{**defaults, **overrides})


class PolicyLoss(Protocol):
    def __call__(
        self,
        old_log_prob: torch.Tensor,
        log_prob: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        *,
        config: PolicyLossConfig,
        agg: dict | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]: ...


POLICY_LOSSES: dict[str, PolicyLoss] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLoss], PolicyLoss]:
    """Decorator: make `fn` available as `get_policy_loss(name)`."""

    def decorator(fn: PolicyLoss) -> PolicyLoss:
        if name in POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is already registered")
        POLICY_LOSSES[name] = fn
        return fn

    return decorator


def get_policy_loss(name: str) -> PolicyLoss:
    """Look a policy loss up by name; the error lists the registered names."""
    try:
        return POLICY_LOSSES[name]
    except KeyError:
        available = ", ".join(sorted(POLICY_LOSSES))
        raise KeyError(
            f"unknown policy loss {name!r}; available: {available}. "
            "Register a new one with @register_policy_loss or a plugin file."
        ) from None


def _require_lower_bound(config: PolicyLossConfig, loss_name: str) -> None:
    if config.clip_ratio_low is None:
        raise ValueError(f"the {loss_name} policy loss needs clip_ratio_low (its ratio range is [1 - low, 1 + high])")


def _fraction(condition: torch.Tensor, mask: torch.Tensor) -> float:
    return masked_mean(condition.to(torch.float32), mask.to(torch.float32)).item()


@register_policy_loss("vanilla")
def compute_vanilla_policy_loss(old_log_prob, log_prob, advantages, response_mask, *, config, agg=None):
    """PPO clipped surrogate with asymmetric clip and dual-clip.

        ratio  = exp(log_prob - old_log_prob)                  (log-ratio clamped to [-20, 20])
        l_clip = max(-A * ratio, -A * clip(ratio, 1 - low, 1 + high))    (clip_ratio_low/high)
        l      = min(l_clip, -A * c)   if A < 0 and c (clip_ratio_c) is not None
               = l_clip                otherwise (dual clip off)
        loss   = agg_loss(l, mask, **agg)

    metrics: pg_clipfrac (tokens where the clipped term is the larger), pg_clipfrac_lower (A < 0
    tokens capped by the dual clip), ppo_kl (masked mean of old_log_prob - log_prob), ratio_mean.
    """
    c = config.clip_ratio_c
    if c is not None and c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 (or None to disable dual-clip), got {c}")
    _require_lower_bound(config, "vanilla")
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - config.clip_ratio_low, 1.0 + config.clip_ratio_high)
    loss_mat = torch.maximum(unclipped, clipped)
    metrics = {"pg_clipfrac": _fraction(clipped > unclipped, response_mask)}
    if c is not None:
        dual_bound = -advantages * c
        is_negative = advantages < 0
        metrics["pg_clipfrac_lower"] = _fraction((loss_mat > dual_bound) & is_negative, response_mask)
        loss_mat = torch.where(is_negative, torch.minimum(loss_mat, dual_bound), loss_mat)
    else:
        metrics["pg_clipfrac_lower"] = 0.0
    loss = agg_loss(loss_mat, response_mask, **(agg or {}))
    metrics["ppo_kl"] = masked_mean(-log_ratio, response_mask).item()
    metrics["ratio_mean"] = masked_mean(ratio, response_mask).item()
    return loss, metrics


@register_policy_loss("gspo")
def compute_gspo_policy_loss(old_log_prob, log_prob, advantages, response_mask, *, config, agg=None):
    """GSPO (Zheng et al., 2025): one importance ratio per sequence.

        s_i     = exp( sum_t m * (log_prob - old_log_prob) / n_i )      (geometric-mean ratio)
        s_i,t   = sg(s_i) * exp(log_prob_t - sg(log_prob_t))            (= s_i in value; its
                  gradient is s_i * grad log_prob_t, so "seq-mean-token-mean" gives exactly
                  grad s_i = s_i * mean_t grad log_prob_t)
        l_i,t   = max(-A * s_i,t, -A * clip(s_i,t, 1 - low, 1 + high))    (low, high: clip_ratio_low/high)
        loss    = agg_loss(l, mask, **agg)

    The paper's objective is the per-sequence mean: agg "seq-mean-token-mean" (its default here, see
    POLICY_LOSS_DEFAULTS, with the paper's range 3e-4 / 4e-4); "token-mean" weighs sequences by length.
    No dual clip (clip_ratio_c is not read).

    The sequence log-ratio is clamped to at most 10 before the exp.
    metrics: pg_clipfrac, ppo_kl, ratio_mean (mean sequence ratio over non-empty rows).
    """
    _require_lower_bound(config, "gspo")
    mask = response_mask.to(log_prob.dtype)
    log_ratio = log_prob - old_log_prob
    lengths = mask.sum(dim=-1)
    seq_log_ratio = (log_ratio * mask).sum(dim=-1) / lengths.clamp_min(1.0)
    token_log_ratio = seq_log_ratio.detach()[:, None] + log_prob - log_prob.detach()
    ratio = torch.exp(torch.clamp(token_log_ratio, max=10.0))
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - config.clip_ratio_low, 1.0 + config.clip_ratio_high)
    loss_mat = torch.maximum(unclipped, clipped)
    loss = agg_loss(loss_mat, mask, **(agg or {}))
    non_empty = (lengths > 0).to(log_prob.dtype)
    metrics = {
        "pg_clipfrac": _fraction(clipped > unclipped, mask),
        "pg_clipfrac_lower": 0.0,
        "ppo_kl": masked_mean(-log_ratio, mask).item(),
        "ratio_mean": masked_mean(torch.exp(torch.clamp(seq_log_ratio, max=10.0)), non_empty).item(),
    }
    return loss, metrics


@register_policy_loss("cispo")
def compute_cispo_policy_loss(old_log_prob, log_prob, advantages, response_mask, *, config, agg=None):
    """CISPO (MiniMax-M1, 2025): REINFORCE weighted by a clipped, stop-gradient importance ratio.

        ratio = exp(log_prob - old_log_prob)                  (log-ratio clamped to [-20, 20])
        w     = sg(clip(ratio, max = 1 + high))     (and min = 1 - low when clip_ratio_low is not None)
        l     = -w * A * log_prob
        loss  = agg_loss(l, mask, **agg)               (the paper: "token-mean" over the batch)

    Unlike PPO no token's gradient is dropped: the clip bounds the weight, not the update. The paper
    sets no lower bound (clip_ratio_low = None) and tunes only the upper one. No dual clip.
    metrics: pg_clipfrac (tokens whose weight was clipped), ppo_kl, ratio_mean.
    """
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    low = None if config.clip_ratio_low is None else 1.0 - config.clip_ratio_low
    weight = torch.clamp(ratio, min=low, max=1.0 + config.clip_ratio_high).detach()
    loss_mat = -weight * advantages * log_prob
    loss = agg_loss(loss_mat, response_mask, **(agg or {}))
    metrics = {
        "pg_clipfrac": _fraction(weight != ratio.detach(), response_mask),
        "pg_clipfrac_lower": 0.0,
        "ppo_kl": masked_mean(-log_ratio, response_mask).item(),
        "ratio_mean": masked_mean(ratio, response_mask).item(),
    }
    return loss, metrics


# ----------------------------------------------------------------------------------------------
# log-probs and entropy from logits


def log_probs_from_logits(
    logits: torch.Tensor, labels: torch.Tensor, chunk_size: int | None = None
) -> torch.Tensor:
    """log softmax(logits)[label] = logits[label] - logsumexp(logits), shape of `labels`.

    Never materialises the full [.., V] log-softmax: only the gathered logit and the logsumexp.
    Computed in float32 (logits of lower precision are upcast chunk by chunk). `chunk_size`
    processes that many positions at a time along the flattened leading dims, bounding the
    float32 copy to chunk_size x V (useful under no_grad for long sequences and large vocabularies).
    """
    vocab = logits.shape[-1]
    flat_logits = logits.reshape(-1, vocab)
    flat_labels = labels.reshape(-1)
    step = flat_logits.shape[0] if not chunk_size else chunk_size
    pieces = []
    for start in range(0, flat_logits.shape[0], max(step, 1)):
        chunk = flat_logits[start : start + step].float()
        picked = chunk.gather(-1, flat_labels[start : start + step].unsqueeze(-1)).squeeze(-1)
        pieces.append(picked - torch.logsumexp(chunk, dim=-1))
    out = torch.cat(pieces) if pieces else flat_logits.new_zeros(0, dtype=torch.float32)
    return out.reshape(labels.shape)


def entropy_from_logits(logits: torch.Tensor, chunk_size: int | None = None) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim: H = logsumexp(z) - sum_v softmax(z)_v * z_v.

    Stable for large logits (no log of a tiny probability). Float32, shape logits.shape[:-1];
    `chunk_size` as in `log_probs_from_logits`.
    """
    vocab = logits.shape[-1]
    flat_logits = logits.reshape(-1, vocab)
    step = flat_logits.shape[0] if not chunk_size else chunk_size
    pieces = []
    for start in range(0, flat_logits.shape[0], max(step, 1)):
        chunk = flat_logits[start : start + step].float()
        probs = torch.softmax(chunk, dim=-1)
        pieces.append(torch.logsumexp(chunk, dim=-1) - (probs * chunk).sum(dim=-1))
    out = torch.cat(pieces) if pieces else flat_logits.new_zeros(0, dtype=torch.float32)
    return out.reshape(logits.shape[:-1])
