"""Worker processes sharing the ports, and the documented fallback without namespaces."""

from __future__ import annotations

import concurrent.futures

import httpx

from everstep_sandbox.config import SandboxConfig
from everstep_sandbox.process import RunStatus
from everstep_sandbox.runner import ProgramSpec, SandboxRunner


def test_worker_processes_share_the_ports_and_the_metrics(service_process) -> None:
    sandbox = service_process("sandbox", "--workers", "1", "--processes", "2")
    with httpx.Client(base_url=sandbox.http_url, timeout=60) as client:
        def run(i: int) -> dict:
            return client.post("/run_code", json={"code": "import os; print(os.getpid() > 0)",
                                                  "language": "python"}).json()

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            bodies = list(pool.map(run, range(12)))
        assert all(b["status"] == "Success" for b in bodies), bodies
        metrics = client.get("/metrics").text
    # Multiprocess mode: one sum over both processes, whichever process answered the scrape.
    line = next(line for line in metrics.splitlines()
                if line.startswith('everstep_sandbox_requests_total{language="python",status="Success"}'))
    assert float(line.split()[-1]) == 12
    sandbox.stop()
    assert sandbox.process.returncode == 0, sandbox.log()


def test_fallback_without_namespaces_still_runs_and_says_so() -> None:
    runner = SandboxRunner.start(SandboxConfig(workers=1, isolation="none"))
    try:
        assert not runner.isolation.bubblewrap
        assert any("isolation disabled" in w for w in runner.isolation.warnings)
        result = runner.run_code(ProgramSpec(code="print(input())", language="python"), stdin="fallback")
        assert result.status == RunStatus.SUCCESS and result.run_result.stdout == "fallback\n", result
        result = runner.run_code(ProgramSpec(code="echo $((6 * 7))", language="bash"))
        assert result.run_result.stdout == "42\n"
    finally:
        runner.close()
