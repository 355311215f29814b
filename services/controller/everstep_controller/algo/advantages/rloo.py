"""REINFORCE leave-one-out: each member's reward against the mean of its group's other members (Kool et al., 2019;
Ahmadian et al., Back to Basics, 2024), an unbiased baseline."""

from __future__ import annotations

__all__ = ["rloo_advantages"]


def _leave_one_out(rewards: list[float]) -> list[float]:
    n = len(rewards)
    if n < 2:  # no other member to compare with
        return [0.0] * n
    total = sum(rewards)
    return [r - (total - r) / (n - 1) for r in rewards]


def rloo_advantages(groups: list[list[float]], *, normalize_std: bool = False) -> list[list[float]]:
    """A_i = R_i - (sum_j R_j - R_i) / (n - 1) within each group of n (`normalize_std` is not read)."""
    return [_leave_one_out(rewards) for rewards in groups]
