"""benchmarks.rollout_scaling: the fleet simulation's placement and budget accounting, the real-engine section's
summary, and the quick run's summary (both sections)."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def fleet(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(REPO))
    return importlib.import_module("benchmarks.rollout_scaling.fleet_simulation")


def _simulator(fleet: ModuleType, policy: str, placement: str = "residual", **config: object):
    fields = {"num_engines": 4, "slots_per_engine": 8, "group_size": 4,
              "lengths": fleet.LengthModel(median_tokens=50, sigma=1.0, max_new_tokens=400), **config}
    return fleet.FleetSimulator(fleet.FleetConfig(**fields), fleet.Policy(policy), fleet.Placement(placement))


@pytest.mark.parametrize("placement", ["oracle", "residual"])
def test_a_new_group_goes_to_the_least_loaded_engine_with_room(fleet: ModuleType, placement: str) -> None:
    sim = _simulator(fleet, "c3po_global", placement, num_engines=3, slots_per_engine=6, group_size=2)
    lengths = {0: (5, 5), 1: (5, 5), 2: (300, 300), 3: (100, 100), 4: (10, 10), 5: (1, 1)}
    sim.prompt_lengths = lengths.__getitem__
    sim.start_group(sim.engines[0], 0)
    sim.start_group(sim.engines[0], 1)
    sim.start_group(sim.engines[1], 2)
    sim.start_group(sim.engines[2], 3)
    sim.start_group(sim.engines[2], 4)
    # engine 0: 4 short sequences; engine 1: 2 long ones; engine 2: 4 sequences, 220 tokens in all
    chosen = sim.choose_engine()
    if placement == "oracle":  # true remaining tokens: 20, 600, 220
        assert chosen is sim.engines[0]
    else:  # nothing decoded yet: the expected remaining length is the mean for each, so the fewest sequences win
        assert chosen is sim.engines[1]
    sim.start_group(sim.engines[0], 5)  # engine 0 is full now: never chosen, however light
    assert sim.engines[0].free_slots == 0
    assert sim.choose_engine() is sim.engines[2 if placement == "oracle" else 1]


def test_the_first_groups_spread_over_an_empty_fleet(fleet: ModuleType) -> None:
    sim = _simulator(fleet, "c3po_global", "residual")
    engines = []
    for prompt in range(4):
        engine = sim.choose_engine()
        engines.append(engine.index)
        sim.start_group(engine, prompt)
    assert engines == [0, 1, 2, 3]


@pytest.mark.parametrize("policy", ["c3po_global", "static_split", "static_split_keep_decoding", "sync_batch"])
def test_a_groups_samples_share_one_engine_and_stay_there(fleet: ModuleType, policy: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    sim = _simulator(fleet, policy)
    added: dict[int, set[int]] = defaultdict(set)  # group -> engines its samples were added to
    original_add = fleet.Engine.add

    def add(engine, sequence_id, group_id, *rest):
        added[group_id].add(engine.index)
        return original_add(engine, sequence_id, group_id, *rest)

    monkeypatch.setattr(fleet.Engine, "add", add)
    for _ in range(4):
        sim.run_iteration()
        for engine in sim.engines:  # carried-over samples are still on their group's engine
            assert all(sim.group_engine[s.group_id] == engine.index for s in engine.running.values())
    assert added and all(len(engines) == 1 for engines in added.values())
    if policy != "c3po_global":  # engine e serves prompts e, e + E, ...
        assert all(engines == {group % 4} for group, engines in added.items())


def test_the_iteration_ends_when_the_fleet_wide_sample_budget_is_met(fleet: ModuleType,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    sim = _simulator(fleet, "c3po_global")
    finish_times: list[float] = []
    original_pop = fleet.Engine.pop_next
    monkeypatch.setattr(fleet.Engine, "pop_next", lambda engine: (finish_times.append(sim.time),
                                                                  original_pop(engine))[1])
    for _ in range(3):
        start, finish_times[:] = sim.time, []
        stats = sim.run_iteration()
        assert stats.finished_samples == len(finish_times) == sim.budget == 32  # Omega = 4 engines x 8 slots
        assert sim.time == finish_times[-1], "ends at the finish that meets the budget"
        assert stats.ticks == pytest.approx(finish_times[-1] - start)
        assert any(engine.running for engine in sim.engines), "the long tail carries over instead of stalling"


def test_the_token_budget_ends_at_the_first_finish_that_meets_phi(fleet: ModuleType,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    sim = _simulator(fleet, "c3po_global", budget_unit="tokens")
    lengths: list[int] = []
    original_pop = fleet.Engine.pop_next

    def pop(engine):
        sequence = original_pop(engine)
        lengths.append(sequence.length)
        return sequence

    monkeypatch.setattr(fleet.Engine, "pop_next", pop)
    for _ in range(3):
        lengths[:] = []
        stats = sim.run_iteration()
        assert stats.finished_tokens == sum(lengths)
        assert sum(lengths) >= sim.budget > sum(lengths[:-1])


@pytest.mark.parametrize("policy", ["static_split", "static_split_keep_decoding"])
def test_a_static_split_ends_when_the_last_engine_meets_its_own_budget(fleet: ModuleType, policy: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    sim = _simulator(fleet, policy)
    met_at: dict[int, float] = {}
    original_count = fleet.FleetSimulator._count_finished

    def count(simulator, engine, sequence):
        original_count(simulator, engine, sequence)
        if engine.budget_met and engine.index not in met_at:
            met_at[engine.index] = simulator.time

    monkeypatch.setattr(fleet.FleetSimulator, "_count_finished", count)
    banked = 0
    for _ in range(4):
        met_at.clear()
        stats = sim.run_iteration()
        assert stats.finished_samples == 32, "every iteration trains the same samples"
        assert [engine.finished_this_iteration for engine in sim.engines] == [8.0] * 4
        assert sim.time == max(met_at.values()), "the iteration ends when the last engine meets its budget"
        assert min(met_at.values()) < sim.time
        banked += sum(len(engine.banked) for engine in sim.engines)
    assert (banked > 0) == (policy == "static_split_keep_decoding"), "only the kinder split decodes past its budget"


def test_the_synchronous_batch_trains_the_whole_pool_and_carries_nothing(fleet: ModuleType) -> None:
    sim = _simulator(fleet, "sync_batch")
    stats = sim.run_iteration()
    assert stats.finished_samples == 32 and stats.purged_samples == 0
    assert not any(engine.running for engine in sim.engines)
    assert stats.tokens_generated == pytest.approx(stats.finished_tokens), "every decoded token is accounted for"


def test_every_policy_sees_the_same_lengths_and_a_seed_repeats_a_run(fleet: ModuleType) -> None:
    runs = [_simulator(fleet, "c3po_global"), _simulator(fleet, "static_split"), _simulator(fleet, "c3po_global")]
    assert [sim.prompt_lengths(7) for sim in runs[:2]] == [runs[0].prompt_lengths(7)] * 2
    assert [runs[0].run_iteration() for _ in range(3)] == [runs[2].run_iteration() for _ in range(3)]


def test_carry_over_purges_after_retention(fleet: ModuleType) -> None:
    sim = _simulator(fleet, "c3po_global", retention=0, lengths=fleet.LengthModel(median_tokens=50, sigma=2.0,
                                                                                  max_new_tokens=5000))
    stats = sim.run_iteration()
    assert stats.purged_samples > 0 and stats.purged_tokens > 0
    assert not any(engine.running for engine in sim.engines), "sigma = 0: nothing is carried over"


@pytest.fixture
def real_engines(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(REPO))
    return importlib.import_module("benchmarks.rollout_scaling.real_engines")


def _pool_run(real_engines: ModuleType, num_engines: int, repeat: int, seconds: float) -> object:
    addresses = [f"127.0.0.1:{5000 + i}" for i in range(num_engines)]
    tokens = dict(zip(addresses, [600, 400][:num_engines] if num_engines == 2 else [1000], strict=True))
    return real_engines.PoolRun(num_engines=num_engines, repeat=repeat, num_tokens=1000, num_sequences=16,
                                seconds=seconds, engine_cpu_seconds=seconds * num_engines / 2,
                                client_cpu_seconds=0.1, tokens_by_engine=tokens,
                                sequences_by_engine=dict.fromkeys(addresses, 16 // num_engines))


def test_speedup_2_is_the_ratio_of_median_tokens_per_second(real_engines: ModuleType) -> None:
    workload = real_engines.EngineWorkload(num_prompts=2, repeats=3)
    runs = [_pool_run(real_engines, 1, 0, 2.0), _pool_run(real_engines, 2, 0, 1.0),
            _pool_run(real_engines, 2, 1, 1.25), _pool_run(real_engines, 1, 1, 4.0),
            _pool_run(real_engines, 1, 2, 2.5), _pool_run(real_engines, 2, 2, 10.0)]
    summary = real_engines.summarize(runs, workload, num_engines=2, load_before=(1.0, 1.0, 1.0),
                                     load_after=(2.0, 1.0, 1.0), seconds=30.0)
    figures = summary["real_engines"]["by_engines"]
    assert figures["1"]["tokens_per_s"] == 400.0 and figures["2"]["tokens_per_s"] == 800.0  # medians, not means
    assert summary["speedup_2"] == 2.0
    # per engine CPU second: one engine 1000 / (2.5 / 2) = 800, two engines 1000 / 1.25 = 800
    assert figures["1"]["tokens_per_engine_cpu_s"] == figures["2"]["tokens_per_engine_cpu_s"] == 800.0
    assert summary["speedup_2_cpu_normalized"] == 2.0
    assert figures["2"]["token_share_by_engine"] == [0.6, 0.4] and figures["1"]["token_share_by_engine"] == [1.0]
    assert figures["2"]["sequence_share_by_engine"] == [0.5, 0.5]
    assert figures["2"]["engine_core_share"] == 0.5 and figures["1"]["engine_core_share"] == 0.5
    assert len(summary["real_engines"]["runs"]) == 6 and summary["real_engines"]["loadavg_after"][0] == 2.0
    assert json.loads(json.dumps(summary)) == summary


@pytest.mark.parametrize("flags", [["--sections", "fleet,carrier-pigeon"], ["--real-repeats", "0"],
                                   ["--group-size", "80"]])
def test_bad_flags_are_refused_before_anything_starts(flags: list[str]) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    process = subprocess.run([sys.executable, "-m", "benchmarks.rollout_scaling", *flags], cwd=REPO, env=env,
                             capture_output=True, text=True, timeout=120)
    assert process.returncode == 2 and "error" in process.stderr


def _check_real_engines(summary: dict) -> None:
    """The quick run's real-engine section: both pool sizes ran the same work, and both engines of the pool got
    work in every run."""
    section = summary["real_engines"]
    settings = section["settings"]
    assert settings["num_prompts"] == 8 and settings["max_new_tokens"] == 64 and settings["repeats"] == 2
    assert settings["threads_per_engine"] == 1 and settings["num_engines"] == 2
    assert summary["speedup_2"] == round(section["by_engines"]["2"]["tokens_per_s"]
                                         / section["by_engines"]["1"]["tokens_per_s"], 3)
    runs = section["runs"]
    assert sorted(r["num_engines"] for r in runs) == [1, 1, 2, 2]
    assert [r["num_engines"] for r in runs] == [1, 2, 2, 1], "the runs alternate"
    for run in runs:
        assert run["num_sequences"] == 8 * 8 and run["seconds"] > 0 and run["num_tokens"] > 0
        assert len(run["tokens_by_engine"]) == run["num_engines"]
        assert sum(run["sequences_by_engine"].values()) == 64
        assert all(count > 0 for count in run["sequences_by_engine"].values()), "every engine got work"
        assert all(tokens > 0 for tokens in run["tokens_by_engine"].values())
        assert sum(run["tokens_by_engine"].values()) == run["num_tokens"]
    one_engine = next(r for r in runs if r["num_engines"] == 1)
    two_engines = [r for r in runs if r["num_engines"] == 2]
    assert set(one_engine["tokens_by_engine"]) < set(two_engines[0]["tokens_by_engine"]), "the first of the pair"
    # seeded per sequence: the same work whichever engine serves it (batching noise may flip a rare sample)
    assert all(abs(r["num_tokens"] - one_engine["num_tokens"]) <= 0.05 * one_engine["num_tokens"] for r in runs)
    assert section["by_engines"]["2"]["sequence_share_by_engine"] == [0.5, 0.5]  # groups of 8, alternated


@pytest.mark.slow
def test_quick_run_prints_the_summary_last(tmp_path: Path) -> None:
    out = tmp_path / "summary.json"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    process = subprocess.run([sys.executable, "-m", "benchmarks.rollout_scaling", "--quick", "--json-out", str(out)],
                             cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert process.returncode == 0, process.stderr[-4000:]
    summary = json.loads(process.stdout.strip().splitlines()[-1])
    assert summary == json.loads(out.read_text())
    assert summary["fleet_speedup"] > 0
    assert set(summary["fleet_speedup_by_engines"]) == {"64", "256"}
    rows = summary["fleet"]
    assert {(r["engines"], r["policy"]) for r in rows} == {(e, p) for e in (64, 256)
                                                           for p in ("c3po_global", "static_split",
                                                                     "static_split_keep_decoding", "sync_batch")}
    for row in rows:
        assert row["median_ticks"] > 0 and row["tokens_per_tick"] > 0 and 0 < row["utilization"] <= 1
    for engines in (64, 256):  # the same trained samples per iteration under every policy
        assert {r["trained_samples_per_iteration"] for r in rows if r["engines"] == engines} == {engines * 64.0}
    static = next(r for r in rows if (r["engines"], r["policy"]) == (256, "static_split"))
    c3po = next(r for r in rows if (r["engines"], r["policy"]) == (256, "c3po_global"))
    assert summary["fleet_speedup"] == round(static["median_ticks"] / c3po["median_ticks"], 3) or \
        summary["fleet_speedup"] == pytest.approx(static["median_ticks"] / c3po["median_ticks"], rel=1e-3)
    _check_real_engines(summary)
