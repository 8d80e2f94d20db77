"""Masked statistics shared by the advantage estimators, KL and policy losses.

Every function takes `mask` of the same shape as `values` (bool or float, 1 for a real token).
A fully masked input has no statistics: the mean is defined as 0 and the variance as 0, so a
batch of padding rows never produces NaN.
"""

from __future__ import annotations

import torch


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """sum(values * mask) over `dim` (all elements when `dim` is None)."""
    mask = mask.to(values.dtype)
    if dim is None:
        return (values * mask).sum()
    return (values * mask).sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """mean = sum(v * m) / max(sum(m), 1)  (0 where nothing is unmasked)."""
    mask = mask.to(values.dtype)
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    return masked_sum(values, mask, dim) / count.clamp_min(1.0)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance over all unmasked elements.

        mean = masked_mean(v, m);  n = sum(m)
        var  = sum(m * (v - mean)^2) / (n - 1)   if unbiased and n > 1
             = sum(m * (v - mean)^2) / n         otherwise (n = 0 gives 0)

    `unbiased=True` matches `torch.var`'s default (Bessel's correction).
    """
    mask = mask.to(values.dtype)
    mean = masked_mean(values, mask)
    squared_error_sum = masked_sum((values - mean) ** 2, mask)
    count = mask.sum()
    if unbiased and count > 1:
        return squared_error_sum / (count - 1)
    return squared_error_sum / count.clamp_min(1.0)


def masked_whiten(
    values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """Normalise to zero mean, unit variance over the unmasked elements.

        whitened = (v - mean) / sqrt(var + eps)     (var unbiased, as in `masked_var`)

    With `shift_mean=False` the mean is added back: only the scale changes. Values at masked
    positions are transformed too (callers multiply by the mask afterwards if they need zeros).
    """
    mean = masked_mean(values, mask)
    var = masked_var(values, mask, unbiased=True)
    whitened = (values - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return whitened
