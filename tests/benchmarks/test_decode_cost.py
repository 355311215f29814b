"""benchmarks.decode_cost on a tiny model: the engine's measured steps fitted to the simulation's cost
model, and the simulation run on the measured curve (`benchmarks.c3po --simulate --cost-model`)."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _run(module: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)


def test_the_measured_cost_feeds_the_simulation(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "cost.json"
    measured = _run("benchmarks.decode_cost", "--model", str(tiny_model_dir), "--batches", "1,4", "--contexts",
                    "4,12", "--steps", "4", "--repeats", "2", "--threads", "1", "--out", str(out))
    assert measured.returncode == 0, measured.stderr[-3000:]
    result = json.loads(measured.stdout.strip().splitlines()[-1])
    assert result == json.loads(out.read_text())
    cost = result["cost_model"]
    assert sorted(result["measured"]) == ["base_seconds", "decode_seconds_by_batch", "per_kv_token_seconds",
                                          "per_sequence_seconds", "prefill_per_token_seconds"]
    assert result["not_measured"] == ["train_per_token_seconds", "weight_push_seconds"], "named, not hidden"
    assert [b for b, _ in cost["decode_seconds_by_batch"]] == [1, 4]
    assert all(s > 0 for _, s in cost["decode_seconds_by_batch"])
    assert set(result["decode_step_seconds_median"]) == {"B1_C4", "B1_C12", "B4_C4", "B4_C12"}
    assert result["fit_median_relative_error"] >= 0 and result["curve_median_relative_error"] >= 0

    simulate = ("benchmarks.c3po", "--simulate", "--cost-model", str(out), "--group-size", "4",
                "--prompts-per-iteration", "4", "--trained-samples", "64", "--median-tokens", "40",
                "--max-tokens", "200", "--prompt-tokens", "10")
    simulated = _run(*simulate)
    assert simulated.returncode == 0, simulated.stderr[-3000:]
    summary = json.loads(simulated.stdout.strip().splitlines()[-1])
    assert summary["rollout_speedup"] > 0 and summary["e2e_speedup"] > 0

    refused = _run("benchmarks.c3po", "--simulate", "--cost-model", str(out), "--step-base-seconds", "0.5")
    assert refused.returncode != 0 and "leave out the flags for ['base_seconds']" in refused.stderr

    # the train constant is not measured by decode_cost: a flag sets it, and it changes the end-to-end figures
    slow_train = _run(*simulate, "--train-per-token-seconds", "0.02")
    assert slow_train.returncode == 0, slow_train.stderr[-3000:]
    slow = json.loads(slow_train.stdout.strip().splitlines()[-1])
    assert slow["rollout_speedup"] == summary["rollout_speedup"], "the decode cost is the file's either way"
    assert slow["e2e_speedup"] != summary["e2e_speedup"]


def test_the_measured_curve_is_interpolated_and_extended(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(REPO))
    sim = importlib.import_module("benchmarks.c3po.sim")
    cost = sim.CostModel(decode_seconds_by_batch=[[1, 0.1], [5, 0.2], [9, 0.4]])  # lists, as JSON gives them
    assert cost.decode_seconds(1) == pytest.approx(0.1) and cost.decode_seconds(3) == pytest.approx(0.15)
    assert cost.decode_seconds(7) == pytest.approx(0.3) and cost.decode_seconds(13) == pytest.approx(0.6)
    assert sim.CostModel(base_seconds=0.01, per_sequence_seconds=0.001).decode_seconds(10) == pytest.approx(0.02)
    with pytest.raises(ValueError, match="increasing batch"):
        sim.CostModel(decode_seconds_by_batch=((4, 0.1), (2, 0.2)))
