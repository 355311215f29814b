"""The spec's `tracking` section at submission: a backend whose library this controller lacks is refused (422
naming the field and the pip extra), and a tracker that fails never fails the job (it is logged and counted)."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis
from fastapi.testclient import TestClient
from prometheus_client import REGISTRY
from pydantic import ValidationError
from step_rows import step_row  # noqa: I001 (tests/controller helper)

from everstep.rest.job_record import JobState
from everstep.rest.job_spec import JobSpec
from everstep.rest.step_metrics import Evaluation
from everstep_controller.api.app import create_app
from everstep_controller.launchers.shared import SharedLauncher
from everstep_controller.run import metrics
from everstep_controller.run.manager import JobManager
from everstep_controller.spec import tracking_libraries as libraries
from everstep_controller.store.job_store import JobStore
from everstep_controller.tracking.trackers import Trackers, evaluation_values, step_values

SPEC = {"model_path": "/models/m", "dataset": {"train_path": "/data/train.jsonl"}, "steps": 3}
TRACKING = {"tensorboard": {"log_dir": "/tmp/tb"}, "wandb": {"project": "p"},
            "mlflow": {"tracking_uri": "file:///tmp/mlruns"}}


@pytest.fixture
def client(redis_url: str, tmp_path: Path) -> TestClient:
    store = JobStore(redis.Redis.from_url(redis_url))
    manager = JobManager(store, SharedLauncher(rollout="127.0.0.1:1", trainer="127.0.0.1:1"), "127.0.0.1:1", tmp_path)
    return TestClient(create_app(manager, store))


def test_no_tracking_by_default() -> None:
    spec = JobSpec.model_validate(SPEC)
    assert spec.tracking.tensorboard is None and spec.tracking.wandb is None and spec.tracking.mlflow is None


def test_wandb_is_offline_unless_told() -> None:
    spec = JobSpec.model_validate({**SPEC, "tracking": {"wandb": {"project": "p"}}})
    assert spec.tracking.wandb.mode == "offline"
    with pytest.raises(ValidationError, match="tracking.wandb.mode"):
        JobSpec.model_validate({**SPEC, "tracking": {"wandb": {"project": "p", "mode": "cloud"}}})


@pytest.mark.parametrize("backend", ["tensorboard", "wandb", "mlflow"])
def test_a_backend_whose_library_is_missing_is_refused_with_its_extra(
        client: TestClient, monkeypatch: pytest.MonkeyPatch, backend: str) -> None:
    missing = libraries.BACKEND_LIBRARIES[backend].module
    real_check = libraries.library_installed
    # the import check, patched to report this one library missing (they are all installed here)
    monkeypatch.setattr(libraries, "library_installed", lambda module: module != missing and real_check(module))
    response = client.post("/v1/jobs", json={**SPEC, "tracking": TRACKING})
    assert response.status_code == 422, response.text
    (error,) = response.json()["detail"]
    assert error["loc"] == ["body", "tracking", backend]
    assert f"everstep-controller[{libraries.BACKEND_LIBRARIES[backend].extra}]" in error["msg"]
    assert client.get("/v1/jobs").json() == [], "a refused spec creates no job"


def test_every_backend_installed_is_accepted(client: TestClient) -> None:
    response = client.post("/v1/jobs", json={**SPEC, "tracking": TRACKING})
    assert response.status_code == 201, response.text
    assert response.json()["spec"]["tracking"]["mlflow"]["experiment_name"] == "everstep"


def _failures(backend: str, operation: str) -> float:
    value = REGISTRY.get_sample_value("everstep_controller_tracker_failures_total",
                                      {"backend": backend, "operation": operation})
    return value or 0.0


def test_a_failing_tracker_is_counted_and_the_others_go_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow's opt-in to its file store
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    good = tmp_path / "good"
    spec = JobSpec.model_validate({**SPEC, "tracking": {
        "tensorboard": {"log_dir": str(blocker / "events")},  # a folder under a file: the writer cannot start
        "mlflow": {"tracking_uri": good.as_uri(), "experiment_name": "e"}}})
    before = _failures("tensorboard", "open")
    trackers = Trackers("job1", spec, on_failure=metrics.count_tracker_failure)  # as the runner counts them
    trackers.open(resumed_after_step=None)
    assert _failures("tensorboard", "open") == before + 1
    trackers.log_step(step_row(1))
    trackers.log_evaluation(Evaluation(step=1, accuracy=0.5, greedy_accuracy=None, k=2, num_prompts=4,
                                       num_unscored=0))
    trackers.close(JobState.SUCCEEDED)

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=good.as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("e").experiment_id])
    assert run.info.status == "FINISHED" and run.data.tags["everstep.job_id"] == "job1"
    assert run.data.metrics["eval/accuracy"] == 0.5 and "eval/greedy_accuracy" not in run.data.metrics
    assert run.data.metrics["reward_mean"] == step_values(step_row(1))["reward_mean"]


def test_values_are_the_rows_fields_but_step() -> None:
    row = step_row(2)
    values = step_values(row)
    assert "step" not in values and set(values) == set(row.model_dump()) - {"step"}
    evaluation = Evaluation(step=0, accuracy=None, greedy_accuracy=0.25, k=4, num_prompts=8, num_unscored=1)
    assert evaluation_values(evaluation) == {"eval/greedy_accuracy": 0.25, "eval/k": 4.0, "eval/num_prompts": 8.0,
                                             "eval/num_unscored": 1.0}
    evaluation = Evaluation(step=2, accuracy=0.5, greedy_accuracy=None, k=4, num_prompts=8, num_unscored=0,
                            pass_at_k=0.75, maj_at_k=0.625)
    assert evaluation_values(evaluation) == {"eval/accuracy": 0.5, "eval/k": 4.0, "eval/num_prompts": 8.0,
                                             "eval/num_unscored": 0.0, "eval/pass_at_k": 0.75, "eval/maj_at_k": 0.625}
