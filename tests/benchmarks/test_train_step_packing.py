"""benchmarks.train_step_packing, tiny: the three arms train the same batch to the same loss; packing computes
less padding, shared prompts fewer of the batch's tokens."""

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
    # 4 prompts x 4 samples: each prompt is computed once per micro-batch, not 4 times.
    assert result["arms"]["shared"]["shared_prompt_fraction"] > 0.2
    assert result["arms"]["packed"]["shared_prompt_fraction"] == 0.0 and result["speedup_shared"] > 0
