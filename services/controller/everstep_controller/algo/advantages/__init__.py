"""Advantage estimators by name: one module each, registered in `ADVANTAGE_ESTIMATORS` (as verl's
`register_adv_est`), looked up with `get_advantage_estimator`, which refuses an unknown name with the known ones.

An estimator maps one group's rewards (in member order) to one advantage per member.
"""

from __future__ import annotations

from typing import Protocol

from everstep_controller.algo.advantages.grpo import grpo_advantages

__all__ = ["ADVANTAGE_ESTIMATORS", "AdvantageEstimator", "get_advantage_estimator"]


class AdvantageEstimator(Protocol):
    def __call__(self, rewards: list[float], *, normalize_std: bool) -> list[float]:
        """One advantage per member of the group whose rewards are `rewards`."""
        ...


ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {
    "grpo": grpo_advantages,
}


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    """The estimator registered as `name`; ValueError naming the known ones for any other name."""
    try:
        return ADVANTAGE_ESTIMATORS[name]
    except KeyError:
        known = ", ".join(sorted(ADVANTAGE_ESTIMATORS))
        raise ValueError(f"unknown advantage estimator {name!r} (known: {known})") from None
