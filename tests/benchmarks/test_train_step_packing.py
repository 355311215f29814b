"""benchmarks.train_step_packing, tiny: both arms train the same batch to the same loss; packing computes
less padding."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_the_packing_benchmark_compares_the_arms_on_one_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(REPO))
    benchmark = importlib.import_module("benchmarks.train_step_packing")
    result = benchmark.main(["--model", str(REPO / "examples" / "demo-model"), "--num-prompts", "4", "--group-size",
                             "4", "--max-new-tokens", "40", "--repeats", "2", "--num-threads", "1"])
    assert result["num_samples"] == 16
    assert result["max_loss_diff"] < 1e-5 and result["max_grad_norm_diff"] < 1e-4
    assert result["arms"]["packed"]["padding_fraction"] < result["arms"]["padded"]["padding_fraction"]
    assert len(result["arms"]["padded"]["step_seconds_all"]) == 2 and result["speedup"] > 0
