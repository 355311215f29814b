"""The advantage estimators and their registry (everstep_controller/algo/advantages), each against a reference
written from its paper with numpy."""

from __future__ import annotations

import numpy as np
import pytest

from everstep.settings.training import AdvantageEstimator, AlgorithmSettings
from everstep_controller.algo.advantages import ADVANTAGE_ESTIMATORS, get_advantage_estimator
from everstep_controller.algo.advantages.grpo import grpo_advantages

GROUPS = [[1.0, 0.0, 0.0, 1.0, 1.0], [0.2, 0.9, 0.4], [3.0, -1.0]]


def _reference(name: str, groups: list[list[float]], normalize_std: bool = True) -> list[list[float]]:
    arrays = [np.asarray(g, dtype=np.float64) for g in groups]
    if name == "grpo":  # DeepSeekMath eq. (group-normalised outcome reward)
        return [((r - r.mean()) / (r.std() + 1e-6) if normalize_std else r - r.mean()).tolist() for r in arrays]
    if name == "dr_grpo":  # Dr. GRPO: no std division
        return [(r - r.mean()).tolist() for r in arrays]
    if name == "rloo":  # R_i - 1/(n-1) sum_{j != i} R_j
        return [[r[i] - np.delete(r, i).mean() for i in range(len(r))] for r in arrays]
    if name in ("reinforce_plus_plus", "reinforce_plus_plus_baseline"):
        centered = [r - r.mean() if name.endswith("baseline") else r for r in arrays]
        flat = np.concatenate(centered)
        return [((c - flat.mean()) / (flat.std() + 1e-6)).tolist() for c in centered]
    raise AssertionError(name)


@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS))
def test_each_estimator_matches_its_paper(name: str) -> None:
    estimate = get_advantage_estimator(name)
    got = estimate(GROUPS, normalize_std=True)
    want = _reference(name, GROUPS)
    assert [len(g) for g in got] == [len(g) for g in GROUPS]
    for got_group, want_group in zip(got, want, strict=True):
        assert got_group == pytest.approx(want_group, abs=1e-9)


def test_grpo_advantages() -> None:
    assert grpo_advantages([[1.0, 0.0]], normalize_std=True)[0] == pytest.approx([1.0, -1.0], abs=1e-5)
    assert grpo_advantages([[1.0, 0.0, 0.0, 1.0]], normalize_std=False) == [[0.5, -0.5, -0.5, 0.5]]
    assert grpo_advantages([[1.0, 1.0], []], normalize_std=True) == [[0.0, 0.0], []]
    assert grpo_advantages(GROUPS, normalize_std=False) == _reference("grpo", GROUPS, normalize_std=False)


def test_reinforce_plus_plus_normalizes_over_the_batch_not_the_group() -> None:
    # two groups, each constant: GRPO gives zeros, REINFORCE++ still separates them; the baseline variant does not
    groups = [[1.0, 1.0], [0.0, 0.0]]
    first, second = get_advantage_estimator("reinforce_plus_plus")(groups, normalize_std=False)
    assert first + second == pytest.approx([1.0, 1.0, -1.0, -1.0], abs=1e-5)
    assert get_advantage_estimator("reinforce_plus_plus_baseline")(groups, normalize_std=False) == [[0.0, 0.0]] * 2
    assert get_advantage_estimator("rloo")([[2.0]], normalize_std=False) == [[0.0]]


def test_the_registry_is_the_settings_enum_and_refuses_an_unknown_name_listing_the_known_ones() -> None:
    assert get_advantage_estimator("grpo") is grpo_advantages
    assert sorted(ADVANTAGE_ESTIMATORS) == sorted(e.value for e in AdvantageEstimator)
    known = "dr_grpo, grpo, reinforce_plus_plus, reinforce_plus_plus_baseline, rloo"
    with pytest.raises(ValueError, match=rf"unknown advantage estimator 'gae' \(known: {known}\)"):
        get_advantage_estimator("gae")


def test_normalize_std_set_with_another_estimator_is_refused_naming_it() -> None:
    assert AlgorithmSettings().normalize_group_std and AlgorithmSettings(advantage="rloo").normalize_std is None
    assert not AlgorithmSettings(advantage="grpo", normalize_std=False).normalize_group_std
    with pytest.raises(ValueError, match="normalize_std: applies to advantage grpo only; dr_grpo"):
        AlgorithmSettings(advantage="dr_grpo", normalize_std=False)
