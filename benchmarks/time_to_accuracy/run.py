"""Running the arms of `benchmarks.time_to_accuracy`: one after another, or (``--concurrent``) the everstep
arms beside the TRL arms; each finished arm-run goes to DIR/runs.jsonl at once (`RunLog`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.time_to_accuracy.config import REPO, Arm, ArmRun, TtaConfig, job_spec

RUNS_FILE = "runs.jsonl"


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class RunLog:
    """DIR/runs.jsonl: a first line ``{"config": ...}``, then one line ``{"run": ...}`` per finished arm-run,
    written (and flushed to disk) as soon as the run finishes, so a benchmark cut off keeps what finished.
    A runs.jsonl left by an earlier benchmark is renamed to runs-<its modification time>.jsonl, not overwritten."""

    def __init__(self, path: Path, config: TtaConfig) -> None:
        self.path = path
        self._lock = threading.Lock()
        if path.exists() and path.stat().st_size:
            kept = path.with_name(f"runs-{time.strftime('%Y%m%dT%H%M%S', time.localtime(path.stat().st_mtime))}.jsonl")
            path.rename(kept)
            _log(f"an earlier {path.name} was kept as {kept}")
        self._write({"config": config.to_json(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")})

    def _write(self, entry: dict[str, Any]) -> None:
        with self._lock, self.path.open("a") as f:
            f.write(json.dumps(entry) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def append(self, run: ArmRun) -> None:
        self._write({"run": run.to_json(), "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z")})


def read_runs(path: Path) -> tuple[TtaConfig, list[ArmRun]]:
    """The config and the finished runs of a runs.jsonl written by `RunLog` (a cut-off last line is skipped)."""
    config: TtaConfig | None = None
    runs: list[ArmRun] = []
    lines = path.read_text().splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):  # the benchmark was killed while writing it
                _log(f"{path}: line {number} is cut off; left out")
                continue
            raise ValueError(f"{path}: line {number} is not JSON") from None
        if "config" in entry:
            config = TtaConfig.from_json(entry["config"])
        elif "run" in entry:
            runs.append(ArmRun.from_json(entry["run"]))
    if config is None:
        raise ValueError(f"{path}: no config line; not a runs.jsonl of benchmarks.time_to_accuracy")
    return config, runs


def run_trl(config: TtaConfig, arm: Arm, root: Path, reward_address: str, tag: str) -> ArmRun:
    """One run of a TRL arm in its own process (`benchmarks.time_to_accuracy.trl_arm`), with its counterpart's job
    spec."""
    config_file, spec_file, out = (root / f"{tag}-config.json", root / f"{tag}-spec.json", root / f"{tag}-result.json")
    config_file.write_text(json.dumps(config.to_json()))
    spec_file.write_text(json.dumps(job_spec(config, arm, root / "checkpoints")))
    out.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": str(config.threads_per_worker)}
    command = [sys.executable, "-m", "benchmarks.time_to_accuracy.trl_arm", "--arm", arm.value,
               "--config", str(config_file), "--spec", str(spec_file), "--reward", reward_address, "--out", str(out)]
    process = subprocess.run(command, cwd=REPO, env=env)
    if process.returncode != 0:
        raise RuntimeError(f"the {arm.value} arm failed (exit {process.returncode}); its output is above. Is TRL "
                           "installed? pip install -r benchmarks/requirements-trl.txt")
    return ArmRun.from_json(json.loads(out.read_text()))


def run_arms(config: TtaConfig, root: Path, record: Callable[[ArmRun], None]) -> list[ArmRun]:
    """Every arm, ``config.repeats`` times; ``record`` gets each run as it finishes."""
    from benchmarks.time_to_accuracy.everstep_arm import run_everstep_arm, start_stack

    runs: list[ArmRun] = []

    def one(repeat: int, arm: Arm) -> None:
        _log(f"run {repeat + 1}/{config.repeats}: {arm.value}")
        tag = f"{arm.value}-{repeat}"
        run = (run_trl(config, arm, root, state.address("reward"), tag) if arm.is_trl
               else run_everstep_arm(state, config, arm, root))
        runs.append(run)
        record(run)

    _log("starting the local stack")  # the TRL arms use its reward service
    stack, state = start_stack(root, config)
    try:
        if config.concurrent:
            _side_by_side(config, one)
        else:
            for repeat in range(config.repeats):
                for arm in config.arms:
                    one(repeat, arm)
    finally:
        stack.down()
    return runs


def _side_by_side(config: TtaConfig, one: Callable[[int, Arm], None]) -> None:
    """The everstep arms in one thread and the TRL arms in another, each side in ``config.arms`` order; a failure
    on one side lets the other finish, then is raised."""
    sides = [[a for a in config.arms if not a.is_trl], [a for a in config.arms if a.is_trl]]
    errors: list[BaseException] = []

    def side(arms: list[Arm]) -> None:
        try:
            for repeat in range(config.repeats):
                for arm in arms:
                    one(repeat, arm)
        except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
            errors.append(e)

    threads = [threading.Thread(target=side, args=(arms,), daemon=True) for arms in sides if arms]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
