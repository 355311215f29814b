"""Per-token estimators of KL(p || q) from samples x ~ p, with log_ratio d = log q(x) - log p(x) (Schulman,
Approximating KL Divergence, 2020): k1 = -d (unbiased, high variance, can be negative), k2 = d^2 / 2 (biased, low
variance), k3 = exp(d) - 1 - d (unbiased, non-negative), low_var_kl = k3 clamped to [-10, 10] (verl's)."""

from __future__ import annotations

import torch
from torch import Tensor

from everstep.settings.training import KlEstimator

__all__ = ["adaptive_kl_coef", "k3_divergence", "kl_divergence"]

_LOW_VAR_KL_BOUND = 10.0
_MAX_PROPORTIONAL_ERROR = 0.2


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


def adaptive_kl_coef(kl_coef: float, kl: float, *, target: float, horizon: int, num_samples: int) -> float:
    """The next step's KL coefficient (Ziegler et al., Fine-Tuning Language Models from Human Preferences, 2019;
    verl's `AdaptiveKLController`): e = clip(kl / target - 1, -0.2, 0.2), kl_coef * (1 + e * num_samples /
    horizon). Above the target the penalty grows, below it shrinks, by at most 20% per horizon of samples.
    num_samples / horizon is capped at 1 (verl's is not), so that a horizon shorter than a batch cannot turn the
    coefficient negative."""
    error = min(max(kl / target - 1.0, -_MAX_PROPORTIONAL_ERROR), _MAX_PROPORTIONAL_ERROR)
    return kl_coef * (1.0 + error * min(1.0, num_samples / horizon))
