"""benchmarks.algorithm_sweep: the overrides and summary, and one tiny run through a real local stack (resumed)."""

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
TINY = ("--steps", "2", "--seeds", "0", "--set", "evaluation.num_prompts=8", "--set", "scheduler.token_budget=512")


@pytest.fixture
def sweep(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(REPO))
    return importlib.import_module("benchmarks.algorithm_sweep")


def test_each_arm_changes_only_its_estimator_and_loss_after_the_users_settings(sweep: ModuleType) -> None:
    arm = sweep.SweepArm.parse("rloo:gspo")
    overrides = sweep.arm_overrides(arm, seed=2, steps=30, extra=["algorithm.advantage=grpo", "trainer.lr=1"])
    assert overrides[:2] == ["algorithm.advantage=grpo", "trainer.lr=1"]
    assert overrides[2:] == ["steps=30", "evaluation.every=30", "seed=2", "algorithm.advantage=rloo",
                             "algorithm.loss.mode=gspo"]
    with pytest.raises(Exception, match="ESTIMATOR:LOSS_MODE"):
        sweep.SweepArm.parse("rloo")


def test_summary_gives_every_seed_and_the_spread(sweep: ModuleType) -> None:
    def run(arm: str, seed: int, final: float, greedy: float | None) -> object:
        return sweep.RunRecord(arm=arm, advantage=arm.split("+")[0], loss_mode=arm.split("+")[1], seed=seed, steps=30,
                               settings="{}", base_accuracy=0.2, final_accuracy=final, final_greedy_accuracy=greedy,
                               final_pass_at_k=None, final_maj_at_k=0.5, eval_prompts=200, eval_samples=4,
                               reward_first_step=0.1, reward_last_step=0.4, job_seconds=100.0 + seed, job_id=str(seed))

    summary = sweep.summarize([run("grpo+ppo", 0, 0.5, 0.6), run("grpo+ppo", 1, 0.3, None),
                               run("rloo+ppo", 0, 0.4, 0.7)])
    grpo = summary["grpo+ppo"]
    assert grpo["final_accuracy"]["per_seed"] == [0.5, 0.3]
    assert grpo["final_accuracy"]["mean"] == pytest.approx(0.4)
    assert grpo["final_accuracy"]["std"] == pytest.approx(0.1414, abs=1e-4)
    assert grpo["final_greedy"] == pytest.approx(0.6), "a run without greedy accuracy is left out of its mean"
    assert grpo["final_pass_at_k"] is None
    assert summary["rloo+ppo"]["final_accuracy"]["std"] == 0.0
    table = sweep.markdown_table(summary)
    assert "| grpo+ppo | 2 | 0.200 | 0.400 ± 0.141 | 0.500 / 0.300 | 0.600 | — | 0.500 |" in table


def _run(out: Path, *args: str) -> tuple[dict, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    process = subprocess.run([sys.executable, "-m", "benchmarks.algorithm_sweep", "--out", str(out), *args], cwd=REPO,
                             env=env, capture_output=True, text=True, timeout=600)
    assert process.returncode == 0, process.stderr[-4000:]
    return json.loads(process.stdout.strip().splitlines()[-1]), process.stderr


def test_a_tiny_sweep_runs_through_the_stack_and_resumes_without_running_again(tmp_path: Path) -> None:
    summary, _ = _run(tmp_path, "--arms", "rloo:cispo", *TINY)
    arm = summary["rloo+cispo"]
    assert arm["seeds"] == [0]
    assert 0.0 <= arm["final_accuracy"]["mean"] <= 1.0
    lines = (tmp_path / "runs.jsonl").read_text().splitlines()
    record = json.loads(lines[0])
    assert (record["advantage"], record["loss_mode"], record["steps"]) == ("rloo", "cispo", 2)
    assert record["eval_prompts"] == 8

    again, stderr = _run(tmp_path, "--arms", "rloo:cispo", *TINY)
    assert again == summary
    assert "algorithm_sweep: rloo+cispo seed 0" not in stderr, "a finished run is not run again"
    assert len((tmp_path / "runs.jsonl").read_text().splitlines()) == 1
