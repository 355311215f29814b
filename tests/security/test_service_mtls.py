"""Mutual TLS between services, through real processes and certificates made here: the sandbox and the
reward service require a client certificate from the CA; a client without one (plaintext, TLS without
a certificate, a certificate of another CA) is refused, and one with it works, the reward service's own
calls to the sandbox and the controller's reward client included."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tls_material import make_test_pki

from everstep.processes import ManagedProcess, free_port, spawn, stop_processes, wait_grpc_serving
from everstep.v1 import reward_pb2
from everstep_controller.run.clients import RewardClient

TLS_VARIABLES = ("EVERSTEP_GRPC_TLS_CERT", "EVERSTEP_GRPC_TLS_KEY", "EVERSTEP_GRPC_TLS_CA",
                 "EVERSTEP_GRPC_TLS_SERVER_NAME")


def _start(name: str, args: list[str], log_dir: Path, env: dict[str, str]) -> ManagedProcess:
    http_port, grpc_port = free_port(), free_port()
    return spawn(name, ["-m", f"everstep_{name}", "--host", "127.0.0.1", "--port", str(http_port),
                        "--grpc-port", str(grpc_port), *args], log_dir / f"{name}.log",
                 http_port=http_port, grpc_port=grpc_port, env=env)


def _health(channel: grpc.Channel) -> int:
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status


def _refused(channel: grpc.Channel) -> grpc.StatusCode:
    with channel, pytest.raises(grpc.RpcError) as refused:
        _health(channel)
    return refused.value.code()


def test_services_refuse_clients_without_a_certificate_and_serve_those_with_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pki = make_test_pki(tmp_path / "pki")
    ca = pki.ca.cert.read_bytes()
    for name, value in pki.grpc_env().items():  # this test process dials like a service
        monkeypatch.setenv(name, value)
    processes: list[ManagedProcess] = []
    try:
        # the sandbox takes TLS from the environment, the reward service from its flags
        processes.append(sandbox := _start("sandbox", ["--workers", "1"], tmp_path, pki.grpc_env()))
        wait_grpc_serving(sandbox, 60)
        processes.append(reward := _start("reward", [
            "--math-workers", "1", "--sandbox-endpoint", sandbox.grpc_address,
            "--grpc-tls-cert", str(pki.service.cert), "--grpc-tls-key", str(pki.service.key),
            "--grpc-tls-ca", str(pki.ca.cert)], tmp_path, dict.fromkeys(TLS_VARIABLES, "")))
        wait_grpc_serving(reward, 60)

        for process in (sandbox, reward):
            address = process.grpc_address
            assert _refused(grpc.insecure_channel(address)) == grpc.StatusCode.UNAVAILABLE
            no_cert = grpc.ssl_channel_credentials(root_certificates=ca)
            assert _refused(grpc.secure_channel(address, no_cert)) == grpc.StatusCode.UNAVAILABLE
            stranger = grpc.ssl_channel_credentials(root_certificates=ca, private_key=pki.stranger.key.read_bytes(),
                                                    certificate_chain=pki.stranger.cert.read_bytes())
            assert _refused(grpc.secure_channel(address, stranger)) == grpc.StatusCode.UNAVAILABLE

        # with the certificate: the controller's client scores a code item, which the reward service
        # runs in the sandbox over its own mutual-TLS channel
        client = RewardClient(reward.grpc_address, timeout_seconds=120)
        try:
            results = client.score([
                reward_pb2.RewardItem(id="code", response="```python\nprint(2 * int(input()))\n```", verifiers=[
                    reward_pb2.VerifierSpec(name="code", weight=1.0, language="python", tests=[
                        reward_pb2.CodeTest(stdin="3\n", expected_stdout="6\n"),
                        reward_pb2.CodeTest(stdin="5\n", expected_stdout="10\n")])]),
                reward_pb2.RewardItem(id="math", response="\\boxed{4}", verifiers=[
                    reward_pb2.VerifierSpec(name="math", weight=1.0, answer="4")]),
            ])
        finally:
            client.close()
        assert {k: (r.reward, r.error) for k, r in results.items()} == {"code": (1.0, ""), "math": (1.0, "")}

        # the chart's exec probe: the server name it expects must be in the certificate
        def probe(server_name: str) -> subprocess.CompletedProcess:
            return subprocess.run([sys.executable, "-m", "everstep.transport.health_check", reward.grpc_address],
                                  env={**pki.grpc_env(server_name)}, capture_output=True, text=True, timeout=30)

        ok = probe("everstep-internal")
        assert ok.returncode == 0 and "SERVING" in ok.stdout, ok.stderr
        assert probe("not-in-the-certificate").returncode == 1
    finally:
        stop_processes(processes)
    for process in processes:
        log = Path(process.log_path).read_text()
        assert pki.service.key.read_text().splitlines()[1] not in log  # key material never logged
