"""Experiment tracking end to end: a real job through the local stack (`LocalStack`, as `everstep up`) with
TensorBoard, W&B (offline) and MLflow (a file store) all on, each run read back with its library's own reader
(tensorboard's EventAccumulator, mlflow's MlflowClient, wandb's record schema) and compared with the job's REST
history and evaluations."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from stack_jobs import run_job
from wandb_offline_run import read_offline_run

from everstep_cli.local_stack import LocalStack, free_port

pytestmark = pytest.mark.slow

JOB_TIMEOUT_SECONDS = 300


def _rows() -> list[dict[str, str]]:
    # only words of the tiny tokenizer: numbers below 40, '+', '='
    return [{"prompt": f"{a} + {b} =", "answer": str(a + b)} for a in range(1, 13) for b in range(1, 13)]


def _step_values(history: list[dict]) -> dict[str, dict[int, float]]:
    """field -> {step: value} of every field of the REST history but `step`."""
    out: dict[str, dict[int, float]] = {}
    for row in history:
        for name, value in row.items():
            if name != "step":
                out.setdefault(name, {})[row["step"]] = float(value)
    return out


def _eval_values(evaluations: dict[str, dict]) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {}
    for evaluation in evaluations.values():
        for name, value in evaluation.items():
            if name != "step" and value is not None:
                out.setdefault(f"eval/{name}", {})[evaluation["step"]] = float(value)
    return out


def test_a_job_logs_to_tensorboard_wandb_and_mlflow(tiny_model_dir: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    wandb_dir = tmp_path / "wandb-dir"
    wandb_dir.mkdir()
    # the controller process inherits these
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(wandb_dir))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow's opt-in to its file store
    monkeypatch.setenv("EVERSTEP_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("REDIS_URL", raising=False)
    train, held_out = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    held_out.write_text("".join(json.dumps(r) + "\n" for r in _rows()[:8]))
    tb_dir, mlruns = tmp_path / "tb", tmp_path / "mlruns"
    spec = {
        "name": "tracked", "model_path": str(tiny_model_dir), "steps": 3, "seed": 0,
        "dataset": {"train_path": str(train), "eval_path": str(held_out)},
        # a random model scores 0 everywhere: keep its zero-signal groups so the trainer trains
        "algorithm": {"group_size": 4, "drop_zero_signal_groups": False},
        # min-p and the penalties run in the engine; evaluation samples at its own temperature and length
        "sampling": {"max_new_tokens": 40, "min_p": 0.02, "repetition_penalty": 1.1, "presence_penalty": 0.1,
                     "frequency_penalty": 0.1},
        "scheduler": {"token_budget": 800, "pool_capacity": 64},
        "evaluation": {"num_prompts": 8, "samples_per_prompt": 2,
                       "sampling": {"temperature": 0.7, "top_p": 0.95, "max_new_tokens": 48}},
        "tracking": {"tensorboard": {"log_dir": str(tb_dir)},
                     "wandb": {"project": "everstep-tests", "mode": "offline"},
                     "mlflow": {"tracking_uri": mlruns.as_uri(), "experiment_name": "tracking-e2e"}},
    }
    stack = LocalStack(tmp_path / "stack")
    state = stack.up(port=free_port())
    try:
        api = httpx.Client(base_url=state.controller_url, timeout=30)
        job = run_job(api, spec, timeout_seconds=JOB_TIMEOUT_SECONDS, poll_seconds=0.5)
        assert job["state"] == "SUCCEEDED", job["error"]
        history = api.get(f"/v1/jobs/{job['id']}/metrics").json()
        samples = api.get(f"/v1/jobs/{job['id']}/samples", params={"step": 3}).json()
        metrics_page = api.get("/metrics").text
    finally:
        stack.down()  # the controller stops: every run is closed and flushed
    job_id = job["id"]
    assert [row["step"] for row in history] == [1, 2, 3]
    assert any("loss" in row for row in history), "a step trained: the trainer's statistics are logged too"
    expected = _step_values(history)
    evaluations = _eval_values(job["evaluation"])
    assert set(evaluations["eval/accuracy"]) == {0, 3}  # before and after training
    assert set(evaluations["eval/pass_at_k"]) == set(evaluations["eval/maj_at_k"]) == {0, 3}
    assert samples and all(s["group_id"] and s["advantage"] is not None for s in samples)
    assert all(s["version_min"] is not None and s["version_min"] <= s["version_max"] <= 3 for s in samples)
    assert 'everstep_controller_tracker_failures_total{' not in metrics_page, "no tracker failed"

    _check_tensorboard(tb_dir, expected, evaluations)
    _check_mlflow(mlruns, job_id, expected, evaluations)
    _check_wandb(wandb_dir, job_id, expected, evaluations)


def _check_tensorboard(tb_dir: Path, expected: dict, evaluations: dict) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    tags = events.Tags()
    for name, by_step in {**expected, **evaluations}.items():
        assert name in tags["scalars"], f"tensorboard: no scalar {name}"
        logged = {event.step: event.value for event in events.Scalars(name)}
        assert logged == pytest.approx(by_step, rel=1e-6, abs=1e-6), name  # float32 in the event file
    assert "job_spec/text_summary" in tags["tensors"]
    (text_event,) = events.Tensors("job_spec/text_summary")
    assert b'"tracking-e2e"' in text_event.tensor_proto.string_val[0]


def _check_mlflow(mlruns: Path, job_id: str, expected: dict, evaluations: dict) -> None:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=mlruns.as_uri())
    experiment = client.get_experiment_by_name("tracking-e2e")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.data.tags["everstep.job_id"] == job_id and run.info.run_name == f"tracked-{job_id}"
    assert run.info.status == "FINISHED"
    assert run.data.params["steps"] == "3" and run.data.params["algorithm.group_size"] == "4"
    assert run.data.params["tracking.wandb.project"] == "everstep-tests"
    for name, by_step in {**expected, **evaluations}.items():
        logged = {m.step: m.value for m in client.get_metric_history(run.info.run_id, name)}
        assert logged == by_step, f"mlflow: {name}"


def _check_wandb(wandb_dir: Path, job_id: str, expected: dict, evaluations: dict) -> None:
    (run_file,) = (wandb_dir / "wandb").glob(f"offline-run-*-everstep-{job_id}/run-everstep-{job_id}.wandb")
    run = read_offline_run(run_file)
    assert run.run_id == f"everstep-{job_id}" and run.project == "everstep-tests"
    assert run.config["steps"] == 3 and run.config["tracking"]["mlflow"]["experiment_name"] == "tracking-e2e"
    assert run.exit_code == 0
    for name, by_step in {**expected, **evaluations}.items():
        logged = {step: row[name] for step, row in run.history.items() if name in row}
        assert logged == by_step, f"wandb: {name}"
