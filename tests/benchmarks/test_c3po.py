"""benchmarks.c3po at tiny sizes: the simulation and the real run each print their JSON summary last."""

from __future__ import annotations

import importlib
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]


def _run(*args: str, timeout: float) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    process = subprocess.run([sys.executable, "-m", "benchmarks.c3po", *args], cwd=REPO, env=env,
                             capture_output=True, text=True, timeout=timeout)
    assert process.returncode == 0, process.stderr[-4000:]
    return json.loads(process.stdout.strip().splitlines()[-1])


@pytest.fixture
def sim(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(REPO))
    return importlib.import_module("benchmarks.c3po.sim")


def test_simulated_engine_cost_matches_stepping_one_token_at_a_time(sim: ModuleType) -> None:
    cost = sim.CostModel(base_seconds=0.01, per_sequence_seconds=0.001, per_kv_token_seconds=1e-5,
                         prefill_per_token_seconds=0.0)
    engine = sim.SimulatedEngine(cost)
    rng = random.Random(0)
    todo = {f"s{i}": (rng.randint(1, 20), rng.randint(0, 30)) for i in range(12)}  # prompt, response tokens
    for sample_id, (prompt, length) in todo.items():
        engine.add(sample_id, prompt, 0, length + 1)
    finished_at: dict[str, int] = {}
    while engine.active:
        for sample_id in engine.advance():
            finished_at[sample_id] = engine.step
    # the same, one decode step at a time
    seconds, step, active = 0.0, 0, dict(todo)
    while active:
        context = sum(prompt + step for prompt, _ in active.values())
        seconds += cost.base_seconds + cost.per_sequence_seconds * len(active) + cost.per_kv_token_seconds * context
        step += 1
        active = {s: v for s, v in active.items() if v[1] + 1 > step}
    assert engine.seconds == pytest.approx(seconds)
    assert finished_at == {s: length + 1 for s, (_, length) in todo.items()}


def test_simulation_reports_speedups_for_the_same_trained_samples() -> None:
    result = _run("--simulate", "--prompts-per-iteration", "8", "--group-size", "4", "--trained-samples", "256",
                  "--median-tokens", "400", "--max-tokens", "8192", timeout=120)
    assert result["simulate"] is True
    sync, c3po = result["sync"], result["c3po"]
    for run in (sync, c3po):
        assert 256 <= run["trained_samples"] < 256 + 32 * 3, "each run stops within an iteration of the target"
    assert sync["purged_samples"] == 0 and sync["mean_occupancy"] < c3po["mean_occupancy"] <= 32
    # a long-tailed batch keeps the synchronous engine mostly idle: C3PO++ must win
    assert result["rollout_speedup"] > 1.5 and result["e2e_speedup"] > 1.0
    assert result["token_budget"] > 0 and result["pool_capacity"] == 32


@pytest.mark.slow
def test_real_run_at_tiny_size(tiny_model_dir: Path, tmp_path: Path) -> None:
    rows = [{"prompt": f"{a} + {b} =", "answer": str(a + b)} for a in range(1, 13) for b in range(1, 13)]
    dataset = tmp_path / "train.jsonl"
    dataset.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = _run("--model", str(tiny_model_dir), "--dataset", str(dataset), "--prompts-per-iteration", "2",
                  "--group-size", "4", "--trained-samples", "16", "--max-new-tokens", "16", "--workers", "shared",
                  "--threads-per-worker", "1", "--keep-zero-signal-groups", "--overlap", "1", timeout=600)
    assert result["simulate"] is False and result["reached_trained_samples"] is True
    for key in ("rollout_speedup", "e2e_speedup"):
        assert isinstance(result[key], float) and result[key] > 0
    for run in (result["sync"], result["c3po"]):
        assert run["trained_samples"] >= 16 and run["rollout_seconds"] > 0
        assert run["e2e_seconds"] >= run["rollout_seconds"]
    assert 0.0 <= result["reward_sync"] <= 1.0 and 0.0 <= result["reward_c3po"] <= 1.0
    expected_ratio = round(result["reward_c3po"] / result["reward_sync"], 3) if result["reward_sync"] else None
    assert result["reward_ratio"] == expected_ratio
    assert result["sync"]["max_staleness"] == 0, "the baseline never trains stale tokens"
    overlapped = result["c3po_overlap"]
    assert overlapped["steps"] == result["c3po"]["steps"], "as many steps as the c3po run"
    assert overlapped["max_staleness"] <= 1 + 2, "bounded by overlap + retention"
    assert result["wall_speedup_overlap"] > 0 and result["wall_speedup_c3po"] > 0


def test_real_run_spec_carries_the_dataset_reward_and_trainer_flags(monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path: Path) -> None:
    monkeypatch.syspath_prepend(str(REPO))
    c3po, real = importlib.import_module("benchmarks.c3po.cli"), importlib.import_module("benchmarks.c3po.real")
    assert c3po._verifiers("math:1, format:0.5") == (("math", 1.0), ("format", 0.5))
    assert c3po._verifiers("math") == (("math", 1.0),)
    for bad in ("math:x", " , "):
        with pytest.raises(SystemExit, match="--verifiers"):
            c3po._verifiers(bad)
    config = real.RealConfig(model="m", dataset="d.parquet", answer_field="reward_model.ground_truth",
                             verifiers=(("math", 1.0), ("format", 0.5)), micro_batch_tokens=4096, packing=True)
    spec = real._spec(config, "c3po", 1000, tmp_path, overlap=1, steps=3)
    assert spec.dataset.answer_field == "reward_model.ground_truth"
    assert [(v.name, v.weight) for v in spec.reward.verifiers] == [("math", 1.0), ("format", 0.5)]
    assert spec.trainer.micro_batch_tokens == 4096 and spec.trainer.packing is True
    assert spec.scheduler.overlap == 1 and spec.steps == 3
    default = real._spec(real.RealConfig(model="m", dataset="d.jsonl"), "sync", 1, tmp_path)
    assert default.dataset.answer_field == "answer" and [v.name for v in default.reward.verifiers] == ["math"]
    assert default.trainer.packing is False
