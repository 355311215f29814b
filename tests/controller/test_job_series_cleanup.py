"""A job's Prometheus series (those labelled by job_id) leave /metrics once the job ended here (after a grace
period, so that its final values are scraped) or was lost to another controller (at once); a PAUSED job
keeps them. The endings go through the real path: the manager's runner thread, `JobRunner.run`, the reap."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from prometheus_client import generate_latest
from prometheus_client.metrics import MetricWrapperBase

from everstep.rest.job_record import JobState
from everstep.rest.job_spec import JobSpec
from everstep.rest.step_metrics import StepMetrics
from everstep_controller.launchers.shared import SharedLauncher
from everstep_controller.run import metrics
from everstep_controller.run.manager import JobManager
from everstep_controller.run.runner import JobCancelled, JobRunner
from everstep_controller.store.job_store import Action, JobStore

STEP_ROW = StepMetrics(
    step=2, policy_version=2, reward_mean=0.5, num_samples_scored=8, num_samples_trained=8,
    num_trained_samples_total=16, num_groups_trained=2, num_groups_zero_signal=0, num_groups_unscorable=0,
    num_samples_unscorable=0, num_groups_dropped=0, num_samples_purged=0, partial_buffer_size=3,
    num_finished_rollouts=8, finished_tokens=96, generated_tokens=120, tokens_per_s=60.0, staleness_mean=0.0,
    staleness_max=0, rollout_seconds=2.0, reward_seconds=0.25, train_seconds=0.5, weight_push_seconds=0.1,
    iteration_seconds=3.0, turns_per_sample=2.0, tool_use_rate=0.5, num_tool_calls=4, tool_errors={},
    tool_seconds_mean=0.1, reward_kl=0.01, reward_kl_coef=0.1, reward_kl_penalty_mean=0.05,
    reward_kl_seconds=0.2)
PER_JOB_NAMES = {"everstep_controller_job_step", "everstep_controller_policy_version",
                 "everstep_controller_reward_mean", "everstep_controller_eval_accuracy_ratio",
                 "everstep_controller_reward_kl_penalty_mean", "everstep_controller_reward_kl_coef",
                 "everstep_controller_rollout_tokens", "everstep_controller_rollout_seconds",  # counters: _total
                 "everstep_controller_partial_buffer_size",
                 "everstep_controller_tool_calls", "everstep_controller_tool_turns_per_sample",  # tool_calls: _total
                 "everstep_controller_tool_use_ratio", "everstep_controller_tool_call_seconds",
                 "everstep_controller_engine_tokens", "everstep_controller_engine_weight_version"}  # per engine
# the lines a job's series take on /metrics: one per metric, eval accuracy twice (sampled and greedy), and the
# four counters two each (_total and _created)
LINES_PER_JOB = len(PER_JOB_NAMES) + 1 + 4


def _observe(job_id: str) -> None:
    """What a job's steps and evaluations set: observe_iteration (the commit) and the evaluation gauges."""
    metrics.observe_iteration(job_id, STEP_ROW, retention_ages=[1], staleness=[0, 1])
    metrics.observe_tools(job_id, STEP_ROW)  # a job with tools (kind "none" only: no failed call)
    metrics.EVAL_ACCURACY.labels(job_id=job_id, kind="sampled").set(0.25)
    metrics.EVAL_ACCURACY.labels(job_id=job_id, kind="greedy").set(0.5)
    metrics.count_engine_tokens(job_id, "127.0.0.1:1", 100, weight_version=3)  # one engine


def _series_of(job_id: str) -> list[str]:
    return [line for line in generate_latest().decode().splitlines()
            if not line.startswith("#") and f'job_id="{job_id}"' in line]


def test_per_job_holds_every_metric_labelled_by_job_id() -> None:
    labelled = {m._name for m in vars(metrics).values()
                if isinstance(m, MetricWrapperBase) and "job_id" in m._labelnames}
    assert {m._name for m in metrics.PER_JOB} == labelled == PER_JOB_NAMES


def test_removing_a_jobs_series_leaves_the_others() -> None:
    gone, kept = f"gone-{uuid.uuid4().hex[:6]}", f"kept-{uuid.uuid4().hex[:6]}"
    _observe(gone)
    _observe(kept)
    assert len(_series_of(gone)) == LINES_PER_JOB
    metrics.remove_job_series(gone)
    assert _series_of(gone) == []
    assert len(_series_of(kept)) == LINES_PER_JOB
    metrics.remove_job_series(gone)  # again: nothing left to remove, no error
    metrics.remove_job_series(kept)


def test_removal_later_is_due_after_its_delay_and_cancelled_by_a_new_run() -> None:
    job_id, again = f"later-{uuid.uuid4().hex[:6]}", f"again-{uuid.uuid4().hex[:6]}"
    _observe(job_id)
    _observe(again)
    metrics.remove_job_series_later(job_id, 60, now=1000.0)
    metrics.remove_job_series_later(again, 60, now=1000.0)
    metrics.keep_job_series(again)  # taken again by this controller before its removal was due
    assert job_id not in metrics.remove_due_job_series(now=1059.0) and _series_of(job_id)
    assert metrics.remove_due_job_series(now=1060.0) == [job_id]
    assert _series_of(job_id) == [] and _series_of(again)
    metrics.remove_job_series(again)


# -- through the manager and the runner --------------------------------------------------------------------

@pytest.fixture
def manager(redis_url: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[JobManager]:
    store = JobStore(redis.Redis.from_url(redis_url))
    grace = getattr(request, "param", 0.0)
    manager = JobManager(store, SharedLauncher(rollout="127.0.0.1:1", trainer="127.0.0.1:1"), "127.0.0.1:1",
                         tmp_path, poll_seconds=0.05, owner="this-controller", finished_series_seconds=grace)
    yield manager
    manager.stop(stop_workers=False, timeout_seconds=10)


def _run_job(manager: JobManager, monkeypatch: pytest.MonkeyPatch, drive: Callable[[JobRunner], None],
             until: Callable[[str], bool] | None = None) -> str:
    """Submits a job whose runner observes its metrics then calls `drive` (in place of the steps), and ticks the
    manager until the runner thread ended and was reaped (or, with `until`, until `until(job_id)`)."""
    def fake_drive(runner: JobRunner, failure: object) -> None:
        _observe(runner.job_id)
        drive(runner)

    monkeypatch.setattr(JobRunner, "_load_data", lambda runner: None)
    monkeypatch.setattr(JobRunner, "_attach_workers", lambda runner: None)
    monkeypatch.setattr(JobRunner, "_drive", fake_drive)
    job_id = manager.submit(JobSpec(model_path="/m", dataset={"train_path": "/d.jsonl"})).id
    deadline = time.monotonic() + 30
    while True:
        manager._tick()
        if until is not None and until(job_id):
            return job_id
        if until is None and job_id not in manager.running and manager.store.get(job_id).state != JobState.PENDING:
            return job_id
        assert time.monotonic() < deadline, "the job's runner did not end"


def _fail(runner: JobRunner) -> None:
    raise RuntimeError("boom")


def _cancel(runner: JobRunner) -> None:
    raise JobCancelled


def _taken_over(runner: JobRunner) -> None:
    runner.store.claim(runner.job_id, "another-controller")  # the next fenced write raises LostOwnership


@pytest.mark.parametrize(("drive", "state"), [(lambda runner: None, JobState.SUCCEEDED), (_fail, JobState.FAILED),
                                              (_cancel, JobState.CANCELLED), (_taken_over, JobState.RUNNING)],
                         ids=["succeeded", "failed", "cancelled", "taken-over"])
def test_a_job_that_ended_or_was_taken_over_leaves_no_series(manager: JobManager, monkeypatch: pytest.MonkeyPatch,
                                                             drive: Callable[[JobRunner], None],
                                                             state: JobState) -> None:
    other = f"other-{uuid.uuid4().hex[:6]}"
    _observe(other)
    job_id = _run_job(manager, monkeypatch, drive)
    assert manager.store.get(job_id).state == state
    assert _series_of(job_id) == [], "a finished job's series are removed (grace 0 here)"
    assert len(_series_of(other)) == LINES_PER_JOB, "another job's series stay"
    metrics.remove_job_series(other)


@pytest.mark.parametrize("manager", [60.0], indirect=True)
def test_a_finished_jobs_series_stay_for_the_grace_period(manager: JobManager,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    job_id = _run_job(manager, monkeypatch, lambda runner: None)
    assert manager.store.get(job_id).state == JobState.SUCCEEDED
    assert _series_of(job_id), "kept so that Prometheus scrapes the final values"
    assert metrics.remove_due_job_series(now=time.monotonic() + 61) == [job_id]
    assert _series_of(job_id) == []


def test_a_paused_job_keeps_its_series_until_it_is_cancelled(manager: JobManager,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    asked = threading.Event()

    def pause_then_honour(runner: JobRunner) -> None:
        asked.wait(10)
        runner._honour_requests()  # the real pause: PAUSED until resumed or cancelled

    def paused(job_id: str) -> bool:
        record = manager.store.get(job_id)
        if record.state == JobState.RUNNING and not asked.is_set():
            manager.act(job_id, Action.pause)
            asked.set()
        return record.state == JobState.PAUSED

    job_id = _run_job(manager, monkeypatch, pause_then_honour, until=paused)
    for _ in range(5):
        manager._tick()
    assert len(_series_of(job_id)) == LINES_PER_JOB, "a PAUSED job keeps its series"
    manager.act(job_id, Action.cancel)
    deadline = time.monotonic() + 30
    while job_id in manager.running or manager.store.get(job_id).state != JobState.CANCELLED:
        manager._tick()
        assert time.monotonic() < deadline
    assert _series_of(job_id) == []


def test_the_retention_of_a_finished_jobs_series_is_a_controller_flag(capsys: pytest.CaptureFixture[str]) -> None:
    from everstep_controller.__main__ import parse_args
    from everstep_controller.settings import ControllerSettings

    base = ["--redis-url", "redis://x", "--reward", "r:1"]
    assert parse_args(base).finished_job_series_seconds == 300.0
    assert parse_args([*base, "--finished-job-series-seconds", "12.5"]).finished_job_series_seconds == 12.5
    with pytest.raises(SystemExit):
        parse_args([*base, "--finished-job-series-seconds", "-1"])
    assert "--finished-job-series-seconds must be >= 0" in capsys.readouterr().err
    assert ControllerSettings.default("finished_job_series_seconds") == 300.0
