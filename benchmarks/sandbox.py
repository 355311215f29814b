"""Sandbox throughput and latency: `python -m benchmarks.sandbox [--requests N] [--rounds R]`.

Python and C++ programs that read stdin and print, at concurrency 1, 4 and 16, through the
sandbox service's HTTP API (`POST /run_code`, isolation on, a real service process on this
machine), against a baseline that starts one plain subprocess per request with no isolation
(`python3 solution.py`, or the pre-compiled C++ binary), on the same machine in the same run.
The two are measured in alternating rounds (service, baseline, service, ...; each round at least
8 requests per client thread) so that both see the same load from whatever else the machine runs.
The last line of output is one JSON object: `<lang>_c<C>_p50_ms`, `<lang>_c<C>_rps`,
`<lang>_c<C>_baseline_rps`, `<lang>_c<C>_ratio` (rps / baseline rps) for each language and
concurrency, plus what isolation was on.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from everstep.processes import free_port

PROGRAMS = {
    "python": "import sys\nname = sys.stdin.readline().strip()\nprint('hello', name)\n",
    "cpp": "#include <iostream>\n#include <string>\nint main() { std::string name; std::getline(std::cin, name);"
           " std::cout << \"hello \" << name << '\\n'; }\n",
}
CONCURRENCY = (1, 4, 16)


def start_service(workers: int, *extra_args: str) -> tuple[subprocess.Popen, int]:
    """A sandbox server in its own session (stop it by its process group); returns it and its HTTP port."""
    http_port, grpc_port = free_port(), free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "everstep_sandbox", "--host", "127.0.0.1", "--port", str(http_port),
         "--grpc-port", str(grpc_port), "--workers", str(workers), *extra_args],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"sandbox exited with {process.returncode}")
        try:
            connection = http.client.HTTPConnection("127.0.0.1", http_port, timeout=2)
            connection.request("GET", "/v1/ping")
            if connection.getresponse().status == 200:
                return process, http_port
        except OSError:
            time.sleep(0.1)
    raise TimeoutError("sandbox did not start")


def stop_service(process: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (start_service made it one), SIGKILL after 15 s."""
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)


@dataclass
class _Sample:
    latencies: list[float] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def p50_ms(self) -> float:
        return statistics.median(self.latencies) * 1000

    @property
    def rps(self) -> float:
        return len(self.latencies) / self.seconds


def _measure(concurrency: int, num_requests: int, make_call: Callable[[], Callable[[int], None]],
             sample: _Sample | None = None) -> _Sample:
    """Runs `num_requests` calls on `concurrency` threads, adding their latencies and wall time to `sample`."""
    sample = _Sample() if sample is None else sample
    latencies: list[float] = []
    lock = threading.Lock()
    counter = iter(range(num_requests))

    def worker() -> None:
        call = make_call()
        while True:
            with lock:
                index = next(counter, None)
            if index is None:
                return
            start = time.perf_counter()
            call(index)
            elapsed = time.perf_counter() - start
            with lock:
                latencies.append(elapsed)

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    sample.seconds += time.perf_counter() - start
    sample.latencies += latencies
    return sample


def _compare(concurrency: int, num_requests: int, service: Callable[[], Callable[[int], None]],
             baseline: Callable[[], Callable[[int], None]], max_rounds: int) -> tuple[_Sample, _Sample]:
    """`num_requests` through each, in alternating rounds of at least 8 requests per thread."""
    rounds = max(1, min(max_rounds, num_requests // (8 * concurrency)))
    service_sample, baseline_sample = _Sample(), _Sample()
    for round_index in range(rounds):
        share = num_requests // rounds + (round_index < num_requests % rounds)
        _measure(concurrency, share, service, service_sample)
        _measure(concurrency, share, baseline, baseline_sample)
    return service_sample, baseline_sample


def _service_call(port: int, language: str) -> Callable[[], Callable[[int], None]]:
    def make() -> Callable[[int], None]:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)

        def call(index: int) -> None:
            body = json.dumps({"code": PROGRAMS[language], "language": language, "stdin": f"n{index}\n"}).encode()
            connection.request("POST", "/run_code", body, {"Content-Type": "application/json"})
            reply = json.loads(connection.getresponse().read())
            if reply["status"] != "Success" or reply["run_result"]["stdout"] != f"hello n{index}\n":
                raise RuntimeError(f"unexpected sandbox reply: {reply}")

        return call

    return make


def _baseline_call(argv: list[str], cwd: str) -> Callable[[], Callable[[int], None]]:
    def make() -> Callable[[int], None]:
        def call(index: int) -> None:
            result = subprocess.run(argv, cwd=cwd, input=f"n{index}\n".encode(), capture_output=True, timeout=60,
                                    check=False)
            if result.stdout != f"hello n{index}\n".encode():
                raise RuntimeError(f"unexpected baseline output: {result}")

        return call

    return make


def _baseline_argv(language: str, work: Path) -> list[str]:
    if language == "python":
        (work / "solution.py").write_text(PROGRAMS["python"])
        return ["/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable, "solution.py"]
    (work / "solution.cpp").write_text(PROGRAMS["cpp"])
    subprocess.run(["g++", "-O2", "-o", "solution", "solution.cpp"], cwd=work, check=True)
    return ["./solution"]


def main() -> None:
    parser = argparse.ArgumentParser(prog="benchmarks.sandbox", description=__doc__)
    parser.add_argument("--requests", type=int, default=160, help="requests per measurement (c >= 4)")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="sandbox slots")
    parser.add_argument("--rounds", type=int, default=4, help="alternating service/baseline rounds (at most)")
    args = parser.parse_args()
    process, port = start_service(args.workers)
    summary: dict[str, float | int | str | bool] = {}
    try:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        connection.request("GET", "/v1/isolation")
        isolation = json.loads(connection.getresponse().read())
        summary["isolation_bubblewrap"] = isolation["bubblewrap"]
        summary["isolation_cgroups"] = isolation["cgroups"]
        summary["isolation_seccomp"] = isolation["seccomp"]
        with tempfile.TemporaryDirectory(prefix="everstep-bench-") as work:
            for language in PROGRAMS:
                baseline_argv = _baseline_argv(language, Path(work))
                _measure(1, 4, _service_call(port, language))  # warm-up: compile cache, slots
                for concurrency in CONCURRENCY:
                    num_requests = args.requests // 2 if concurrency == 1 else args.requests
                    service, baseline = _compare(concurrency, num_requests, _service_call(port, language),
                                                 _baseline_call(baseline_argv, work), args.rounds)
                    p50, rps, base_p50, base_rps = service.p50_ms, service.rps, baseline.p50_ms, baseline.rps
                    key = f"{language}_c{concurrency}"
                    summary.update({f"{key}_p50_ms": round(p50, 2), f"{key}_rps": round(rps, 1),
                                    f"{key}_baseline_p50_ms": round(base_p50, 2),
                                    f"{key}_baseline_rps": round(base_rps, 1),
                                    f"{key}_ratio": round(rps / base_rps, 2)})
                    print(f"{key}: {rps:.1f} rps p50 {p50:.1f} ms | baseline {base_rps:.1f} rps "
                          f"p50 {base_p50:.1f} ms", file=sys.stderr, flush=True)
    finally:
        stop_service(process)
    summary["cpu_count"] = os.cpu_count() or 1
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
