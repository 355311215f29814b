"""everstep.transport.channels's settings: all three TLS paths or none, a readable file each, a sane message limit;
a service given less exits at start naming the flags (a real process, stopped at argument parsing)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from everstep.transport.channels import (
    ENV_CA,
    ENV_CERT,
    ENV_KEY,
    ENV_MAX_MESSAGE_BYTES,
    bind,
    max_message_bytes,
    new_server,
    tls_from_env,
)


def test_tls_needs_all_three_paths_or_none(tmp_path: Path) -> None:
    assert tls_from_env({}) is None
    assert tls_from_env({ENV_CERT: "", ENV_KEY: "", ENV_CA: ""}) is None
    with pytest.raises(ValueError, match=f"missing {ENV_KEY}, {ENV_CA}"):
        tls_from_env({ENV_CERT: "a.crt"})
    tls = tls_from_env({ENV_CERT: "a.crt", ENV_KEY: "a.key", ENV_CA: str(tmp_path / "ca.crt")})
    assert tls is not None and tls.server_name == ""
    with pytest.raises(ValueError, match="certificate 'a.crt' cannot be read"):
        tls.server_credentials()


def test_message_limit_knob(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_MAX_MESSAGE_BYTES, raising=False)
    assert max_message_bytes(1 << 20) == 1 << 20
    monkeypatch.setenv(ENV_MAX_MESSAGE_BYTES, "65536")
    assert max_message_bytes(1 << 20) == 65536
    for bad in ("64k", "10"):
        monkeypatch.setenv(ENV_MAX_MESSAGE_BYTES, bad)
        with pytest.raises(ValueError, match=ENV_MAX_MESSAGE_BYTES):
            max_message_bytes()


@pytest.mark.parametrize("args", [["--grpc-tls-cert", "/nonexistent.crt"],
                                  ["--grpc-tls-cert", "/nonexistent.crt", "--grpc-tls-key", "/nonexistent.key",
                                   "--grpc-tls-ca", "/nonexistent-ca.crt"],
                                  ["--grpc-max-message-bytes", "12"]])
def test_a_service_with_incomplete_transport_settings_does_not_start(args: list[str]) -> None:
    result = subprocess.run([sys.executable, "-m", "everstep_reward", "--grpc-port", "0", *args],
                            capture_output=True, text=True, timeout=60,
                            env={"PATH": "/usr/bin:/bin", "EVERSTEP_GRPC_TLS_CERT": "", "EVERSTEP_GRPC_TLS_KEY": "",
                                 "EVERSTEP_GRPC_TLS_CA": "", "EVERSTEP_GRPC_MAX_MESSAGE_BYTES": ""})
    assert result.returncode == 2, result.stderr
    assert "--grpc-tls-cert/--grpc-tls-key/--grpc-tls-ca" in result.stderr, result.stderr


def test_a_second_server_on_a_served_port_is_refused(free_port: int) -> None:
    """gRPC's default SO_REUSEPORT would let both bind and split the calls; every service's server refuses."""
    first, second = new_server(2, 1024), new_server(2, 1024)
    try:
        assert bind(first, f"127.0.0.1:{free_port}") == free_port
        first.start()
        with pytest.raises(OSError, match=f"127.0.0.1:{free_port}"):
            bind(second, f"127.0.0.1:{free_port}")
    finally:
        first.stop(None)
        second.stop(None)
