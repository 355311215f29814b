"""C3PO++ scheduler invariants, driven by a simulated engine (no I/O, no model)."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from everstep.settings.training import SchedulerMode
from everstep_controller.algo.scheduler import (
    C3POScheduler,
    IterationOutcome,
    SchedulerConfig,
)


def config(**overrides) -> SchedulerConfig:
    values = dict(mode=SchedulerMode.c3po, group_size=4, token_budget=400, retention=1, pool_capacity=32,
                  prompts_per_iteration=4)
    values.update(overrides)
    return SchedulerConfig(**values)


class SimulatedEngine:
    """Each rollout needs a fixed number of tokens (long-tailed); one token per active rollout per tick."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.target: dict[str, int] = {}
        self.done: dict[str, int] = {}
        self.versions: dict[str, list[int]] = {}

    def add(self, sample_id: str) -> None:
        self.target[sample_id] = min(300, int(self.rng.paretovariate(1.2) * 10))
        self.done[sample_id] = 0
        self.versions[sample_id] = []

    def tick(self, active: list[str], version: int) -> list[str]:
        finished = []
        for sample_id in active:
            self.done[sample_id] += 1
            self.versions[sample_id].append(version)
            if self.done[sample_id] >= self.target[sample_id]:
                finished.append(sample_id)
        return finished


@dataclass
class RunResult:
    engine: SimulatedEngine
    trained: list[str]
    prompts_started: list[int]
    outcomes: list[IterationOutcome]
    survivors: dict[str, int]  # trained group -> surviving members


def run(scheduler: C3POScheduler, iterations: int, seed: int = 0) -> RunResult:
    engine = SimulatedEngine(seed)
    trained: list[str] = []
    survivors: dict[str, int] = {}
    prompts_started: list[int] = []
    outcomes = []
    next_group = 0
    for version in range(iterations):
        running: set[str] = set(scheduler.active_samples)
        while not scheduler.iteration_done():
            for _ in range(scheduler.groups_to_start()):
                ids = [f"g{next_group}-{k}" for k in range(scheduler.config.group_size)]
                scheduler.start_group(f"g{next_group}", next_group, ids)
                prompts_started.append(next_group)
                next_group += 1
                for sample_id in ids:
                    engine.add(sample_id)
                    running.add(sample_id)
            for sample_id in engine.tick(sorted(running), version):
                running.discard(sample_id)
                scheduler.on_finished(sample_id, engine.done[sample_id])
        outcome = scheduler.end_iteration({s: engine.done[s] for s in running})
        outcomes.append(outcome)
        for group_id in outcome.trainable_groups:
            trained.extend(scheduler.surviving_samples(group_id))
            survivors[group_id] = len(scheduler.surviving_samples(group_id))
    return RunResult(engine, trained, prompts_started, outcomes, survivors)


def test_every_finished_sample_is_trained_exactly_once_and_no_prompt_is_lost() -> None:
    scheduler = C3POScheduler(config())
    r = run(scheduler, iterations=12)
    engine, trained, started, outcomes = r.engine, r.trained, r.prompts_started, r.outcomes
    assert len(trained) == len(set(trained)), "a sample was trained twice"
    purged = {s for o in outcomes for s in o.purged_samples}
    assert not purged & set(trained)
    # every started prompt is accounted for: trained, dropped, or still in flight
    closed_groups = {g for o in outcomes for g in o.trainable_groups + o.dropped_groups}
    in_flight = {scheduler.rollouts[s].group_id for s in scheduler.active_samples}
    waiting = {g for g in scheduler.groups if g not in closed_groups}
    assert {f"g{i}" for i in started} == closed_groups | in_flight | waiting
    for sample_id in trained:
        assert engine.done[sample_id] >= engine.target[sample_id]


def test_budget_bounds_finished_tokens_and_pool_is_refilled() -> None:
    scheduler = C3POScheduler(config(token_budget=500, pool_capacity=16))
    outcomes = run(scheduler, iterations=6).outcomes
    for outcome in outcomes:
        assert outcome.finished_tokens >= 500
        # overshoot is bounded by what finished in the last engine tick: at most the pool's worth of samples
        assert outcome.finished_tokens < 500 + 16 * 300


def test_carried_tokens_keep_the_version_that_made_them() -> None:
    scheduler = C3POScheduler(config(retention=3))
    r = run(scheduler, iterations=10)
    engine, trained = r.engine, r.trained
    carried_then_trained = [s for s in trained if len(set(engine.versions[s])) > 1]
    assert carried_then_trained, "the long tail should make some rollouts span iterations"
    for sample_id in carried_then_trained:
        versions = engine.versions[sample_id]
        assert versions == sorted(versions), "versions of one rollout never go back"


def test_retention_limit_purges_and_small_groups_are_dropped() -> None:
    scheduler = C3POScheduler(config(retention=0, token_budget=200))
    r = run(scheduler, iterations=8)
    outcomes = r.outcomes
    purged = sum(len(o.purged_samples) for o in outcomes)
    assert purged > 0 and scheduler.counters.purged_samples == purged
    assert not any(o.carried_samples for o in outcomes), "retention 0 allows no carry-over"
    dropped = sum(len(o.dropped_groups) for o in outcomes)
    assert scheduler.counters.dropped_groups == dropped
    assert min(r.survivors.values()) >= 2


def test_retention_sigma_allows_sigma_carry_overs() -> None:
    scheduler = C3POScheduler(config(retention=2, group_size=2, pool_capacity=2, token_budget=10_000))
    scheduler.start_group("g0", 0, ["a", "b"])
    scheduler.on_finished("a", 5)
    assert scheduler.end_iteration({"b": 10}).carried_samples == ["b"]  # first carry-over
    assert scheduler.end_iteration({"b": 20}).carried_samples == ["b"]  # second
    outcome = scheduler.end_iteration({"b": 30})
    assert outcome.purged_samples == ["b"]
    assert outcome.dropped_groups == ["g0"]  # one survivor: dropped


def test_sync_baseline_waits_for_every_rollout_and_never_carries_over() -> None:
    scheduler = C3POScheduler(config(mode=SchedulerMode.sync, prompts_per_iteration=3))
    r = run(scheduler, iterations=5)
    trained, started, outcomes = r.trained, r.prompts_started, r.outcomes
    assert len(started) == 15
    for outcome in outcomes:
        assert not outcome.carried_samples and not outcome.purged_samples
        assert len(outcome.trainable_groups) == 3
    assert len(trained) == 15 * 4


def test_end_iteration_rejects_partials_that_do_not_match() -> None:
    scheduler = C3POScheduler(config(group_size=2, pool_capacity=2))
    scheduler.start_group("g0", 0, ["a", "b"])
    with pytest.raises(ValueError, match="missing"):
        scheduler.end_iteration({"a": 1})


def test_schedule_names_and_starts_the_groups_the_pool_has_room_for() -> None:
    scheduler = C3POScheduler(config(pool_capacity=10, group_size=4))
    prompts = iter([7, 3, 9])
    started = scheduler.schedule(lambda: next(prompts))
    assert [(g.group_id, g.prompt_index, g.sample_ids) for g in started] == [
        ("g0", 7, ("g0-0", "g0-1", "g0-2", "g0-3")), ("g1", 3, ("g1-0", "g1-1", "g1-2", "g1-3"))]
    assert scheduler.schedule(lambda: next(prompts)) == [], "8 of 10 slots taken: no room for a group of 4"
    assert scheduler.num_active == 8 and scheduler.prompt_index("g1") == 3
    assert [g.group_id for g in scheduler.open_groups()] == ["g0", "g1"]

    for sample_id in ("g0-0", "g0-1", "g0-2", "g0-3", "g1-0"):
        scheduler.on_finished(sample_id, 5)
    assert scheduler.finished_open_samples() == {"g0-0", "g0-1", "g0-2", "g0-3", "g1-0"}
    outcome = scheduler.end_iteration({s: 1 for s in ("g1-1", "g1-2", "g1-3")})
    assert outcome.trainable_groups == ["g0"] and outcome.carried_samples == ["g1-1", "g1-2", "g1-3"]
    assert scheduler.trainable_samples(outcome) == ["g0-0", "g0-1", "g0-2", "g0-3"]
    assert scheduler.closed_samples(outcome) == ["g0-0", "g0-1", "g0-2", "g0-3"]
    assert [g.group_id for g in scheduler.open_groups()] == ["g1"]
    assert scheduler.finished_open_samples() == {"g1-0"}, "its score waits for the rest of its group"

    restored = C3POScheduler.from_state(scheduler.config, scheduler.to_state())
    more = iter([1])
    assert [g.group_id for g in restored.schedule(lambda: next(more))] == ["g2"], "names continue after a resume"


@pytest.mark.parametrize("mode", [SchedulerMode.sync, SchedulerMode.c3po])
def test_extend_gives_the_iteration_another_round_and_the_next_starts_with_one(mode: SchedulerMode) -> None:
    scheduler = C3POScheduler(config(mode=mode, group_size=2, token_budget=4, pool_capacity=2,
                                     prompts_per_iteration=1))
    prompts = iter(range(100))
    [first] = scheduler.schedule(lambda: next(prompts))
    for sample_id in first.sample_ids:
        scheduler.on_finished(sample_id, 2)
    assert scheduler.iteration_done() and scheduler.rounds == 1
    assert [g.group_id for g in scheduler.complete_open_groups()] == ["g0"]
    scheduler.extend()
    assert scheduler.rounds == 2 and not scheduler.iteration_done(), "room for another round"
    [second] = scheduler.schedule(lambda: next(prompts))
    assert scheduler.schedule(lambda: next(prompts)) == [], "one more group, not more"
    for sample_id in second.sample_ids:
        scheduler.on_finished(sample_id, 2)
    assert scheduler.iteration_done()
    outcome = scheduler.end_iteration({})
    assert outcome.trainable_groups == ["g0", "g1"] and scheduler.rounds == 1
    assert len(scheduler.schedule(lambda: next(prompts))) == 1
