"""benchmarks.icepop_mismatch at a tiny size: bf16 engine and fp32 trainer in one process, three runs."""

from __future__ import annotations

import importlib
import json
import math
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def quick_demo_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch

    from everstep_trainer.demo.build import build_demo, quick_build_config

    torch.set_num_threads(1)  # tiny matrices: extra threads only spin on this shared machine
    config = quick_build_config(seed=0)
    config.evaluate = False
    out = tmp_path_factory.mktemp("quick-demo")
    build_demo(out, config)
    return out


def test_three_runs_report_finite_plausible_mismatch(quick_demo_model: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.syspath_prepend(str(REPO))
    benchmark = importlib.import_module("benchmarks.icepop_mismatch")
    out = tmp_path / "out"
    benchmark.main(["--model", str(quick_demo_model), "--steps", "3", "--prompts-per-step", "2", "--group-size", "3",
                    "--max-new-tokens", "12", "--out", str(out), "--num-threads", "1"])

    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert list(summary) == ["none", "tis", "icepop"]
    for correction, result in summary.items():
        for key in ("final_reward", "masked_fraction_mean", "mismatch_kl_first", "mismatch_kl_last"):
            assert math.isfinite(result[key]), (correction, key)
        assert 0.0 <= result["final_reward"] <= 1.0 and 0.0 <= result["masked_fraction_mean"] <= 1.0
        # bfloat16 sampling against a float32 trainer: a real, small disagreement.
        assert 0.0 < result["mismatch_kl_first"] < 0.1 and 0.0 < result["logp_diff_max_max"] < 5.0
    # Same weights, prompts and sampling seed: the first step is the same in every run.
    assert summary["none"]["mismatch_kl_first"] == summary["icepop"]["mismatch_kl_first"]

    report = json.loads((out / "icepop_mismatch.json").read_text())
    assert report["summary"] == summary and report["settings"]["steps"] == 3
    for correction in summary:
        steps = report["steps"][correction]
        assert [s["step"] for s in steps] == [1, 2, 3]
        assert all(s["num_tokens"] > 0 and math.isfinite(s["loss"]) for s in steps)
    assert (out / "icepop_mismatch.png").read_bytes()[:4] == b"\x89PNG"
