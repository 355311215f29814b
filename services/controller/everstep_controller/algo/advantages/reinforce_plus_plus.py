"""REINFORCE++ (Hu, 2025): advantages normalized over the whole batch instead of each group, without
(`reinforce_plus_plus`) or with (`reinforce_plus_plus_baseline`) the group mean subtracted first.

The normalization is over the batch's samples (each sample counts once). verl's whitens over tokens, so that
longer responses weigh more in the mean and std, and adds a token-level KL to the reward first (token t's return
holds the KL of the tokens from t on); everstep's KL is a loss term (`trainer.kl_coef`) or, with
`trainer.kl_in_reward`, one sum per sample taken off its reward (`algo.reward_kl`), so every token's return is the
sample's (penalised) reward.
"""

from __future__ import annotations

from everstep_controller.algo.advantages.grpo import group_centered

__all__ = ["reinforce_plus_plus_advantages", "reinforce_plus_plus_baseline_advantages"]


def _whiten_batch(groups: list[list[float]], eps: float) -> list[list[float]]:
    values = [v for group in groups for v in group]
    if not values:
        return [[] for _ in groups]
    mean = sum(values) / len(values)
    std = (sum((v - mean) ** 2 for v in values) / len(values)) ** 0.5
    return [[(v - mean) / (std + eps) for v in group] for group in groups]


def reinforce_plus_plus_advantages(groups: list[list[float]], *, normalize_std: bool = False,
                                   eps: float = 1e-6) -> list[list[float]]:
    """A_i = (R_i - mean_batch(R)) / (std_batch(R) + eps), over every sample of every group (`normalize_std` is
    not read: the batch std always applies)."""
    return _whiten_batch(groups, eps)


def reinforce_plus_plus_baseline_advantages(groups: list[list[float]], *, normalize_std: bool = False,
                                            eps: float = 1e-6) -> list[list[float]]:
    """A_i = whiten_batch(R_i - mean_group(R)): the group mean as baseline, then the batch's mean and std."""
    return _whiten_batch([group_centered(rewards) for rewards in groups], eps)
