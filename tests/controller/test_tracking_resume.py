"""A job's runs across runners, with the real libraries: a job that goes back to a checkpoint logs the steps it
redoes again, and a new runner (a controller restart or takeover) logs into the same runs; each run read back
with its library's own reader."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from step_rows import step_row

from everstep.rest.job_record import JobState
from everstep.rest.job_spec import JobSpec
from everstep_controller.tracking import Trackers
from everstep_controller.tracking.backends import wandb_run_id

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from wandb_offline_run import read_offline_run  # noqa: E402 (tests/e2e helper)

SPEC = {"name": "resumed", "model_path": "/models/m", "dataset": {"train_path": "/data/train.jsonl"}, "steps": 5}


def _row(step: int, reward: float):  # noqa: ANN202
    return step_row(step).model_copy(update={"reward_mean": reward})


def test_a_job_that_goes_back_and_restarts_logs_one_run_per_backend(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    wandb_dir = tmp_path / "wandb-dir"
    wandb_dir.mkdir()
    for name, value in (("WANDB_MODE", "offline"), ("WANDB_DIR", str(wandb_dir)), ("WANDB_SILENT", "true"),
                        ("MLFLOW_ALLOW_FILE_STORE", "true")):
        monkeypatch.setenv(name, value)
    tb_dir, mlruns = tmp_path / "tb", tmp_path / "mlruns"
    spec = JobSpec.model_validate({**SPEC, "tracking": {
        "tensorboard": {"log_dir": str(tb_dir)}, "wandb": {"project": "resume-test"},
        "mlflow": {"tracking_uri": mlruns.as_uri(), "experiment_name": "resume"}}})
    failures: list[tuple[str, str]] = []

    first = Trackers("job7", spec, on_failure=lambda *failure: failures.append(failure))
    first.open(resumed_after_step=None)
    for step in (1, 2, 3):
        first.log_step(_row(step, 0.1 * step))
    first.continue_after(1)  # a worker failed: the job went back to its checkpoint of step 1
    for step in (2, 3):
        first.log_step(_row(step, 0.5 + 0.1 * step))
    first.close(None)  # the controller stopped without ending the job

    second = Trackers("job7", spec, on_failure=lambda *failure: failures.append(failure))
    second.open(resumed_after_step=3)  # another controller continues after the committed step 3
    second.log_step(_row(4, 0.9))
    second.close(JobState.SUCCEEDED)
    assert failures == []
    final = {1: 0.1, 2: 0.7, 3: 0.8, 4: 0.9}

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    events.Reload()
    assert len(list(tb_dir.iterdir())) == 3, "an event file per writer: first, after the rewind, after the restart"
    logged = [(e.step, e.value) for e in events.Scalars("reward_mean")]
    assert [step for step, _ in logged] == [1, 2, 3, 4], "the purge markers dropped the steps logged before"
    assert dict(logged) == pytest.approx(final)

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=mlruns.as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("resume").experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == "resumed-job7"
    history = sorted((m.step, m.timestamp, m.value) for m in client.get_metric_history(run.info.run_id, "reward_mean"))
    latest = {step: value for step, _, value in history}  # a redone step: both values, the later one last
    assert latest == pytest.approx(final) and len(history) == 6
    assert json.loads(run.data.params["reward.verifiers"]) == [{"name": "math", "weight": 1.0, "params": {},
                                                               "language": None}]

    runs = sorted((wandb_dir / "wandb").glob(f"offline-run-*-{wandb_run_id('job7')}"))
    assert len(runs) == 2, "offline: a folder per runner, with one run id"
    first_run, second_run = (read_offline_run(next(r.glob("*.wandb"))) for r in runs)
    assert first_run.run_id == second_run.run_id == "everstep-job7"
    assert {step: row["reward_mean"] for step, row in first_run.history.items()}[1] == pytest.approx(0.1)
    assert {step: row["reward_mean"] for step, row in second_run.history.items()} == {4: pytest.approx(0.9)}
