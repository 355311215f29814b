"""A burst of CPU-bound requests at once, and abandoned requests: `python -m benchmarks.sandbox_burst
[--requests N] [--run-timeout S] [--abandoned M] [--workers W] [--max-slots K]`.

Starts a sandbox service (isolation on), then:

1. **Burst.** N clients send `POST /run_code` at the same moment, each a Python program that spins
   forever with `run_timeout` S, each with an HTTP read timeout of S + 20 s (verl's client allows
   compile + run + 10 s). A client is answered in time when a SandboxFusion-shaped response (`status`
   Success/Failed/SandboxError, `run_result`...) arrives within S + 20 s. Reports how many were,
   latency p50/p99, and the statuses.
2. **Abandoned.** M clients send the same program with `run_timeout` 60 and disconnect one second
   later. Reports how many the server dropped (from the queue, or by killing the run:
   `everstep_sandbox_abandoned_requests_total`) and how long until it had none left in flight.

The last line of output is one JSON object: `burst_requests`, `burst_answered_in_time`,
`burst_p50_seconds`, `burst_p99_seconds`, `burst_max_seconds`, `burst_statuses`, `abandoned_sent`,
`abandoned_dropped`, `abandoned_drain_seconds`, `cpu_count`, `load_average_1m` (before the run).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import statistics
import sys
import threading
import time
from collections import Counter

from benchmarks.sandbox import start_service, stop_service

SPIN = "while True:\n    pass\n"
_SHAPE = {"status", "message", "compile_result", "run_result", "executor_pod_name", "files"}


def _metric(port: int, name: str) -> float:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    connection.request("GET", "/metrics")
    total = 0.0
    for line in connection.getresponse().read().decode().splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.split()[-1])
    return total


def _burst(port: int, num_requests: int, run_timeout: float) -> tuple[list[float | None], Counter]:
    """Latency of each client (None: not answered in time, or not in SandboxFusion's shape) and statuses."""
    budget = run_timeout + 20
    latencies: list[float | None] = [None] * num_requests
    statuses: Counter = Counter()
    lock = threading.Lock()
    barrier = threading.Barrier(num_requests)
    body = json.dumps({"code": SPIN, "language": "python", "run_timeout": run_timeout}).encode()

    def client(i: int) -> None:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=budget)
        barrier.wait()
        start = time.monotonic()
        try:
            connection.request("POST", "/run_code", body, {"Content-Type": "application/json"})
            reply = json.loads(connection.getresponse().read())
            elapsed = time.monotonic() - start
            shaped = set(reply) == _SHAPE and reply["status"] in ("Success", "Failed", "SandboxError")
            run_status = (reply.get("run_result") or {}).get("status")
            key = f"{reply['status']}/{run_status}" if shaped else "malformed"
            with lock:
                statuses[key] += 1
                if shaped and elapsed <= budget:
                    latencies[i] = elapsed
        except (OSError, ValueError) as e:
            with lock:
                statuses[f"no answer ({type(e).__name__})"] += 1

    threads = [threading.Thread(target=client, args=(i,)) for i in range(num_requests)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return latencies, statuses


def _abandon(port: int, num_requests: int) -> tuple[float, float]:
    """(requests dropped, seconds from the disconnects until none was in flight)."""
    dropped_before = _metric(port, "everstep_sandbox_abandoned_requests_total")
    body = json.dumps({"code": SPIN, "language": "python", "run_timeout": 60}).encode()
    sockets = []
    for _ in range(num_requests):
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(b"POST /run_code HTTP/1.1\r\nHost: sandbox\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        sockets.append(sock)
    time.sleep(1.0)
    start = time.monotonic()
    for sock in sockets:
        sock.close()
    while _metric(port, "everstep_sandbox_inflight_requests") > 0 and time.monotonic() - start < 60:
        time.sleep(0.05)
    drain = time.monotonic() - start
    time.sleep(0.2)
    return _metric(port, "everstep_sandbox_abandoned_requests_total") - dropped_before, drain


def _percentile(values: list[float], q: float) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def main() -> None:
    parser = argparse.ArgumentParser(prog="benchmarks.sandbox_burst", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=100, help="clients of the burst")
    parser.add_argument("--run-timeout", type=float, default=10.0, help="run_timeout of each burst request")
    parser.add_argument("--abandoned", type=int, default=20, help="clients that disconnect after 1 s")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="base sandbox slots")
    parser.add_argument("--max-slots", type=int, default=128, help="slots with the elastic ones")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    process, port = start_service(args.workers, "--max-slots", str(args.max_slots))
    try:
        latencies, statuses = _burst(port, args.requests, args.run_timeout)
        answered = sorted(x for x in latencies if x is not None)
        print(f"burst: {len(answered)}/{args.requests} answered within run_timeout + 20 s; statuses "
              f"{dict(statuses)}", file=sys.stderr, flush=True)
        dropped, drain = _abandon(port, args.abandoned) if args.abandoned else (0.0, 0.0)
        print(f"abandoned: {dropped:.0f}/{args.abandoned} dropped, none in flight after {drain:.2f} s",
              file=sys.stderr, flush=True)
    finally:
        stop_service(process)
    print(json.dumps({
        "burst_requests": args.requests, "burst_run_timeout_seconds": args.run_timeout,
        "burst_answered_in_time": len(answered),
        "burst_p50_seconds": round(_percentile(answered, 50), 3) if answered else None,
        "burst_p99_seconds": round(_percentile(answered, 99), 3) if answered else None,
        "burst_max_seconds": round(answered[-1], 3) if answered else None,
        "burst_statuses": dict(statuses), "abandoned_sent": args.abandoned, "abandoned_dropped": int(dropped),
        "abandoned_drain_seconds": round(drain, 3), "workers": args.workers, "max_slots": args.max_slots,
        "cpu_count": os.cpu_count() or 1, "load_average_1m": round(load, 2),
    }))


if __name__ == "__main__":
    main()
