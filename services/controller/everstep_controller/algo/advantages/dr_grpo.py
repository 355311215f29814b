"""Dr. GRPO's advantage: each member's reward against its group's mean, never divided by the group's standard
deviation, which biases toward questions of low reward variance (Liu et al., Understanding R1-Zero-Like Training,
2025). The paper's other change, the constant length divisor, is the loss's aggregation seq-mean-token-sum-norm."""

from __future__ import annotations

from everstep_controller.algo.advantages.grpo import group_centered

__all__ = ["dr_grpo_advantages"]


def dr_grpo_advantages(groups: list[list[float]], *, normalize_std: bool = False) -> list[list[float]]:
    """A_i = R_i - mean(R) within each group (`normalize_std` is not read)."""
    return [group_centered(rewards) for rewards in groups]
