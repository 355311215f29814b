"""Prometheus metrics of the sandbox (default registry, served at /metrics)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from prometheus_client import Counter, Gauge, Histogram

REQUESTS = Counter("everstep_sandbox_requests_total", "Requests (run_code and run_tests) by outcome.",
                   ["language", "status"])
RUN_SECONDS = Histogram("everstep_sandbox_run_seconds", "Wall time of one request, compile included.",
                        ["language"], buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))
INFLIGHT = Gauge("everstep_sandbox_inflight_requests", "Requests being handled (queued or running).")
QUEUE_DEPTH = Gauge("everstep_sandbox_queue_depth", "Commands waiting for a free execution slot.")


@dataclass
class RequestOutcome:
    status: str = "SandboxError"
    """Label recorded when the request ends: Success, Failed, SandboxError or invalid."""


@contextmanager
def track_request(language: str) -> Iterator[RequestOutcome]:
    outcome = RequestOutcome()
    INFLIGHT.inc()
    start = time.monotonic()
    try:
        yield outcome
    finally:
        INFLIGHT.dec()
        RUN_SECONDS.labels(language).observe(time.monotonic() - start)
        REQUESTS.labels(language, outcome.status).inc()
