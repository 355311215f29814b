"""benchmarks.weight_push at a few MB: real trainer and rollout processes, every transport named, JSON last."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "benchmarks.weight_push", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_a_small_run_reports_every_transport_and_the_ratio_to_memcpy() -> None:
    process = _run("--mb", "4", "--repeats", "2", "--transport", "auto,grpc")
    assert process.returncode == 0, process.stderr[-4000:]
    lines = process.stdout.strip().splitlines()
    report = json.loads(lines[-1])
    assert report["default_transport"] == "shm"  # auto on one host
    assert set(report["transports"]) == {"shm", "grpc"}
    assert 3e6 < report["num_bytes"] < 5e6 and report["repeats"] == 2
    for value in (report["gb_per_s"], report["memcpy_gb_per_s"], report["ratio_to_memcpy"]):
        assert isinstance(value, float) and math.isfinite(value) and value > 0
    assert report["gb_per_s"] == report["transports"]["shm"]["gb_per_s"]
    assert report["ratio_to_memcpy"] == pytest.approx(report["gb_per_s"] / report["memcpy_gb_per_s"], rel=0.01)
    assert report["memcpy_gb_per_s"] == max(report["memcpy_gb_per_s_by_threads"].values())
    # One human-readable line per transport before the JSON.
    assert any("auto -> shm" in line for line in lines) and any("grpc -> grpc" in line for line in lines)


def test_bad_flags_are_refused_before_anything_starts() -> None:
    process = _run("--transport", "carrier-pigeon", timeout=60)
    assert process.returncode == 2 and "--transport" in process.stderr
    process = _run("--repeats", "0", timeout=60)
    assert process.returncode == 2 and "--repeats" in process.stderr


@pytest.mark.slow
def test_lora_rank_times_adapter_pushes_beside_the_full_one() -> None:
    process = _run("--mb", "4", "--repeats", "2", "--transport", "auto", "--lora-rank", "4")
    assert process.returncode == 0, process.stderr[-4000:]
    report = json.loads(process.stdout.strip().splitlines()[-1])
    assert report["full_bytes"] == report["num_bytes"] and report["adapter_transport"] == "shm"
    # rank 4 on a 256-wide model: 4 * (in + out) per module against in * out, about 30x fewer bytes
    assert 10 < report["full_bytes"] / report["adapter_bytes"] < 100
    for key in ("adapter_seconds", "full_seconds", "ratio_to_memcpy", "merge_seconds",
                "lowrank_decode_step_overhead_seconds"):
        assert isinstance(report[key], float) and math.isfinite(report[key]) and report[key] > 0, key
    assert report["num_adapted_modules"] % 7 == 0 and report["num_adapted_modules"] > 0  # q k v o gate up down
