"""The math worker pool on its own: pipelined calls, timeouts that measure work, workers in their own
sessions that die with their parent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from misbehaving_checks import process_ids, sleep_then_return

from everstep_reward.worker_pool import ProcessWorkerPool, WorkerTimeout


def test_queued_calls_get_their_whole_timeout_and_results_keep_their_order() -> None:
    pool = ProcessWorkerPool(1, depth=4)
    pool.start()
    try:
        with ThreadPoolExecutor(6) as threads:
            # One worker runs them one after another: the last waits ~1.5 s, more than its 1 s limit,
            # but its limit starts when the worker starts on it.
            futures = [threads.submit(pool.call, sleep_then_return, 0.3, i, timeout_seconds=1.0) for i in range(6)]
            assert [f.result() for f in futures] == list(range(6))
    finally:
        pool.close()


def test_a_timeout_replaces_only_its_worker_and_requeues_the_calls_behind_it() -> None:
    pool = ProcessWorkerPool(2, depth=3)
    pool.start()
    try:
        with ThreadPoolExecutor(8) as threads:
            hung = threads.submit(pool.call, sleep_then_return, 60, -1, timeout_seconds=0.5)
            time.sleep(0.1)  # the hung call is running before the others queue behind it
            others = [threads.submit(pool.call, sleep_then_return, 0.05, i, timeout_seconds=5) for i in range(7)]
            with pytest.raises(WorkerTimeout):
                hung.result()
            assert [f.result() for f in others] == list(range(7))
        assert len(pool.worker_pids()) == 2 or pool.call(sleep_then_return, 0, 7, timeout_seconds=30) == 7
    finally:
        pool.close()
    assert pool.worker_pids() == []
    with pytest.raises(RuntimeError, match="closed"):
        pool.call(sleep_then_return, 0, 0, timeout_seconds=1)


def test_workers_have_their_own_sessions() -> None:
    pool = ProcessWorkerPool(2)
    pool.start()
    try:
        with ThreadPoolExecutor(4) as threads:
            ids = set(threads.map(lambda _: pool.call(process_ids, timeout_seconds=10), range(8)))
    finally:
        pool.close()
    assert all(pid == sid for pid, sid in ids)  # each worker leads its own session
    assert os.getsid(0) not in {sid for _, sid in ids}


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_workers_exit_when_their_parent_is_killed(tmp_path: Path) -> None:
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from everstep_reward.worker_pool import ProcessWorkerPool
        if __name__ == "__main__":
            pool = ProcessWorkerPool(2)
            pool.start()
            print(*pool.worker_pids(), flush=True)
            time.sleep(600)
    """))
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        worker_pids = [int(pid) for pid in parent.stdout.readline().split()]
        assert len(worker_pids) == 2 and not any(_gone(pid) for pid in worker_pids)
    finally:
        os.kill(parent.pid, signal.SIGKILL)  # no clean-up runs: the workers must notice by themselves
        parent.wait(timeout=10)
        parent.stdout.close()
    deadline = time.monotonic() + 10
    while not all(_gone(pid) for pid in worker_pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(_gone(pid) for pid in worker_pids)
