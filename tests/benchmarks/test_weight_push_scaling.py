"""benchmarks.weight_push_scaling --quick: a real trainer pushing to 1, 2 and 4 real engines, JSON last."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "benchmarks.weight_push_scaling", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_quick_run_times_every_transport_at_every_engine_count() -> None:
    process = _run("--quick")
    assert process.returncode == 0, process.stderr[-4000:]
    report = json.loads(process.stdout.strip().splitlines()[-1])
    assert report["engine_counts"] == [1, 2, 4] and report["transports"] == ["shm", "grpc"]
    assert report["repeats"] == 2 and 3e6 < report["num_bytes"] < 5e6
    for transport in ("shm", "grpc"):
        assert set(report["seconds"][transport]) == {"1", "2", "4"}
        assert all(value > 0 for value in report["seconds"][transport].values())
        assert report["ratio_to_one"][transport]["1"] == 1.0
        assert report["ratio_4_to_1"][transport] == report["ratio_to_one"][transport]["4"]
        assert report["goal_met"][transport] == (report["ratio_4_to_1"][transport] <= report["goal_ratio"] == 1.3)
    pushes = report["pushes"]
    assert len(pushes) == 2 * 2 * 3  # timed cycles x transports x engine counts; the warm-up is not reported
    for push in pushes:  # every engine got every byte; with shm every engine runs on the one segment
        assert push["num_bytes"] == report["num_bytes"] * push["num_engines"]
        assert push["num_kept_in_place"] == (push["num_engines"] if push["transport"] == "shm" else 0)
    assert [(p["transport"], p["num_engines"]) for p in pushes[:6]] == [
        ("shm", 1), ("shm", 2), ("shm", 4), ("grpc", 1), ("grpc", 2), ("grpc", 4)], "each cycle alternates"


@pytest.mark.parametrize("flags", [["--engines", "2,4"], ["--transport", "gloo"], ["--repeats", "0"],
                                   ["--engines", "one"]])
def test_bad_flags_are_refused_before_anything_starts(flags: list[str]) -> None:
    process = _run(*flags, timeout=120)
    assert process.returncode == 2 and "error" in process.stderr
