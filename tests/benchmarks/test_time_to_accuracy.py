"""benchmarks.time_to_accuracy: the clock and summary logic, and the everstep arms at tiny size on real services."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]
TINY = ("--steps", "2", "--eval-every", "1", "--eval-prompts", "8", "--prompts-per-step", "4", "--token-budget", "256",
        "--pool-capacity", "32", "--max-new-tokens", "32")


@pytest.fixture
def tta(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(REPO))
    return importlib.import_module("benchmarks.time_to_accuracy")


def _run(out: Path, *args: str, timeout: float) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    process = subprocess.run([sys.executable, "-m", "benchmarks.time_to_accuracy", "--out", str(out), *args], cwd=REPO,
                             env=env, capture_output=True, text=True, timeout=timeout)
    assert process.returncode == 0, process.stderr[-4000:]
    return json.loads(process.stdout.strip().splitlines()[-1])


def test_everstep_clock_leaves_evaluations_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(REPO))
    everstep = importlib.import_module("benchmarks.tta_everstep")
    # eval 0 seen at 10; steps 1, 2 committed at 14, 18; eval 2 takes 3 s (seen at 21); step 3 at 25, eval 3 at 27
    step_seen = {1: 14.0, 2: 18.0, 3: 25.0}
    eval_seen = {0: 10.0, 2: 21.0, 3: 27.0}
    assert everstep._train_seconds(2, step_seen, eval_seen) == pytest.approx(8.0)
    assert everstep._train_seconds(3, step_seen, eval_seen) == pytest.approx(25.0 - 10.0 - 3.0)
    evaluations = {s: everstep.Evaluation(step=s, accuracy=0.1 * s, greedy_accuracy=None, k=4, num_prompts=8,
                                          num_unscored=0) for s in eval_seen}
    curve, eval_seconds = everstep._curve(evaluations, step_seen, eval_seen)
    assert [(p.step, p.seconds) for p in curve] == [(0, 0.0), (2, 8.0), (3, 12.0)]
    assert eval_seconds == pytest.approx(5.0), "step 0's evaluation starts the clock and is not counted"


def test_summary_gives_seconds_to_target_and_speedup_against_trl(tta: ModuleType) -> None:
    config_module = importlib.import_module("benchmarks.tta_config")
    Arm, ArmRun, CurvePoint = config_module.Arm, config_module.ArmRun, config_module.CurvePoint

    def run(arm, points):
        curve = [CurvePoint(seconds=s, step=i, accuracy=a, greedy_accuracy=a) for i, (s, a) in enumerate(points)]
        return ArmRun(arm=arm, curve=curve, train_seconds=points[-1][0], total_seconds=points[-1][0] + 5,
                      eval_seconds=1.0)

    config = config_module.TtaConfig(model="m", train_path="t", eval_path="e", arms=(Arm.trl, Arm.c3po))
    runs = [run(Arm.trl, [(0, 0.1), (50, 0.3), (100, 0.4)]), run(Arm.c3po, [(0, 0.1), (10, 0.45), (30, 0.5)]),
            run(Arm.trl, [(0, 0.1), (60, 0.2), (120, 0.4)]), run(Arm.c3po, [(0, 0.1), (20, 0.3), (40, 0.41)])]
    summary = tta.summarize(config, runs, None)
    assert summary["target_accuracy"] == 0.4 and summary["target_source"] == "trl's final avg@4"
    trl, c3po = summary["arms"]["trl"], summary["arms"]["c3po"]
    assert trl["seconds_to_target"] == 110 and trl["speedup_vs_trl"] == 1.0  # median of 100 and 120
    assert c3po["seconds_to_target"] == 25 and c3po["reached_target"] == 2  # median of 10 and 40
    assert c3po["speedup_vs_trl"] == round(110 / 25, 3)
    assert c3po["final_accuracy"] == pytest.approx(0.455)
    assert c3po["seconds_per_step"] == pytest.approx(17.5)  # median of 30 s and 40 s over 2 steps
    unreachable = tta.summarize(config, runs, 0.9)["arms"]["c3po"]
    assert unreachable["seconds_to_target"] is None and unreachable["speedup_vs_trl"] is None
    # Every new best of TRL's first run: 0.3 at step 1, 0.4 at step 2; seconds are medians over the runs.
    first, second = summary["milestones"]
    assert (first["accuracy"], first["reference_step"], second["accuracy"]) == (0.3, 1, 0.4)
    assert first["seconds"] == {"trl": 85, "c3po": 15}  # trl: 50 and 120; c3po: 10 and 20
    assert first["speedup_vs_trl"] == {"trl": 1.0, "c3po": round(85 / 15, 3)}
    assert second["seconds"]["c3po"] == 25


def test_a_saved_result_is_summarized_again(tta: ModuleType, tmp_path: Path) -> None:
    config_module = importlib.import_module("benchmarks.tta_config")
    Arm, ArmRun, CurvePoint = config_module.Arm, config_module.ArmRun, config_module.CurvePoint
    config = config_module.TtaConfig(model="m", train_path="t", eval_path="e", arms=(Arm.trl, Arm.sync))
    runs = [ArmRun(arm=arm, curve=[CurvePoint(seconds=0, step=0, accuracy=0.1, greedy_accuracy=0.1),
                                   CurvePoint(seconds=s, step=1, accuracy=0.5, greedy_accuracy=0.4)],
                   train_seconds=s, total_seconds=s + 1, eval_seconds=0.5) for arm, s in ((Arm.trl, 40), (Arm.sync, 8))]
    saved = tmp_path / "result.json"
    saved.write_text(json.dumps({"summary": {}, "runs": [r.to_json() for r in runs], "config": config.to_json()}))
    again = tta.resummarize(saved, 0.3)
    assert again["target_source"] == "--target" and again["arms"]["sync"]["speedup_vs_trl"] == 5.0


@pytest.mark.slow
def test_everstep_arms_at_tiny_size(tmp_path: Path) -> None:
    result = _run(tmp_path, "--arms", "sync,c3po,overlap", *TINY, timeout=300)
    runs = {run["arm"]: run for run in result["runs"]}
    assert set(runs) == {"sync", "c3po", "overlap"}
    for run in runs.values():
        assert [p["step"] for p in run["curve"]] == [0, 1, 2], "evaluations before training and after every step"
        seconds = [p["seconds"] for p in run["curve"]]
        assert seconds[0] == 0.0 and seconds == sorted(seconds) and seconds[-1] > 0
        assert all(0.0 <= p["accuracy"] <= 1.0 and 0.0 <= p["greedy_accuracy"] <= 1.0 for p in run["curve"])
        assert run["total_seconds"] > run["train_seconds"] == seconds[-1]
        assert run["details"]["trained_samples"] > 0
    assert runs["sync"]["details"]["staleness_max"] == 0
    summary = result["summary"]
    assert summary["target_source"] == "sync's final avg@4"
    assert summary["target_accuracy"] == pytest.approx(runs["sync"]["curve"][-1]["accuracy"], abs=1e-4)
    assert summary["arms"]["sync"]["seconds_to_target"] is not None
    assert (tmp_path / "time_to_accuracy.png").stat().st_size > 0
    assert json.loads((tmp_path / "result.json").read_text())["summary"] == summary


@pytest.mark.slow
def test_trl_arm_at_tiny_size(tmp_path: Path) -> None:
    pytest.importorskip("trl", reason="optional benchmark dependency: pip install -r benchmarks/requirements-trl.txt")
    result = _run(tmp_path, "--arms", "trl", *TINY[:6], "--prompts-per-step", "8", "--max-new-tokens", "32",
                  timeout=300)
    (run,) = result["runs"]
    assert run["arm"] == "trl" and [p["step"] for p in run["curve"]] == [0, 1, 2]
    assert run["details"]["trained_samples"] == 2 * 8 * 8
    # as many optimizer steps per generation round as the everstep arms (the demo job's num_minibatches: 2);
    # TRL counts its steps_per_generation in per-device batches (64 samples / 32 per optimizer step here)
    assert run["details"]["optimizer_steps_per_generation"] == 2 and run["details"]["trl_steps_per_generation"] == 2
    assert result["summary"]["arms"]["trl"]["speedup_vs_trl"] == 1.0


def test_everstep_arms_take_the_optimizer_steps_per_step(tmp_path: Path,
                                                                              tta: ModuleType) -> None:
    config_module = importlib.import_module("benchmarks.tta_config")
    args = tta.parse_args(["--num-minibatches", "2", "--arms", "trl,c3po"])
    config = tta.config_from_args(args)
    assert config.num_minibatches == 2
    for arm in (config_module.Arm.sync, config_module.Arm.c3po, config_module.Arm.overlap):
        spec = config_module.job_spec(config, arm, tmp_path)
        assert spec["trainer"]["num_minibatches"] == 2 and spec["trainer"]["learning_rate"] == config.learning_rate
    ones = tta.config_from_args(tta.parse_args(["--num-minibatches", "1"]))
    assert config_module.job_spec(ones, config_module.Arm.c3po, tmp_path)["trainer"]["num_minibatches"] == 1
    # by default the everstep arms run the demo job's own setting
    default = tta.config_from_args(tta.parse_args([]))
    demo = config_module.load_job_file(config_module.DEMO_SPEC)
    assert default.num_minibatches is None
    assert (config_module.job_spec(default, config_module.Arm.overlap, tmp_path)["trainer"].get("num_minibatches")
            == demo["trainer"].get("num_minibatches"))
    # a result saved before the setting existed is still read
    saved = config.to_json()
    del saved["num_minibatches"]
    assert config_module.TtaConfig(**{**saved, "arms": tuple(config_module.Arm(a) for a in saved["arms"])}
                                   ).num_minibatches is None
