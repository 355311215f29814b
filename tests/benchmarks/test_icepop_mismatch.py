"""benchmarks.mismatch.icepop at a tiny size: four arms (fp32 and int8 engines, float32 trainer), one process."""

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

    from everstep_tools.demo.build import build_demo, quick_build_config

    torch.set_num_threads(1)  # tiny matrices: extra threads only spin on this shared machine
    config = quick_build_config(seed=0)
    config.evaluate = False
    out = tmp_path_factory.mktemp("quick-demo")
    build_demo(out, config)
    return out


def test_four_arms_report_a_mismatch_only_where_the_engine_is_quantized(
        quick_demo_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.syspath_prepend(str(REPO))
    benchmark = importlib.import_module("benchmarks.mismatch.icepop")
    out = tmp_path / "out"
    benchmark.main(["--model", str(quick_demo_model), "--steps", "2", "--seeds", "2", "--prompts-per-step", "2",
                    "--group-size", "3", "--max-new-tokens", "12", "--eval-prompts", "2", "--eval-every", "1",
                    "--out", str(out), "--num-threads", "1"])

    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert list(summary) == ["fp32-none", "int8-none", "int8-tis", "int8-icepop"]
    for arm, result in summary.items():
        for key in ("masked_fraction_mean", "mismatch_kl_first", "mismatch_kl_last"):
            assert math.isfinite(result[key]), (arm, key)
        assert set(result["final_accuracy"]) == {"mean", "std"} and 0.0 <= result["final_accuracy"]["mean"] <= 1.0
        assert 0.0 <= result["late_accuracy"]["mean"] <= 1.0
        assert 0.0 <= result["masked_fraction_mean"] <= 1.0 and result["num_seeds"] == 2
    # The float32 engine computes what the trainer computes; the int8 engine does not, by a bounded amount.
    assert summary["fp32-none"]["mismatch_kl_first"] < 1e-9
    for arm in ("int8-none", "int8-tis", "int8-icepop"):
        assert 1e-8 < summary[arm]["mismatch_kl_first"] < 0.1 and summary[arm]["logp_diff_max_max"] < 5.0
    # Same weights, prompts and seeds: the first step is the same in every int8 arm.
    assert summary["int8-none"]["mismatch_kl_first"] == summary["int8-icepop"]["mismatch_kl_first"]
    # Evaluated through a float32 engine from the same start: the same step-0 accuracy in every arm.
    assert len({result["initial_accuracy"] for result in summary.values()}) == 1

    report = json.loads((out / "icepop_mismatch.json").read_text())
    assert report["summary"] == summary and report["settings"]["steps"] == 2
    assert benchmark.resummarize(out / "icepop_mismatch.json") == summary  # --summarize: the same figures again
    assert sorted((r["arm"], r["seed"]) for r in report["runs"]) == sorted(
        (arm, seed) for arm in summary for seed in (0, 1))
    for run in report["runs"]:
        assert [s["step"] for s in run["steps"]] == [1, 2] and [e["step"] for e in run["evals"]] == [0, 1, 2]
        assert all(s["num_tokens"] > 0 and math.isfinite(s["loss"]) for s in run["steps"])
    assert (out / "icepop_mismatch.png").read_bytes()[:4] == b"\x89PNG"
    assert not (out / "icepop_mismatch.partial.json").exists()  # the finished report replaces it


def test_betas_add_tighter_icepop_arms(quick_demo_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       capsys) -> None:
    from everstep_trainer.step.trainer import PolicyTrainer

    monkeypatch.syspath_prepend(str(REPO))
    benchmark = importlib.import_module("benchmarks.mismatch.icepop")
    assert [(a.name, a.beta) for a in benchmark.arms("fp8", [2.0, 3.0])[-2:]] == [("fp8-icepop-b2", 2.0),
                                                                                 ("fp8-icepop-b3", 3.0)]
    betas: list[tuple[str, float]] = []
    original_init = PolicyTrainer.__init__

    def init(self, model_dir, config, *args, **kwargs):
        original_init(self, model_dir, config, *args, **kwargs)
        betas.append((str(config.correction).split(".")[-1], config.beta))

    monkeypatch.setattr(PolicyTrainer, "__init__", init)
    benchmark.main(["--model", str(quick_demo_model), "--quantization", "fp8", "--betas", "2,3", "--steps", "1",
                    "--seeds", "1", "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "8",
                    "--eval-prompts", "1", "--out", str(tmp_path / "out"), "--num-threads", "1"])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert list(summary) == ["fp32-none", "fp8-none", "fp8-tis", "fp8-icepop", "fp8-icepop-b2", "fp8-icepop-b3"]
    assert betas == [("none", 5.0), ("none", 5.0), ("tis", 5.0), ("icepop", 5.0), ("icepop", 2.0), ("icepop", 3.0)]
    # A tighter upper bound masks at least as much of the same first batch.
    assert (summary["fp8-icepop-b2"]["masked_fraction_mean"] >= summary["fp8-icepop-b3"]["masked_fraction_mean"]
            >= summary["fp8-icepop"]["masked_fraction_mean"])
    assert all(result["routing_disagreement_mean"] == 0.0 for result in summary.values())  # dense: no routes
    for bad in ("1", "2,2", "x"):
        with pytest.raises(SystemExit):
            benchmark.main(["--model", str(quick_demo_model), "--betas", bad])


def test_a_run_stopped_early_leaves_its_finished_runs_in_a_partial_report(
        quick_demo_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(REPO))
    benchmark = importlib.import_module("benchmarks.mismatch.icepop")
    finished: list[str] = []
    original_run_one = benchmark.run_one

    def run_one(arm, *args, **kwargs):
        if len(finished) == 2:
            raise KeyboardInterrupt  # the long run stopped in its third run
        finished.append(arm.name)
        return original_run_one(arm, *args, **kwargs)

    monkeypatch.setattr(benchmark, "run_one", run_one)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        benchmark.main(["--model", str(quick_demo_model), "--steps", "1", "--seeds", "1", "--prompts-per-step", "2",
                        "--group-size", "2", "--max-new-tokens", "8", "--eval-prompts", "1", "--out", str(out),
                        "--num-threads", "1"])
    assert not (out / "icepop_mismatch.json").exists()
    partial = json.loads((out / "icepop_mismatch.partial.json").read_text())
    assert [run["arm"] for run in partial["runs"]] == finished == ["fp32-none", "int8-none"]
    assert list(benchmark.resummarize(out / "icepop_mismatch.partial.json")) == finished


def test_a_run_split_by_arms_and_seeds_combines_into_the_one_run_it_replaces(
        quick_demo_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.syspath_prepend(str(REPO))
    benchmark = importlib.import_module("benchmarks.mismatch.icepop")
    tiny = ["--model", str(quick_demo_model), "--steps", "1", "--prompts-per-step", "2", "--group-size", "2",
            "--max-new-tokens", "8", "--eval-prompts", "1", "--eval-every", "1", "--num-threads", "1"]

    def run(out: Path, *flags: str) -> dict:
        summary = benchmark.main([*tiny, "--out", str(out), *flags])
        capsys.readouterr()
        return summary

    whole = run(tmp_path / "whole", "--seeds", "2", "--only-arms", "fp32-none,int8-icepop")
    run(tmp_path / "a", "--seed-list", "0", "--only-arms", "int8-icepop,fp32-none")
    run(tmp_path / "b", "--seed-list", "1", "--only-arms", "fp32-none")
    run(tmp_path / "c", "--seed-list", "1", "--only-arms", "int8-icepop")
    parts = [str(tmp_path / part / "icepop_mismatch.json") for part in "abc"]
    combined = benchmark.main(["--combine", *parts, "--out", str(tmp_path / "combined")])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == combined
    # The same runs (same seeds, same settings) whether one process made them or three.
    drop = ("seconds",)
    assert {arm: {k: v for k, v in figures.items() if k not in drop} for arm, figures in combined.items()} == \
        {arm: {k: v for k, v in figures.items() if k not in drop} for arm, figures in whole.items()}
    report = json.loads((tmp_path / "combined" / "icepop_mismatch.json").read_text())
    assert report["settings"]["seeds"] == [0, 1] and [a["name"] for a in report["arms"]] == ["fp32-none", "int8-icepop"]
    assert (tmp_path / "combined" / "icepop_mismatch.png").read_bytes()[:4] == b"\x89PNG"

    # A run in two reports, or reports whose settings differ, are refused naming the run or the setting.
    with pytest.raises(SystemExit):
        benchmark.main(["--combine", parts[0], parts[0], "--out", str(tmp_path / "twice")])
    assert "the run of arm 'fp32-none' with seed 0 is in both" in capsys.readouterr().err
    run(tmp_path / "d", "--seed-list", "2", "--only-arms", "fp32-none", "--learning-rate", "1e-3")
    with pytest.raises(SystemExit):
        benchmark.main(["--combine", parts[0], str(tmp_path / "d" / "icepop_mismatch.json"), "--out",
                        str(tmp_path / "mixed")])
    assert "setting 'learning_rate' is 0.001" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        benchmark.main([*tiny, "--only-arms", "int8-nothing"])
    assert "--only-arms: no arm int8-nothing; the arms are fp32-none, int8-none" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        benchmark.main([*tiny, "--seed-list", "1,1"])
    assert "--seed-list: distinct seeds" in capsys.readouterr().err
