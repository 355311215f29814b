"""The service's lifecycle against real processes: it owns its ports, drops abandoned requests,
stops promptly on SIGTERM, and its zygotes and runs die with it on SIGKILL. Each test stops only
the processes it started (by pid or process group)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import pytest
from sandbox_procs import alive, descendants, open_request, run_processes, wait_until

from everstep.v1 import sandbox_pb2, sandbox_pb2_grpc
from everstep_sandbox.config import SandboxConfig
from everstep_sandbox.process import RunStatus
from everstep_sandbox.runner import ProgramSpec, SandboxRunner

SPIN = {"code": "while True:\n    pass", "language": "python"}


def _metric(client: httpx.Client, name: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.split()[-1])
    return 0.0


def test_a_second_server_on_a_taken_port_is_refused(service_process, tmp_path) -> None:
    first = service_process("sandbox", "--workers", "1")
    everstep = str(Path(sys.executable).parent / "everstep")
    for command in ([everstep, "serve", "sandbox", "--port", str(first.http_port), "--grpc-port", "0"],
                    [sys.executable, "-m", "everstep_sandbox", "--port", "0", "--grpc-port", str(first.grpc_port)]):
        second = subprocess.run([*command, "--host", "127.0.0.1"], capture_output=True, text=True, timeout=60,
                                start_new_session=True)
        assert second.returncode == 2, second.stderr
        assert "already in use" in second.stderr and "another sandbox" in second.stderr, second.stderr
    with httpx.Client(base_url=first.http_url, timeout=30) as client:  # the first is unaffected
        assert client.post("/run_code", json={"code": "print(1)", "language": "python"}).json()["status"] == "Success"


def test_a_disconnected_clients_run_is_killed_within_a_second(service_process) -> None:
    sandbox = service_process("sandbox", "--workers", "1")
    with httpx.Client(base_url=sandbox.http_url, timeout=30) as client:
        pid = sandbox.process.pid
        connection = open_request(sandbox.http_port, {**SPIN, "run_timeout": 60})
        wait_until(lambda: run_processes(pid), 20)
        connection.close()
        seconds = wait_until(lambda: not run_processes(pid), 5)
        assert seconds < 1.0, f"the abandoned run went on for {seconds:.2f} s"
        wait_until(lambda: _metric(client, "everstep_sandbox_abandoned_requests_total") >= 1, 5)
        body = client.post("/run_code", json={"code": "print(2)", "language": "python"}).json()
        assert body["status"] == "Success", body  # the slot was reset and serves the next request


def test_a_disconnected_clients_queued_request_is_dropped(service_process) -> None:
    sandbox = service_process("sandbox", "--workers", "1", "--max-slots", "1")
    with httpx.Client(base_url=sandbox.http_url, timeout=60) as client, \
            concurrent.futures.ThreadPoolExecutor(1) as pool:
        holder = pool.submit(client.post, "/run_code", json={"code": "import time; time.sleep(3); print('held')",
                                                             "language": "python"})
        wait_until(lambda: run_processes(sandbox.process.pid), 20)
        queued = open_request(sandbox.http_port, {**SPIN, "run_timeout": 60})
        wait_until(lambda: _metric(client, "everstep_sandbox_queue_depth") == 1, 5)
        queued.close()
        seconds = wait_until(lambda: _metric(client, "everstep_sandbox_queue_depth") == 0, 5)
        assert seconds < 1.0, f"the abandoned request stayed queued {seconds:.2f} s"
        assert _metric(client, 'everstep_sandbox_abandoned_requests_total{stage="queued"}') == 1
        assert holder.result().json()["run_result"]["stdout"] == "held\n"
        # The dropped program never ran: the next request gets the slot at once.
        start = time.monotonic()
        assert client.post("/run_code", json={"code": "print(3)", "language": "python"}).json()["status"] == "Success"
        assert time.monotonic() - start < 5


def test_sigterm_ends_a_busy_server_within_ten_seconds(service_process) -> None:
    sandbox = service_process("sandbox", "--workers", "1", "--max-slots", "3")
    with httpx.Client(base_url=sandbox.http_url, timeout=90) as client, \
            concurrent.futures.ThreadPoolExecutor(6) as pool:
        replies = [pool.submit(client.post, "/run_code", json={**SPIN, "run_timeout": 60}) for _ in range(6)]
        wait_until(lambda: len(run_processes(sandbox.process.pid)) >= 3, 30)  # 3 running, 3 queued
        runs = set(run_processes(sandbox.process.pid))
        start = time.monotonic()
        sandbox.process.send_signal(signal.SIGTERM)
        sandbox.process.wait(timeout=10)
        assert time.monotonic() - start < 10
        assert sandbox.process.returncode == 0, sandbox.log()
        statuses = []
        for reply in replies:
            try:
                statuses.append(reply.result().json()["status"])
            except httpx.HTTPError:
                statuses.append("disconnected")
        assert statuses == ["SandboxError"] * 6, statuses  # queued ones at once, running ones killed
    assert not alive(runs)


def test_zygotes_and_runs_die_with_a_sigkilled_server(service_process) -> None:
    sandbox = service_process("sandbox", "--workers", "2")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(_post_quietly, sandbox.http_url, {**SPIN, "run_timeout": 60})
        wait_until(lambda: run_processes(sandbox.process.pid), 20)
        below = descendants(sandbox.process.pid)
        assert len(below) >= 4, below  # two slots: bubblewrap (or the zygote itself) and what it runs
        os.kill(sandbox.process.pid, signal.SIGKILL)  # the server alone, not its process group
        sandbox.process.wait(timeout=10)
        seconds = wait_until(lambda: not alive(below), 10)
    assert seconds < 5, seconds


def _post_quietly(url: str, body: dict) -> None:
    with contextlib.suppress(httpx.HTTPError):  # the server is killed under it
        httpx.post(url + "/run_code", json=body, timeout=90)


@pytest.mark.parametrize("language", ["python"])
def test_elastic_slots_run_a_burst_at_once(service_process, language: str) -> None:
    sandbox = service_process("sandbox", "--workers", "1", "--max-slots", "6")
    with httpx.Client(base_url=sandbox.http_url, timeout=60) as client, \
            concurrent.futures.ThreadPoolExecutor(6) as pool:
        start = time.monotonic()
        bodies = list(pool.map(lambda _: client.post("/run_code", json={**SPIN, "language": language,
                                                                        "run_timeout": 2}).json(), range(6)))
        elapsed = time.monotonic() - start
        assert all(b["run_result"]["status"] == "TimeLimitExceeded" for b in bodies), bodies
        assert elapsed < 2 * 2, f"6 requests on 1 worker and 5 elastic slots took {elapsed:.1f} s"
        assert _metric(client, "everstep_sandbox_slots") == 6


def test_idle_elastic_slots_are_stopped_and_the_base_ones_stay() -> None:
    runner = SandboxRunner.start(SandboxConfig(workers=1, max_slots=3, elastic_idle_seconds=0.5))
    try:
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            spec = ProgramSpec(code="import time; time.sleep(1); print('ok')", language="python")
            results = list(pool.map(lambda _: runner.run_code(spec), range(3)))
        assert [r.run_result.stdout for r in results] == ["ok\n"] * 3, results
        assert len(runner.pool.slots) == 3
        wait_until(lambda: len(runner.pool.slots) == 1, 10)
        assert runner.run_code(spec).run_result.stdout == "ok\n"  # the base slot still serves
    finally:
        runner.close()


def test_a_request_that_finds_every_slot_busy_is_answered_busy_in_bounded_time() -> None:
    runner = SandboxRunner.start(SandboxConfig(workers=1, max_slots=1, max_queue_wait_seconds=0.5))
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            holder = pool.submit(runner.run_code, ProgramSpec(code="import time; time.sleep(3)", language="python"))
            wait_until(lambda: run_processes(os.getpid()), 20)
            start = time.monotonic()
            busy = runner.run_code(ProgramSpec(code="print(1)", language="python"))
            assert time.monotonic() - start < 2
            assert busy.status == RunStatus.SANDBOX_ERROR and busy.message.startswith("sandbox busy"), busy
            assert holder.result().status == RunStatus.SUCCESS
    finally:
        runner.close()


def test_a_grpc_call_that_ends_early_has_its_run_killed(service_process) -> None:
    sandbox = service_process("sandbox", "--workers", "1")
    pid = sandbox.process.pid
    with grpc.insecure_channel(sandbox.grpc_address) as channel:
        stub = sandbox_pb2_grpc.SandboxStub(channel)
        call = stub.RunCode.future(sandbox_pb2.RunCodeRequest(code=SPIN["code"], language="python",
                                                              run_timeout=60), timeout=2)
        wait_until(lambda: run_processes(pid), 10)  # running when the client's deadline ends the call
        with pytest.raises(grpc.RpcError) as raised:
            call.result()
        assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        ended = time.monotonic()
        wait_until(lambda: not run_processes(pid), 5)
        assert time.monotonic() - ended < 1.0
        reply = stub.RunCode(sandbox_pb2.RunCodeRequest(code="print(5)", language="python"), timeout=30)
        assert reply.status == "Success" and reply.run_result.stdout == "5\n"


def test_sigterm_mid_run_kills_the_runs_whole_process_tree(service_process) -> None:
    """A long program that started children in process groups and sessions of their own: on SIGTERM the server
    exits within its bound (SIGTERM_STOP_SECONDS, what the chart's terminationGracePeriodSeconds is checked
    against) and no process of the run, nor any zygote or bubblewrap, is left (checked by pid)."""
    from everstep_sandbox.server import SIGTERM_STOP_SECONDS

    sandbox = service_process("sandbox", "--workers", "1")
    program = ("import os, subprocess, time\n"
               "for _ in range(2):\n"
               "    subprocess.Popen(['sleep', '300'], start_new_session=True)\n"
               "    subprocess.Popen(['sleep', '300'], process_group=0)\n"
               "print('started', flush=True)\n"
               "while True:\n    time.sleep(1)\n")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        reply = pool.submit(_post_quietly, sandbox.http_url, {"code": program, "language": "python",
                                                              "run_timeout": 120})
        wait_until(lambda: len(run_processes(sandbox.process.pid)) >= 5, 30)  # the program and its 4 sleeps
        runs = set(run_processes(sandbox.process.pid))
        below = descendants(sandbox.process.pid)
        assert len({_session_of(pid) for pid in runs}) >= 3, "two sleeps have sessions of their own"
        start = time.monotonic()
        sandbox.process.send_signal(signal.SIGTERM)
        sandbox.process.wait(timeout=SIGTERM_STOP_SECONDS + 10)
        stopped = time.monotonic() - start
        reply.result(timeout=30)
    print(f"sandbox stopped {stopped:.2f} s after SIGTERM")
    assert stopped < SIGTERM_STOP_SECONDS, f"the sandbox took {stopped:.1f} s to stop"
    assert sandbox.process.returncode == 0, sandbox.log()
    assert not alive(runs | below), f"left behind: {alive(runs | below)}"


def _session_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[3])
