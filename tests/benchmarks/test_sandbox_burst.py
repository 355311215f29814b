"""benchmarks.sandbox_burst, small: every client of a burst larger than the base slots is answered in
time (elastic slots), abandoned requests are dropped, and the figures come as JSON on the last line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_a_small_burst_is_answered_in_time_and_abandoned_requests_are_dropped() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    process = subprocess.run([sys.executable, "-m", "benchmarks.sandbox_burst", "--requests", "12",
                              "--run-timeout", "2", "--abandoned", "4", "--workers", "1", "--max-slots", "12"],
                             cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert process.returncode == 0, process.stderr[-4000:]
    report = json.loads(process.stdout.strip().splitlines()[-1])
    assert report["burst_answered_in_time"] == report["burst_requests"] == 12, report
    assert report["burst_statuses"] == {"Failed/TimeLimitExceeded": 12}, report
    # 12 runs of 2 s on one base slot would take 24 s in a queue; elastic slots run them at once.
    assert 2 <= report["burst_p50_seconds"] <= report["burst_p99_seconds"] < 2 + 20, report
    assert report["burst_max_seconds"] < 12, report
    assert report["abandoned_dropped"] == report["abandoned_sent"] == 4, report
    assert report["abandoned_drain_seconds"] < 1.0, report
    assert "answered within run_timeout + 20 s" in process.stderr
