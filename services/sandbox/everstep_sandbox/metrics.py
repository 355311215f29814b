"""Prometheus metrics of the sandbox (default registry, or multiprocess mode with worker processes)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from prometheus_client import Counter, Gauge, Histogram

REQUESTS = Counter("everstep_sandbox_requests_total", "Requests (run_code and run_tests) by outcome.",
                   ["language", "status"])
RUN_SECONDS = Histogram("everstep_sandbox_run_seconds", "Wall time of one request, queue and compile included.",
                        ["language"], buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))
INFLIGHT = Gauge("everstep_sandbox_inflight_requests", "Requests being handled (queued or running).",
                 multiprocess_mode="livesum")
QUEUE_DEPTH = Gauge("everstep_sandbox_queue_depth", "Requests waiting for a free sandbox slot.",
                    multiprocess_mode="livesum")
COMPILE_CACHE = Counter("everstep_sandbox_compile_cache_total", "Compile cache lookups by result (hit, miss).",
                        ["language", "result"])
SLOTS = Gauge("everstep_sandbox_slots", "Sandbox slots started (the base workers and elastic ones).",
              multiprocess_mode="livesum")
ABANDONED = Counter("everstep_sandbox_abandoned_requests_total",
                    "Requests whose client went away: dropped from the queue or their run killed.", ["stage"])
BUSY_REJECTIONS = Counter("everstep_sandbox_busy_rejections_total",
                          "Requests answered SandboxError because every slot stayed busy.")
SLOT_RESTARTS = Counter("everstep_sandbox_slot_restarts_total", "Sandbox slots replaced after a failure.")
ISOLATION = Gauge("everstep_sandbox_isolation_info",
                  "Always 1: the isolation every run gets here, as labels (seccomp is 'false' only when started "
                  "with --allow-no-seccomp where no filter could be installed).",
                  ["seccomp", "bubblewrap", "distinct_uid", "cgroups"], multiprocess_mode="max")


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
