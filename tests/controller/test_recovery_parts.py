"""The parts the controller recovers from faults with, one by one (the faults themselves, through real
processes, are in tests/faults/): typed errors with deadlines, retried Redis commands, an idempotent
step commit, backoff, deterministic per-sample seeds, and the settings that bound all of it."""

from __future__ import annotations

import re
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest
import redis
from step_rows import step_row

from everstep.processes import free_port
from everstep.rest.job_spec import JobSpec
from everstep.v1 import reward_pb2
from everstep_cli.local_stack import redis_server_binary
from everstep_controller.run.backoff import Backoff
from everstep_controller.run.clients import Deadlines, RewardClient, RolloutClient, Service, ServiceUnavailable
from everstep_controller.run.runner import sample_seed
from everstep_controller.run.runner_settings import RunnerSettings
from everstep_controller.store.job_store import JobStore
from everstep_controller.store.progress_store import JobProgress, ProgressStore
from everstep_controller.store.redis_client import connect

SPEC = {"model_path": "/m", "dataset": {"train_path": "/d.jsonl"}}


def test_a_call_that_fails_names_the_service_its_address_and_the_deadline() -> None:
    nobody = f"127.0.0.1:{free_port()}"
    with pytest.raises(ServiceUnavailable, match=rf"^rollout at {nobody} failed GetStatus: UNAVAILABLE") as down:
        RolloutClient(nobody, Deadlines(rollout_seconds=5)).status()
    assert (down.value.service, down.value.role) == (Service.ROLLOUT, Service.ROLLOUT)
    item = reward_pb2.RewardItem(id="a", verifiers=[reward_pb2.VerifierSpec(name="math", answer="1")])
    with pytest.raises(ServiceUnavailable, match=rf"^reward service at {nobody} failed Score") as reward_down:
        RewardClient(nobody, timeout_seconds=5).score([item])
    assert reward_down.value.service is Service.REWARD and reward_down.value.role is None, "shared: not restarted"
    with socket.socket() as silent:  # accepts connections (the kernel does) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        started = time.monotonic()
        with pytest.raises(ServiceUnavailable) as hung:
            RolloutClient(address, Deadlines(rollout_seconds=0.5)).status()
    assert str(hung.value) == f"rollout at {address} did not answer GetStatus within 0.5s (DEADLINE_EXCEEDED)"
    assert time.monotonic() - started < 5


def test_redis_commands_wait_out_a_restart_and_give_up_after_the_retry_time(tmp_path: Path) -> None:
    port = free_port()
    argv = [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--dir", str(tmp_path),
            "--appendonly", "yes", "--appendfsync", "always", "--save", ""]
    server = subprocess.Popen(argv, stdout=subprocess.DEVNULL, start_new_session=True)
    try:
        client = connect(f"redis://127.0.0.1:{port}/0", retry_seconds=20)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.set("kept", "yes")
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline
        server.kill()
        server.wait()
        restarted: list[subprocess.Popen] = []
        timer = threading.Timer(1.0, lambda: restarted.append(
            subprocess.Popen(argv, stdout=subprocess.DEVNULL, start_new_session=True)))
        timer.start()
        assert client.get("kept") == b"yes", "the command waited for Redis to come back, with its data"
        timer.join()
        server = restarted[0]
        server.kill()
        server.wait()
        started = time.monotonic()
        with pytest.raises(redis.ConnectionError):
            connect(f"redis://127.0.0.1:{port}/0", retry_seconds=1).get("kept")
        assert time.monotonic() - started < 5
    finally:
        server.kill()
        server.wait()


def test_a_step_commit_applied_twice_is_stored_once(redis_url: str) -> None:
    """A commit whose reply was lost (Redis restarted) is retried; the retry finds the step stored."""
    store = JobStore(redis.Redis.from_url(redis_url))
    job_id = store.create(JobSpec(**SPEC)).id
    store.claim(job_id, "controller-a")
    progress = ProgressStore(store)
    for step in (1, 1, 2, 2):
        state = JobProgress(step=step, version=step, prompt_epoch=0, prompt_cursor=step, group_counter=step,
                            scheduler={}, num_trained_samples=step)
        progress.commit_step(job_id, "controller-a", progress=state, carried=[], closed_sample_ids=[],
                             metrics=step_row(step), record_changes={"step": step})
    assert [m.step for m in store.metrics(job_id)] == [1, 2]


def test_backoff_doubles_up_to_its_cap_with_jitter() -> None:
    backoff = Backoff(initial_seconds=0.5, max_seconds=4)
    for failures, ceiling in ((1, 0.5), (2, 1), (3, 2), (4, 4), (10, 4)):
        pauses = [backoff.seconds(failures) for _ in range(50)]
        assert all(ceiling / 2 <= p <= ceiling for p in pauses) and len(set(pauses)) > 1
    with pytest.raises(ValueError, match="initial_seconds"):
        Backoff(initial_seconds=5, max_seconds=1)


def test_deterministic_mode_seeds_each_sample_and_needs_the_sync_scheduler() -> None:
    seeds = {sample_seed(3, f"g{g}-{k}") for g in range(50) for k in range(8)}
    assert len(seeds) == 400 and 0 not in seeds and max(seeds) < 2**63
    assert sample_seed(3, "g0-0") == sample_seed(3, "g0-0") != sample_seed(4, "g0-0")
    JobSpec(**SPEC, deterministic=True, scheduler={"mode": "sync"})
    with pytest.raises(ValueError, match="deterministic needs scheduler.mode 'sync'"):
        JobSpec(**SPEC, deterministic=True)
    with pytest.raises(ValueError, match=r"deterministic needs scheduler.overlap 0 \(got 1\)"):
        JobSpec(**SPEC, deterministic=True, scheduler={"mode": "sync", "overlap": 1})
    with pytest.raises(ValueError, match="scheduler.overlap"):
        JobSpec(**SPEC, scheduler={"overlap": -1})


def test_controller_options_set_every_deadline_and_retry_limit(capsys: pytest.CaptureFixture[str]) -> None:
    from everstep_controller.__main__ import parse_args, runner_settings

    base = ["--redis-url", "redis://x", "--reward", "r:1"]
    settings = runner_settings(parse_args([*base, "--trainer-deadline-seconds", "7", "--generate-deadline-seconds",
                                           "9", "--worker-restarts", "0", "--retry-max-seconds", "2"]))
    assert settings.deadlines == Deadlines(trainer_seconds=7, generate_seconds=9)
    assert settings.worker_restarts == 0 and settings.backoff == Backoff(max_seconds=2)
    with pytest.raises(ValueError, match="reward_seconds must be positive"):
        Deadlines(reward_seconds=0)
    with pytest.raises(ValueError, match="worker_restarts must be >= 0"):
        RunnerSettings(worker_restarts=-1)
    for flags, error in ((["--reward-deadline-seconds", "0"], "--reward-deadline-seconds must be positive"),
                         (["--worker-restarts", "-1"], "--worker-restarts must be >= 0"),
                         (["--retry-initial-seconds", "40"], "--retry-initial-seconds (40.0) must be positive and at "
                                                             "most retry_max_seconds (30.0)")):
        with pytest.raises(SystemExit):
            parse_args([*base, *flags])
        assert error in capsys.readouterr().err


def test_every_controller_option_is_a_flag_with_the_settings_default_and_help() -> None:
    """`ControllerSettings` is the one place of each option's default: the flags and the runners' settings
    objects take theirs from it."""
    import dataclasses

    from everstep_controller.__main__ import build_parser
    from everstep_controller.settings import ControllerSettings

    actions = {a.dest: a for a in build_parser()._actions}
    for f, _kind, option in ControllerSettings.options():
        action = actions[f.name]
        assert action.option_strings == [f"--{f.name.replace('_', '-')}"] and action.help == option.help
        assert action.required if f.default is dataclasses.MISSING else action.default == f.default
    table = Path(__file__).parents[2] / "docs" / "controller.md"
    rows = re.findall(r"^\| `(--[a-z0-9-]+)`(?:, `(--[a-z0-9-]+)`)? \| ([^|]+) \|", table.read_text(), flags=re.M)
    assert len(rows) > 20
    for first, second, documented in rows:  # `| --a, --b | 0.5, 30 |`: one default per flag, or one for both
        flags, values = [f for f in (first, second) if f], documented.strip().split(", ")
        for flag, value in zip(flags, values * len(flags) if len(values) == 1 else values, strict=True):
            default, value = actions[flag.removeprefix("--").replace("-", "_")].default, value.strip("`")
            if isinstance(default, int | float):
                assert float(value) == default, f"docs/controller.md: {flag} {value}, the flag's default {default}"
            elif isinstance(default, str):
                assert value == default, f"docs/controller.md: {flag} {value}, the flag's default {default}"
    defaults = RunnerSettings()
    assert defaults == RunnerSettings.from_settings(ControllerSettings(redis_url="r", reward="x"))
    assert (defaults.num_scorers, defaults.deadlines.generate_seconds, defaults.backoff.max_seconds) == (
        ControllerSettings.default("num_scorers"), ControllerSettings.default("generate_deadline_seconds"),
        ControllerSettings.default("retry_max_seconds"))


def test_the_redis_url_may_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """EVERSTEP_REDIS_URL (the chart's Secret) is --redis-url's default: a password in it never reaches the process's
    arguments; the flag still wins, and without either the flag is required."""
    from everstep_controller.__main__ import build_parser

    monkeypatch.setenv("EVERSTEP_REDIS_URL", "redis://:secret@redis:6379/0")
    assert build_parser().parse_args(["--reward", "r:1"]).redis_url == "redis://:secret@redis:6379/0"
    assert build_parser().parse_args(["--reward", "r:1", "--redis-url", "redis://x:1/0"]).redis_url == "redis://x:1/0"
    monkeypatch.delenv("EVERSTEP_REDIS_URL")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--reward", "r:1"])
