"""The advantage estimators and their registry (everstep_controller/algo/advantages)."""

from __future__ import annotations

import pytest

from everstep_controller.algo.advantages import ADVANTAGE_ESTIMATORS, get_advantage_estimator
from everstep_controller.algo.advantages.grpo import grpo_advantages


def test_grpo_advantages() -> None:
    assert grpo_advantages([1.0, 0.0], normalize_std=True) == pytest.approx([1.0, -1.0], abs=1e-5)
    assert grpo_advantages([1.0, 0.0, 0.0, 1.0], normalize_std=False) == [0.5, -0.5, -0.5, 0.5]
    assert grpo_advantages([1.0, 1.0], normalize_std=True) == [0.0, 0.0]
    assert grpo_advantages([], normalize_std=True) == []


def test_the_registry_finds_grpo_and_refuses_an_unknown_name_listing_the_known_ones() -> None:
    assert get_advantage_estimator("grpo") is grpo_advantages
    assert sorted(ADVANTAGE_ESTIMATORS) == ["grpo"]
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'rloo' \(known: grpo\)"):
        get_advantage_estimator("rloo")
