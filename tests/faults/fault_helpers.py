"""Helpers of the fault tests: restartable Redis and services, controllers, tiny jobs, fault injection.

Everything is a real process started through `everstep.processes`: Redis with its
append-only file fsynced on every write, the reward service (and the sandbox), controllers with
the local launcher (each job's rollout engine and trainer are processes of their own). A fault is
injected by signalling one process group, by PID checked against its start time.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import redis

from everstep.processes import (
    ManagedProcess,
    free_port,
    is_alive,
    kill_processes,
    spawn,
    stop_processes,
    wait_grpc_serving,
)
from everstep_cli.local_stack import redis_server_binary
from everstep_controller.launchers.base import Workers
from everstep_controller.launchers.local import LocalLauncher

TERMINAL = ("SUCCEEDED", "FAILED", "CANCELLED")


# -- Redis ------------------------------------------------------------------------------------------


@dataclass
class RedisServer:
    """redis-server on a fixed port and data directory, so that a restarted one replays the same AOF."""

    data_dir: Path
    port: int = field(default_factory=free_port)
    process: ManagedProcess | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        self.process = spawn("redis", ["--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.data_dir),
                                       "--appendonly", "yes", "--appendfsync", "always", "--save", ""],
                             self.data_dir / "redis.log", executable=redis_server_binary())
        deadline = time.monotonic() + 20
        while True:
            try:
                redis.Redis.from_url(self.url).ping()
                return self
            except redis.exceptions.BusyLoadingError:
                pass
            except redis.ConnectionError:
                assert is_alive(self.process), Path(self.process.log_path).read_text()[-2000:]
            assert time.monotonic() < deadline, "redis did not start"
            time.sleep(0.05)

    def kill(self) -> None:
        kill_processes([self.process])

    def stop(self) -> None:
        stop_processes([self.process])


# -- services ---------------------------------------------------------------------------------------


@dataclass
class Service:
    """A service process on fixed ports: killed or hung, it is started again on the same ports."""

    name: str
    args: list[str]
    log_dir: Path
    http_port: int = field(default_factory=free_port)
    grpc_port: int = field(default_factory=free_port)
    process: ManagedProcess | None = None
    starts: int = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def start(self) -> Service:
        self.starts += 1
        self.process = spawn(self.name, ["-m", f"everstep_{self.name}", "--host", "127.0.0.1",
                                         "--port", str(self.http_port), "--grpc-port", str(self.grpc_port), *self.args],
                             self.log_dir / f"{self.name}-{self.starts}.log", http_port=self.http_port,
                             grpc_port=self.grpc_port)
        wait_grpc_serving(self.process, 120)
        return self

    def metrics(self) -> str:
        return httpx.get(f"http://127.0.0.1:{self.http_port}/metrics", timeout=10).text


# -- controllers ------------------------------------------------------------------------------------


@dataclass
class Controllers:
    """Controller processes (local launcher) on one REST port, so that a restarted one is found at the same URL."""

    redis_url: str
    reward_address: str
    work_dir: Path
    port: int = field(default_factory=free_port)
    started: list[ManagedProcess] = field(default_factory=list)

    @property
    def api(self) -> httpx.Client:
        return httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=60)

    def start(self, *extra_args: str, env: dict[str, str] | None = None) -> ManagedProcess:
        process = spawn("controller", [
            "-m", "everstep_controller", "--port", str(self.port), "--redis-url", self.redis_url,
            "--reward", self.reward_address, "--launcher", "local", "--threads-per-worker", "1",
            "--data-dir", str(self.work_dir / "data"), *extra_args,
        ], self.work_dir / f"controller-{len(self.started)}.log", http_port=self.port, env=env)
        self.started.append(process)
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/healthz", timeout=1).status_code == 200:
                    return process
            except httpx.HTTPError:
                pass
            assert is_alive(process) and time.monotonic() < deadline, self.log(process)
            time.sleep(0.1)

    def log(self, process: ManagedProcess | None = None) -> str:
        process = process or self.started[-1]
        return Path(process.log_path).read_text(errors="replace")[-4000:]

    def close(self) -> None:
        stop_processes(self.started, grace_seconds=30)
        try:  # workers a killed controller left behind
            client = redis.Redis.from_url(self.redis_url)
            for key in client.scan_iter("everstep:job:*:workers"):
                LocalLauncher(work_dir=self.work_dir).stop(Workers.model_validate_json(client.get(key)))
        except redis.ConnectionError:
            pass


@dataclass
class SampleLoggedStack:
    """A started controller whose jobs' trainers each log the steps they applied to `logs`/<pid>.jsonl
    (EVERSTEP_TRAINER_SAMPLE_LOG), with its REST client, its Redis and a file of training rows."""

    api: httpx.Client
    client: redis.Redis
    logs: Path
    train: Path

    def logged_pids(self) -> set[int]:
        """The trainers that wrote a sample log so far."""
        return {int(path.stem) for path in self.logs.glob("*.jsonl")}

    def trainer_log(self, pid: int) -> list[dict]:
        """The steps trainer `pid` applied, one line each, in order."""
        return sample_log_lines(self.logs / f"{pid}.jsonl")


StartStack = Callable[..., SampleLoggedStack]
"""The `start_sample_logged_stack` fixture: `(*controller_args, num_rows=N) -> SampleLoggedStack`."""


# -- jobs -------------------------------------------------------------------------------------------


def arithmetic_rows(num_rows: int) -> list[dict[str, str]]:
    return [{"prompt": f"{a} + {b} =", "answer": str(a + b)} for a, b in
            ((1 + i % 7, 1 + i // 7) for i in range(num_rows))]


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def tiny_job(name: str, model: Path, train: Path, *, steps: int, **extra: object) -> dict:
    """A synchronous job small enough for a fault test whose rewards differ inside a group.

    A random tiny model never solves the arithmetic; the length verifier (DAPO's overlong penalty,
    here -L/8 for L output tokens) gives it a reward that varies with the response's length, and
    the stop string "1" (in 13 of the 51 words) makes lengths vary from 1 to 8 tokens.
    """
    return {
        "name": name, "model_path": str(model), "dataset": {"train_path": str(train)}, "steps": steps, "seed": 3,
        "algorithm": {"group_size": 4, "drop_zero_signal_groups": False},
        "sampling": {"max_new_tokens": 8, "stop": ["1"]},
        "scheduler": {"mode": "sync", "prompts_per_iteration": 2},
        "reward": {"verifiers": [{"name": "length", "params": {"max_length": 8, "cache_length": 8}}]},
        "trainer": {"learning_rate": 1e-3},
        **extra,
    }


def wait_job(api: httpx.Client, job_id: str, done: Callable[[dict], bool], timeout_seconds: float = 240) -> dict:
    """Polls the job until `done`; fails at once if it ended otherwise."""
    deadline = time.monotonic() + timeout_seconds
    while not done(job := api.get(f"/v1/jobs/{job_id}").json()):
        assert job["state"] not in TERMINAL, f"job {job_id} ended {job['state']}: {job['error']}"
        assert time.monotonic() < deadline, f"job {job_id} still {job['state']} at step {job['step']}"
        time.sleep(0.05)
    return job


def wait_until(condition: Callable[[], object], what: str, timeout_seconds: float = 240) -> None:
    deadline = time.monotonic() + timeout_seconds
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not after {timeout_seconds:.0f}s"
        time.sleep(0.02)


def job_workers(client: redis.Redis, job_id: str) -> dict[str, ManagedProcess]:
    """The job's rollout and trainer processes, as the launcher recorded them in Redis."""
    workers = Workers.model_validate_json(client.get(f"everstep:job:{job_id}:workers"))
    return {p.name: ManagedProcess(**p.model_dump()) for p in workers.processes}


def freeze_while(process: ManagedProcess, wanted: Callable[[], bool], attempts: int = 400,
                 settle_seconds: float = 0.0) -> None:
    """Stops `process` (SIGSTOP) at a moment `wanted()` holds, and leaves it stopped; the caller injects
    its fault and then resumes it with `thaw`. Lets a test hit a window of a few milliseconds.
    `settle_seconds`: how long the other processes go on before `wanted()` is asked (they finish what
    the stopped one had already sent them).

    Between tries the process runs for a varied time (5 to 200 ms), and is stopped at once if `wanted()`
    holds while it runs: a fixed slice can lock onto the process's own rhythm (on a loaded machine a
    stopped engine given 20 ms at a time emitted its results only in whole-step bursts, and the window
    never came)."""
    slices = random.Random(process.pid)
    for attempt in range(attempts):
        deadline = time.monotonic() + slices.uniform(0.005, 0.2)
        while time.monotonic() < deadline and not wanted():
            time.sleep(0.002)
        try:
            os.kill(process.pid, signal.SIGSTOP)
        except ProcessLookupError:
            pytest.fail(f"{process.name} (pid {process.pid}) exited before the wanted moment came, after {attempt} "
                        "tries: its job ended? (give it more steps)")
        time.sleep(settle_seconds)
        if wanted():
            return
        os.kill(process.pid, signal.SIGCONT)
    pytest.fail(f"{process.name}: the wanted moment never came")


def thaw(process: ManagedProcess) -> None:
    os.kill(process.pid, signal.SIGCONT)


def metric_value(text: str, name: str, **labels: str) -> float:
    """The sum of a metric's samples in Prometheus text that carry all of `labels` (0 when none)."""
    total = 0.0
    for line in text.splitlines():
        named = line.startswith(name + " ") or line.startswith(name + "{")
        if named and all(f'{key}="{value}"' in line for key, value in labels.items()):
            total += float(line.split()[-1])
    return total


def sample_log_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]
