"""Advantage estimators by name: one module each, registered in `ADVANTAGE_ESTIMATORS` (as verl's
`register_adv_est`), looked up with `get_advantage_estimator`, which refuses an unknown name with the known ones.

An estimator maps a step's groups of rewards (each in member order) to one advantage per member. A new estimator
is a module with its function and a line in the table (and a member of
`everstep.settings.training.AdvantageEstimator`, so that a job can name it).
"""

from __future__ import annotations

from typing import Protocol

from everstep_controller.algo.advantages.dr_grpo import dr_grpo_advantages
from everstep_controller.algo.advantages.grpo import grpo_advantages
from everstep_controller.algo.advantages.reinforce_plus_plus import (
    reinforce_plus_plus_advantages,
    reinforce_plus_plus_baseline_advantages,
)
from everstep_controller.algo.advantages.rloo import rloo_advantages

__all__ = ["ADVANTAGE_ESTIMATORS", "AdvantageFunction", "get_advantage_estimator"]


class AdvantageFunction(Protocol):
    def __call__(self, groups: list[list[float]], *, normalize_std: bool) -> list[list[float]]:
        """One advantage per member of each group, `groups[g][i]` being member i's reward; `normalize_std` is
        read by grpo only (the job spec refuses it for the others)."""
        ...


ADVANTAGE_ESTIMATORS: dict[str, AdvantageFunction] = {
    "grpo": grpo_advantages,
    "dr_grpo": dr_grpo_advantages,
    "rloo": rloo_advantages,
    "reinforce_plus_plus": reinforce_plus_plus_advantages,
    "reinforce_plus_plus_baseline": reinforce_plus_plus_baseline_advantages,
}


def get_advantage_estimator(name: str) -> AdvantageFunction:
    """The estimator registered as `name`; ValueError naming the known ones for any other name."""
    try:
        return ADVANTAGE_ESTIMATORS[name]
    except KeyError:
        known = ", ".join(sorted(ADVANTAGE_ESTIMATORS))
        raise ValueError(f"unknown advantage estimator {name!r} (known: {known})") from None
