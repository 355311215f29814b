"""Jobs through a running controller's REST API, as the end-to-end tests submit and follow them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from everstep_cli.local_stack import free_port

ENDED = ("SUCCEEDED", "FAILED", "CANCELLED")
EVERSTEP = str(Path(sys.executable).parent / "everstep")


def run_job(api: httpx.Client, spec: dict[str, Any], *, timeout_seconds: float,
            poll_seconds: float = 1.0) -> dict[str, Any]:
    """POSTs `spec` (201 expected) and returns the job record once the job ended; fails the test past the timeout."""
    created = api.post("/v1/jobs", json=spec)
    assert created.status_code == 201, created.text
    job_id = created.json()["id"]
    deadline = time.monotonic() + timeout_seconds
    while (job := api.get(f"/v1/jobs/{job_id}").json())["state"] not in ENDED:
        assert time.monotonic() < deadline, f"job still {job['state']} at step {job['step']}"
        time.sleep(poll_seconds)
    return job


@dataclass(frozen=True)
class UpStack:
    """A stack `everstep up` started under its own EVERSTEP_HOME (its processes in `state`, from state.json)."""

    url: str
    env: dict[str, str]
    state: dict[str, Any]
    state_file: Path

    def address(self, name: str) -> str:
        """host:port of the gRPC service `name` (rollout, trainer, reward, sandbox)."""
        return next(f"127.0.0.1:{p['grpc_port']}" for p in self.state["processes"] if p["name"] == name)

    def everstep(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        """The `everstep` CLI against this stack's home."""
        return subprocess.run([EVERSTEP, *args], env=self.env, capture_output=True, text=True, timeout=timeout)


@contextmanager
def everstep_up(home: Path, **extra_env: str) -> Iterator[UpStack]:
    """`everstep up` on a free port with EVERSTEP_HOME=home (and `extra_env`), then `everstep down` on the way out,
    whether the body passed or not; a failing `down` fails the test when the body passed."""
    env = {**os.environ, "EVERSTEP_HOME": str(home), **extra_env}
    env.pop("REDIS_URL", None)
    port = free_port()
    up = subprocess.run([EVERSTEP, "up", "--port", str(port)], env=env, capture_output=True, text=True, timeout=300)
    assert up.returncode == 0, up.stderr
    state_file = home / "stack" / "state.json"
    stack = UpStack(url=f"http://127.0.0.1:{port}", env=env, state=json.loads(state_file.read_text()),
                    state_file=state_file)
    try:
        yield stack
    finally:
        down = stack.everstep("down", timeout=120)
    assert down.returncode == 0, down.stderr
