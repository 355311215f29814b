"""The local launcher's close stops every worker it started, also those of a job whose start was still under way
when the controller began to stop (its job thread, left behind, would otherwise finish the start afterwards and leave
two processes running after `everstep down`)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from everstep.processes import start_ticks
from everstep_controller.launchers.base import WorkerRequest
from everstep_controller.launchers.local import LocalLauncher


@pytest.fixture
def never_ready(tmp_path: Path) -> str:
    """An executable that starts a real process which never serves gRPC: a worker stuck in its start-up."""
    script = tmp_path / "never-ready"
    script.write_text("#!/bin/sh\nexec sleep 600\n")
    script.chmod(0o755)
    return str(script)


def _spawned_pids(work_dir: Path, launcher: LocalLauncher, count: int, timeout_seconds: float = 30) -> list[int]:
    deadline = time.monotonic() + timeout_seconds
    while time.monotonic() < deadline:
        with launcher._lock:
            pids = list(launcher._started)
        if len(pids) == count:
            return pids
        time.sleep(0.05)
    raise TimeoutError(f"the launcher did not start {count} workers in {timeout_seconds} s under {work_dir}")


def test_close_stops_the_workers_of_a_start_under_way_and_refuses_new_ones(tmp_path: Path, never_ready: str) -> None:
    launcher = LocalLauncher(work_dir=tmp_path / "workers", ready_timeout_seconds=300, python=never_ready)
    request = WorkerRequest(job_id="job-1", max_running=4, max_seq_len=64)
    errors: list[BaseException] = []

    def start() -> None:
        try:
            launcher.launch(request)
        except BaseException as error:  # noqa: BLE001 (the test reads it)
            errors.append(error)

    thread = threading.Thread(target=start, daemon=True)
    thread.start()
    pids = _spawned_pids(tmp_path, launcher, 2)  # rollout and trainer spawned, waiting to serve
    assert all(start_ticks(pid) is not None for pid in pids)

    launcher.close()
    assert all(start_ticks(pid) is None for pid in pids)  # both stopped by close, not left to the job thread
    thread.join(timeout=30)
    assert not thread.is_alive() and len(errors) == 1 and "exited during start-up" in str(errors[0])

    with pytest.raises(RuntimeError, match="launcher is closed"):
        launcher.launch(WorkerRequest(job_id="job-2", max_running=4, max_seq_len=64))
    assert not (tmp_path / "workers" / "job-2").exists()  # nothing was spawned for it
