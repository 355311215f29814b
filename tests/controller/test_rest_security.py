"""The REST API's protections: bodies over the limit get 413 (in process and through a real uvicorn),
a real controller serves HTTPS with a certificate made here and requires its bearer token, and neither
the token nor key material shows in its log (at DEBUG) or in /metrics."""

from __future__ import annotations

import json
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
from fastapi.testclient import TestClient
from tls_material import make_test_pki

from everstep.processes import free_port, is_alive, spawn, stop_processes
from everstep_cli.rest_client import ApiError, ControllerClient
from everstep_controller.api.app import create_app
from everstep_controller.launchers.shared import SharedLauncher
from everstep_controller.run.manager import JobManager
from everstep_controller.store.job_store import JobStore

LIMIT = 4096
TOKEN = "tok-7d1f0c9a8b3e4f5a6b7c8d9e0f1a2b3c"
SPEC = {"model_path": "/models/m", "dataset": {"train_path": "/data/train.jsonl"}, "steps": 3}


def _padded_spec(num_bytes: int) -> bytes:
    """A valid job spec whose JSON is `num_bytes` long (whitespace after the object)."""
    body = json.dumps(SPEC).encode()
    return body + b" " * (num_bytes - len(body))


def _chunks(body: bytes, size: int = 1000) -> Iterator[bytes]:
    for start in range(0, len(body), size):
        yield body[start:start + size]


def _check_limit(post) -> None:  # noqa: ANN001 (an httpx-style post of either client)
    headers = {"content-type": "application/json"}
    assert post("/v1/jobs", content=_padded_spec(LIMIT), headers=headers).status_code == 201
    for over in (_padded_spec(LIMIT + 1), _padded_spec(50 * LIMIT)):
        refused = post("/v1/jobs", content=over, headers=headers)
        assert refused.status_code == 413, refused.text
        assert str(LIMIT) in refused.json()["detail"] and "--max-request-bytes" in refused.json()["detail"]
        streamed = post("/v1/jobs", content=_chunks(over), headers=headers)  # chunked: no Content-Length
        assert streamed.status_code == 413, streamed.text


def test_oversized_bodies_get_413_naming_the_limit(redis_url: str, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EVERSTEP_API_TOKEN", raising=False)
    store = JobStore(redis.Redis.from_url(redis_url))
    manager = JobManager(store, SharedLauncher(rollout="127.0.0.1:1", trainer="127.0.0.1:1"), "127.0.0.1:1", tmp_path)
    client = TestClient(create_app(manager, store, max_request_bytes=LIMIT))
    _check_limit(client.post)
    assert len(store.list()) == 1  # only the job under the limit was accepted


def test_https_controller_requires_its_token_and_never_shows_secrets(redis_url: str, tmp_path: Path) -> None:
    pki = make_test_pki(tmp_path / "pki")
    port = free_port()
    process = spawn("controller", [
        "-m", "everstep_controller", "--port", str(port), "--redis-url", redis_url, "--reward", "127.0.0.1:1",
        "--launcher", "shared", "--rollout", "127.0.0.1:1", "--trainer", "127.0.0.1:1",
        "--data-dir", str(tmp_path / "data"), "--log-level", "DEBUG", "--max-request-bytes", str(LIMIT),
        "--rest-tls-cert", str(pki.service.cert), "--rest-tls-key", str(pki.service.key),
        "--grpc-tls-cert", str(pki.service.cert), "--grpc-tls-key", str(pki.service.key),
        "--grpc-tls-ca", str(pki.ca.cert),
    ], tmp_path / "controller.log", http_port=port, env={"EVERSTEP_API_TOKEN": TOKEN})
    url = f"https://127.0.0.1:{port}"
    trusted = ssl.create_default_context(cafile=str(pki.ca.cert))
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/healthz", verify=trusted, timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert is_alive(process) and time.monotonic() < deadline, Path(process.log_path).read_text()[-3000:]
            time.sleep(0.1)

        api = ControllerClient(url, token=TOKEN, ca_file=str(pki.ca.cert))
        job = api.submit({**SPEC, "name": "over-https"})
        assert api.job(job["id"])["name"] == "over-https"
        api.close()  # an open HTTPS keep-alive connection delays the controller's stop (by up to 3 s)
        with pytest.raises(ApiError, match="401"):
            ControllerClient(url, token="wrong", ca_file=str(pki.ca.cert)).jobs()
        anonymous = httpx.get(f"{url}/v1/jobs", verify=trusted, timeout=5)
        assert anonymous.status_code == 401 and anonymous.headers["www-authenticate"] == "Bearer"
        with pytest.raises(ApiError, match="CERTIFICATE_VERIFY_FAILED"):  # a client that does not trust the CA
            ControllerClient(url, token=TOKEN).jobs()
        with pytest.raises(ApiError, match="cannot reach"):  # plaintext is not served
            ControllerClient(f"http://127.0.0.1:{port}", token=TOKEN).jobs()

        with httpx.Client(base_url=url, verify=trusted, headers={"Authorization": f"Bearer {TOKEN}"},
                          timeout=10) as client:
            _check_limit(client.post)
            metrics = client.get("/metrics").text
        assert "everstep_controller_jobs" in metrics and TOKEN not in metrics
    finally:
        stop_processes([process])
    log = Path(process.log_path).read_text()
    assert TOKEN not in log
    key_lines = pki.service.key.read_text().splitlines()[1:-1]
    assert not any(line in log for line in key_lines)
    assert "DEBUG" in log  # the check ran against a verbose log
