"""Jobs through a running controller's REST API, as the end-to-end tests submit and follow them."""

from __future__ import annotations

import time
from typing import Any

import httpx

ENDED = ("SUCCEEDED", "FAILED", "CANCELLED")


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
