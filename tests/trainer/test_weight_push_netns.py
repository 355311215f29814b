"""A weight push across hosts: two rollout engines, each in its own network namespace with its own address, joined
to this one by a veth pair on a bridge (real interfaces: a small LAN of three hosts), take one gloo broadcast from
the trainer (rank 0 of one group with both) and then decode exactly as a Hugging Face model holding the pushed
weights.

Needs root and `ip netns` (iproute2); elsewhere it is skipped with the reason. NCCL, the same path on GPUs, runs in
the prepared GPU check (docs/gpu.md)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from network_namespaces import netns_unavailable
from test_weight_push_engine import assert_engine_runs, in_model_order, perturbed_weights

from everstep.processes import ManagedProcess, check_running, free_port, spawn, stop_processes, wait_grpc_address
from everstep_trainer.weight_push import WeightPusher

NUM_ENGINES = 2




def _ip(*args: str, netns: str | None = None) -> None:
    command = ["ip", *(["netns", "exec", netns, "ip"] if netns else []), *args]
    subprocess.run(command, check=True, capture_output=True, text=True)


HOST_ADDRESS = "10.77.0.1"
"""The trainer's address on the bridge; engine i is 10.77.0.(i + 2)."""


def _names() -> tuple[str, list[str], list[str], list[str]]:
    """The bridge, the namespaces, and the host and namespace ends of each veth (names of at most 15 characters)."""
    tag = f"{os.getpid() % 100000}"
    return (f"esbr-{tag}", [f"es-eng{i}-{tag}" for i in range(NUM_ENGINES)],
            [f"esh{i}-{tag}" for i in range(NUM_ENGINES)], [f"esn{i}-{tag}" for i in range(NUM_ENGINES)])


@pytest.fixture
def netns_engines(tiny_model_dir: Path, tmp_path: Path) -> Iterator[list[ManagedProcess]]:
    reason = netns_unavailable()
    if reason:
        pytest.skip(reason)
    bridge, namespaces, host_ends, ns_ends = _names()
    engines: list[ManagedProcess] = []
    try:
        _ip("link", "add", bridge, "type", "bridge")
        _ip("addr", "add", f"{HOST_ADDRESS}/24", "dev", bridge)
        _ip("link", "set", bridge, "up")
        for i, (ns, host_if, ns_if) in enumerate(zip(namespaces, host_ends, ns_ends, strict=True)):
            _ip("netns", "add", ns)
            _ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if)
            _ip("link", "set", ns_if, "netns", ns)
            _ip("link", "set", host_if, "master", bridge)
            _ip("link", "set", host_if, "up")
            _ip("addr", "add", f"10.77.0.{i + 2}/24", "dev", ns_if, netns=ns)
            _ip("link", "set", ns_if, "up", netns=ns)
            _ip("link", "set", "lo", "up", netns=ns)
            http_port, grpc_port = free_port(), free_port()
            engine = spawn(f"rollout-{i}", [
                "netns", "exec", ns, "env", f"GLOO_SOCKET_IFNAME={ns_if}", sys.executable, "-m", "everstep_rollout",
                "--host", f"10.77.0.{i + 2}", "--port", str(http_port), "--grpc-port", str(grpc_port),
                "--model", str(tiny_model_dir), "--max-running", "4", "--num-threads", "1"],
                tmp_path / f"rollout-{i}.log", executable="ip", http_port=http_port, grpc_port=grpc_port)
            engines.append(engine)
        for i, engine in enumerate(engines):
            wait_grpc_address(f"10.77.0.{i + 2}:{engine.grpc_port}", 120, what=engine.name,
                              check=lambda engine=engine: check_running(engine))
        yield engines
    finally:
        stop_processes(engines)
        for ns in namespaces:  # deleting a namespace deletes its veth pair
            subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)
        subprocess.run(["ip", "link", "del", bridge], check=False, capture_output=True)


def test_a_gloo_push_crosses_real_interfaces_to_engines_in_their_own_namespaces(netns_engines, tiny_model_dir,
                                                                               monkeypatch) -> None:
    addresses = [f"10.77.0.{i + 2}:{e.grpc_port}" for i, e in enumerate(netns_engines)]
    bridge, _, _, _ = _names()
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", bridge)  # the trainer's side of the group: its address on the LAN
    pusher = WeightPusher(setting="gloo", group_host=HOST_ADDRESS, bucket_bytes=16 * 1024, timeout_seconds=60)
    try:
        weights = perturbed_weights(tiny_model_dir, seed=11)
        report = pusher.push(in_model_order(tiny_model_dir, weights).items(), version=7, endpoints=addresses)
        assert report.transports == dict.fromkeys(addresses, "gloo")
        for address in addresses:
            assert_engine_runs(address, tiny_model_dir, weights, 7)
        counters = _interface_bytes(netns_engines)
        assert all(received > sum(t.numel() * 4 for t in weights.values()) for received in counters), counters
    finally:
        pusher.close()


def _interface_bytes(engines: list[ManagedProcess]) -> list[int]:
    """Bytes each engine's namespace received on its veth: the weights crossed a real interface."""
    _, namespaces, _, ns_ends = _names()
    received = []
    for ns, ns_if in zip(namespaces, ns_ends, strict=True):
        out = subprocess.run(["ip", "netns", "exec", ns, "cat", f"/sys/class/net/{ns_if}/statistics/rx_bytes"],
                             capture_output=True, text=True, check=True).stdout
        received.append(int(out))
    return received
