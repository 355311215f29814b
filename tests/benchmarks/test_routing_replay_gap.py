"""benchmarks.routing_replay_gap and routing_replay_step at a tiny size: the float32 control has no gap, a
mismatched engine disagrees on some routes, and replaying them narrows the trainer/engine gap; the step benchmark
times its three trainers; each summary is the last line."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_replay_narrows_the_gap_of_a_mismatched_engine(monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.syspath_prepend(str(REPO))
    benchmark = importlib.import_module("benchmarks.routing_replay_gap")
    summary = benchmark.main(["--arms", "int4", "--num-prompts", "6", "--group-size", "2", "--max-new-tokens", "24",
                              "--repeats", "1"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == summary
    control, int4 = summary["arms"]["float32"], summary["arms"]["int4"]
    assert control["off"]["routing_disagreement"] == 0.0 and control["off"]["logp_diff_abs_mean"] < 1e-5
    assert int4["off"]["routing_disagreement"] > 0.0
    assert int4["replay"]["mismatch_kl"] < int4["off"]["mismatch_kl"]
    with pytest.raises(SystemExit):
        benchmark.main(["--arms", "float32"])


def test_the_step_benchmark_times_three_trainers_on_one_batch(monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.syspath_prepend(str(REPO))
    benchmark = importlib.import_module("benchmarks.routing_replay_step")
    summary = benchmark.main(["--steps", "1", "--num-prompts", "2", "--group-size", "2", "--max-new-tokens", "8"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == summary
    assert summary["num_samples"] == 4 and set(summary["median_seconds"]) == {"off", "off_with_routes", "replay"}
    assert summary["replay_to_off"] > 0
