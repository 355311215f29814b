"""Per-token estimators of KL(p || q) from samples x ~ p, with log_ratio d = log q(x) - log p(x) (Schulman,
Approximating KL Divergence, 2020): k1 = -d (unbiased, high variance, can be negative), k2 = d^2 / 2 (biased, low
variance), k3 = exp(d) - 1 - d (unbiased, non-negative), low_var_kl = k3 clamped to [-10, 10] (verl's)."""

from __future__ import annotations

import torch
from torch import Tensor

from everstep.settings.training import KlEstimator

__all__ = ["k3_divergence", "kl_divergence"]

_LOW_VAR_KL_BOUND = 10.0


def k3_divergence(log_ratio: Tensor, *, max_log_ratio: float | None = None) -> Tensor:
    """Schulman's k3 estimator of KL(p || q) per sample, with log_ratio = log q(x) - log p(x), x ~ p.

    exp(d) - 1 - d is non-negative and unbiased. `max_log_ratio` clamps d first, for use inside a
    loss where one far-off token must give a large finite value rather than inf.
    """
    if max_log_ratio is not None:
        log_ratio = log_ratio.clamp(max=max_log_ratio)
    return torch.exp(log_ratio) - 1.0 - log_ratio


def kl_divergence(log_ratio: Tensor, estimator: str, *, max_log_ratio: float | None = None) -> Tensor:
    """The `estimator`'s per-sample KL(p || q), same shape as `log_ratio` = log q - log p; `max_log_ratio` bounds
    k3's exponent (see `k3_divergence`)."""
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        return k3_divergence(log_ratio, max_log_ratio=max_log_ratio)
    if estimator == "low_var_kl":
        return k3_divergence(log_ratio, max_log_ratio=max_log_ratio).clamp(-_LOW_VAR_KL_BOUND, _LOW_VAR_KL_BOUND)
    raise ValueError(f"kl_estimator: must be one of {[e.value for e in KlEstimator]}, got {estimator!r}")
