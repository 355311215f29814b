"""GRPO's group-relative advantage: each member's reward against its group's mean, optionally divided by the
group's standard deviation (Shao et al., DeepSeekMath, 2024)."""

from __future__ import annotations

__all__ = ["grpo_advantages"]


def grpo_advantages(rewards: list[float], *, normalize_std: bool, eps: float = 1e-6) -> list[float]:
    """A_i = (R_i - mean(R)) / (std(R) + eps); std is the population std of the group."""
    if not rewards:
        return []
    mean = sum(rewards) / len(rewards)
    centered = [r - mean for r in rewards]
    if not normalize_std:
        return centered
    std = (sum(c * c for c in centered) / len(centered)) ** 0.5
    return [c / (std + eps) for c in centered]
