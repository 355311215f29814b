"""The `everstep` CLI's job commands (list, logs, pause, resume, cancel, scale, status, submit --set) run through
its main() against the REST app on a real Redis; the job manager's loop is not started."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis
import yaml
from fastapi.testclient import TestClient
from step_rows import eval_row, step_row

from everstep.rest.job_record import JobState
from everstep_cli import cli, logs
from everstep_cli.job_file import SpecOverrideError, load_job_file
from everstep_cli.rest_client import ControllerClient
from everstep_controller.api.app import create_app
from everstep_controller.launchers.shared import SharedLauncher
from everstep_controller.run.manager import JobManager
from everstep_controller.store.job_store import JobStore

SPEC = {"name": "arith", "model_path": "/models/m", "dataset": {"train_path": "/data/train.jsonl"}, "steps": 3}


@pytest.fixture
def store(redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> JobStore:
    store = JobStore(redis.Redis.from_url(redis_url))
    manager = JobManager(store, SharedLauncher(rollout="127.0.0.1:1", trainer="127.0.0.1:1"), "127.0.0.1:1", tmp_path)
    http = TestClient(create_app(manager, store))

    def connect(self: ControllerClient, url: str | None = None, **_: object) -> None:
        self.url, self._http = "http://testserver", http

    monkeypatch.setattr(ControllerClient, "__init__", connect)
    return store


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        cli.main(argv)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
        if isinstance(e.code, str):
            print(e.code, file=__import__("sys").stderr)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def job_file(tmp_path: Path) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(SPEC))
    return path


def test_submit_list_pause_resume_cancel(store: JobStore, job_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(["submit", str(job_file)], capsys)
    assert code == 0
    job_id = out.strip()
    code, out, _ = _run(["list"], capsys)
    assert code == 0 and out.split() == [job_id, "PENDING", "step", "0/3", "arith"]
    store.update(job_id, state=JobState.RUNNING)
    assert _run(["pause", job_id], capsys)[:2] == (0, "RUNNING\n"), "the runner pauses it between steps"
    assert store.requested(job_id).value == "pause"
    store.update(job_id, state=JobState.PAUSED)
    assert _run(["resume", job_id], capsys)[:2] == (0, "PAUSED\n")
    assert store.requested(job_id).value == "resume"
    store.update(job_id, state=JobState.CANCELLED)
    code, _, err = _run(["resume", job_id], capsys)
    assert code == 1 and f"job {job_id} is CANCELLED; it cannot resume" in err


def test_scale_resizes_a_job_s_rollout_pool(store: JobStore, job_file: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    job_id = _run(["submit", str(job_file)], capsys)[1].strip()
    assert _run(["scale", job_id, "--rollout", "3"], capsys)[:2] == (0, f"{job_id}: 3 rollout engine(s) from the next "
                                                                         "iteration\n")
    assert store.requested_replicas(job_id) == 3 and store.get(job_id).spec.resources.rollout.replicas == 3
    code, _, err = _run(["scale", job_id, "--rollout", "0"], capsys)
    assert code == 1 and "--rollout must be at least 1" in err
    store.update(job_id, state=JobState.SUCCEEDED)
    code, _, err = _run(["scale", job_id, "--rollout", "2"], capsys)
    assert code == 1 and f"job {job_id} is SUCCEEDED; its rollout pool cannot change" in err


@pytest.mark.parametrize("command", [["pause", "nope"], ["resume", "nope"], ["cancel", "nope"], ["status", "nope"],
                                     ["logs", "nope"], ["logs", "nope", "--follow"],
                                     ["scale", "nope", "--rollout", "2"]])
def test_an_unknown_job_exits_1_naming_it(store: JobStore, command: list[str],
                                          capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(command, capsys)
    assert code == 1 and out == "" and "no job 'nope'" in err


def test_logs_prints_steps_and_evaluations(store: JobStore, capsys: pytest.CaptureFixture[str]) -> None:
    from everstep.rest.job_spec import JobSpec

    job_id = store.create(JobSpec.model_validate(SPEC)).id
    rows = [step_row(1), step_row(2).model_copy(update={"reward_mean": 0.75, "num_samples_trained": 16,
                                                        "num_trained_samples_total": 16, "loss": 0.125,
                                                        "grad_norm": 0.5, "learning_rate": 1e-6})]
    store.redis.rpush(store.key(job_id, ":metrics"), *(r.model_dump_json() for r in rows))
    store.update(job_id, step=2, evaluation={"0": eval_row(0), "2": eval_row(2)})
    code, out, _ = _run(["logs", job_id], capsys)
    lines = out.splitlines()
    assert code == 0 and len(lines) == 4
    assert lines[0].startswith("eval    0  accuracy 0.500 (avg@1, 1 prompts)")
    assert lines[1].startswith("step    1/3  reward 0.000  trained 0 (0 total)") and "loss" not in lines[1]
    assert lines[2].startswith("step    2/3  reward 0.750  trained 16 (16 total)")
    assert "loss 0.125" in lines[2] and "grad_norm 0.5" in lines[2] and "lr 1.00e-06" in lines[2]
    assert lines[3].startswith("eval    2  accuracy 0.500")
    from everstep_cli.logs import eval_line

    line = eval_line(eval_row(4).model_copy(update={"k": 4, "pass_at_k": 0.75, "maj_at_k": 0.625,
                                                    "greedy_accuracy": 0.5}).model_dump())
    assert line.endswith("(avg@4, 1 prompts)  pass@4 0.750  maj@4 0.625  greedy 0.500"), line


def test_logs_follow_prints_new_steps_until_the_job_ends(store: JobStore, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    from everstep.rest.job_spec import JobSpec

    job_id = store.create(JobSpec.model_validate(SPEC)).id
    store.update(job_id, state=JobState.RUNNING)
    ticks = iter(range(1, 4))

    def next_step(_: float) -> None:  # each poll, the job trains one more step; it ends after the third
        step = next(ticks)
        store.redis.rpush(store.key(job_id, ":metrics"), step_row(step).model_dump_json())
        store.update(job_id, step=step, state=JobState.SUCCEEDED if step == 3 else JobState.RUNNING)

    monkeypatch.setattr(logs.time, "sleep", next_step)
    code, out, _ = _run(["logs", job_id, "--follow"], capsys)
    lines = out.splitlines()
    assert code == 0 and [line.split()[1] for line in lines[:-1]] == ["1/3", "2/3", "3/3"], "each step once"
    assert lines[-1] == f"job {job_id} SUCCEEDED at step 3/3"


def test_status_names_checkpoints_and_latest_weights(store: JobStore, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from everstep.rest.job_record import CheckpointInfo
    from everstep.rest.job_spec import JobSpec

    job_id = store.create(JobSpec.model_validate(SPEC)).id
    store.update(job_id, checkpoints=[CheckpointInfo(step=2, path="/ckpt/step-2", saved_at=1.0)],
                 latest_weights="/ckpt/step-2")
    code, out, _ = _run(["status", job_id, "--json"], capsys)
    record = json.loads(out)
    assert code == 0 and record["latest_weights"] == "/ckpt/step-2"
    assert record["checkpoints"] == [{"step": 2, "path": "/ckpt/step-2", "saved_at": 1.0}]


def test_status_summarizes_a_job(store: JobStore, capsys: pytest.CaptureFixture[str]) -> None:
    from everstep.rest.job_record import CheckpointInfo
    from everstep.rest.job_spec import JobSpec

    job_id = store.create(JobSpec.model_validate(SPEC)).id
    code, out, _ = _run(["status", job_id], capsys)
    assert code == 0 and out.splitlines()[0] == f"job {job_id} (arith): PENDING at step 0/3"
    assert "  no step completed yet" in out and "  latest weights: none yet (no checkpoint)" in out

    store.update(job_id, state=JobState.RUNNING, step=2, metrics=step_row(2).model_copy(update={"reward_mean": 0.625}),
                 evaluation={"0": eval_row(0), "2": eval_row(2)},
                 checkpoints=[CheckpointInfo(step=1, path="/ckpt/step-1", saved_at=1.0),
                              CheckpointInfo(step=2, path="/ckpt/step-2", saved_at=2.0)],
                 latest_weights="/ckpt/step-2")
    code, out, _ = _run(["status", job_id], capsys)
    lines = out.splitlines()
    assert code == 0 and lines[0] == f"job {job_id} (arith): RUNNING at step 2/3"
    assert lines[2] == "  latest " + logs.step_line(step_row(2).model_copy(update={"reward_mean": 0.625}).model_dump(),
                                                    3)
    assert "reward 0.625" in lines[2]
    assert [line.split()[:2] for line in lines if line.startswith("  eval")] == [["eval", "0"], ["eval", "2"]]
    assert "  checkpoints:\n    step    1  /ckpt/step-1\n    step    2  /ckpt/step-2\n" in out
    assert "  latest weights: /ckpt/step-2" in lines
    assert not any(line.startswith("  tracking:") for line in lines), "no tracking section"

    tracked = store.create(JobSpec.model_validate({**SPEC, "tracking": {
        "tensorboard": {"log_dir": "/runs/tb"}, "mlflow": {"tracking_uri": "http://mlflow:5000"}}})).id
    code, out, _ = _run(["status", tracked], capsys)
    assert "  tracking: tensorboard /runs/tb; mlflow http://mlflow:5000 experiment everstep" in out.splitlines()

    store.update(job_id, state=JobState.FAILED, error="RewardFailed: no verifier 'x'")
    code, out, _ = _run(["status", job_id], capsys)
    assert code == 0 and "FAILED at step 2/3" in out.splitlines()[0]
    assert out.splitlines()[2] == "  error: RewardFailed: no verifier 'x'"


def test_submit_set_overrides_fields(store: JobStore, job_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(["submit", str(job_file), "--set", "trainer.learning_rate=3e-4",
                           "--set", 'sampling.stop=["</s>"]', "--set", "steps=5", "--set", "name=from cli"], capsys)
    assert code == 0, err
    spec = store.get(out.strip()).spec
    assert spec.trainer.learning_rate == 3e-4 and spec.sampling.stop == ["</s>"]
    assert spec.steps == 5 and spec.name == "from cli" and spec.dataset.train_path == "/data/train.jsonl"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("trainer.learnig_rate=3e-4", "the job spec has no field 'trainer.learnig_rate' (trainer has "),
        ("nonsense=1", "the job spec has no field 'nonsense'"),
        ("steps.max=1", "steps has no fields"),
        ("steps=0", "steps: Input should be greater than or equal to 1"),
        ("trainer.learning_rate=fast", "trainer.learning_rate: Input should be a valid number"),
        ("algorithm.loss.correction=magic", "algorithm.loss.correction: Input should be"),
        ("steps", "expected FIELD=VALUE"),
    ],
)
def test_a_bad_override_is_refused_naming_the_field_before_submitting(
        store: JobStore, job_file: Path, override: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(["submit", str(job_file), "--set", override], capsys)
    assert code == 1 and out == "" and message in err
    assert store.list() == [], "nothing was submitted"


def test_override_paths_are_relative_to_the_current_directory(tmp_path: Path, job_file: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path / "..")
    spec = load_job_file(job_file, ["dataset.train_path=[a.jsonl, 'shards/*.parquet']",
                                    "reward.verifiers=[{name: math, weight: 2}]"])
    here = Path.cwd().resolve()
    assert spec["dataset"]["train_path"] == [str(here / "a.jsonl"), str(here / "shards/*.parquet")]
    assert spec["reward"]["verifiers"] == [{"name": "math", "weight": 2}]
    assert load_job_file(job_file)["dataset"]["train_path"] == "/data/train.jsonl"
    assert load_job_file(job_file, ["tracking.tensorboard.log_dir=runs/tb"])["tracking"]["tensorboard"] == {
        "log_dir": str(here / "runs/tb")}
    with pytest.raises(SpecOverrideError, match=r"reward.verifiers.0.weight: .*reward.verifiers has no fields"):
        load_job_file(job_file, ["reward.verifiers.0.weight=2"])


def test_the_local_stack_names_a_service_package_that_is_not_installed() -> None:
    """The CLI depends on no service: `up`, `serve` and `demo` say which package to install before starting one."""
    from everstep_cli.local_stack import require_services

    require_services(["controller", "rollout", "trainer", "reward", "sandbox"])  # all installed here
    with pytest.raises(RuntimeError, match=r"the no_such service package\(s\) are not installed") as raised:
        require_services(["controller", "no_such"])
    assert "pip install -e services/no_such " in str(raised.value) and "controller" not in str(raised.value)
