"""GRPO's group-relative advantage: each member's reward against its group's mean, optionally divided by the
group's standard deviation (Shao et al., DeepSeekMath, 2024)."""

from __future__ import annotations

__all__ = ["grpo_advantages", "group_centered"]


def group_centered(rewards: list[float]) -> list[float]:
    """R_i - mean(R) over one group."""
    if not rewards:
        return []
    mean = sum(rewards) / len(rewards)
    return [r - mean for r in rewards]


def _group_advantages(rewards: list[float], normalize_std: bool, eps: float) -> list[float]:
    centered = group_centered(rewards)
    if not normalize_std or not centered:
        return centered
    std = (sum(c * c for c in centered) / len(centered)) ** 0.5
    return [c / (std + eps) for c in centered]


def grpo_advantages(groups: list[list[float]], *, normalize_std: bool, eps: float = 1e-6) -> list[list[float]]:
    """A_i = (R_i - mean(R)) / (std(R) + eps) within each group; std is the population std of the group."""
    return [_group_advantages(rewards, normalize_std, eps) for rewards in groups]
