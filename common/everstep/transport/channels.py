"""How every everstep process opens gRPC servers and channels: message size limits and optional mutual TLS.

Services share only this package, so the one place that turns settings into gRPC credentials lives
here, beside the stubs, rather than in five copies. Settings come from the environment, so a process
and every process it starts (the controller's local workers, the sandbox's worker processes) agree:

- ``EVERSTEP_GRPC_TLS_CERT``, ``EVERSTEP_GRPC_TLS_KEY``, ``EVERSTEP_GRPC_TLS_CA``: PEM files of this
  process's certificate, its private key, and the CA that signed every service's certificate. All
  three or none. Set, every server requires a client certificate signed by that CA (mutual TLS), and
  every channel presents this certificate and checks the server's against the CA. Unset: plaintext.
- ``EVERSTEP_GRPC_TLS_SERVER_NAME``: the name channels expect in servers' certificates (default: the
  host they dial). One shared name lets one certificate serve pods addressed by IP.
- ``EVERSTEP_GRPC_MAX_MESSAGE_BYTES``: the largest message a server accepts or sends (a service's own
  default otherwise); larger ones fail with RESOURCE_EXHAUSTED before any handler runs.
- ``EVERSTEP_GRPC_MAX_CONNECTION_AGE_SECONDS``, ``EVERSTEP_GRPC_MAX_CONNECTION_AGE_GRACE_SECONDS``: the
  servers of replicated stateless services (reward, sandbox: `new_server(..., balanced=True)`) close each
  connection after this age (0: never), letting its calls in flight finish within the grace.

Each service's ``--grpc-tls-*``, ``--grpc-max-message-bytes`` (and, for the balanced ones,
``--grpc-max-connection-age-*``) flags set these variables (`add_transport_arguments`,
`apply_transport_arguments`). Key contents are never logged; paths are.

**Replicas.** A client of a replicated stateless service opens a `balanced_channel`: gRPC's client-side
``round_robin`` sends each call to the next ready address of the target, rather than every call down the
one connection a plain channel keeps (a Kubernetes ClusterIP Service balances connections, not calls, so
one client would load one pod however many run). Targets that name many addresses:
``dns:///host:port`` (every address the name resolves to, e.g. a headless Service, resolved again when a
connection drops) and ``ipv4:a:p,b:p`` (a fixed list); ``host:port`` is ``dns:///host:port``. The server's
maximum connection age makes long-lived clients drop their connections now and then, so they resolve
again and reach replicas started since.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc

__all__ = [
    "DEFAULT_MAX_CONNECTION_AGE_GRACE_SECONDS",
    "DEFAULT_MAX_CONNECTION_AGE_SECONDS",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "ENV_CA",
    "ENV_CERT",
    "ENV_KEY",
    "ENV_MAX_CONNECTION_AGE_GRACE_SECONDS",
    "ENV_MAX_CONNECTION_AGE_SECONDS",
    "ENV_MAX_MESSAGE_BYTES",
    "ENV_SERVER_NAME",
    "TlsFiles",
    "add_transport_arguments",
    "apply_transport_arguments",
    "balanced_channel",
    "bind",
    "channel",
    "connection_age_options",
    "max_message_bytes",
    "message_size_options",
    "new_server",
    "server_options",
    "tls_from_env",
]

ENV_CERT = "EVERSTEP_GRPC_TLS_CERT"
ENV_KEY = "EVERSTEP_GRPC_TLS_KEY"
ENV_CA = "EVERSTEP_GRPC_TLS_CA"
ENV_SERVER_NAME = "EVERSTEP_GRPC_TLS_SERVER_NAME"
ENV_MAX_MESSAGE_BYTES = "EVERSTEP_GRPC_MAX_MESSAGE_BYTES"
ENV_MAX_CONNECTION_AGE_SECONDS = "EVERSTEP_GRPC_MAX_CONNECTION_AGE_SECONDS"
ENV_MAX_CONNECTION_AGE_GRACE_SECONDS = "EVERSTEP_GRPC_MAX_CONNECTION_AGE_GRACE_SECONDS"

DEFAULT_MAX_MESSAGE_BYTES = 256 * 1024 * 1024
"""Channels' limit (what the largest server may send: a train step, a weight chunk)."""
DEFAULT_MAX_CONNECTION_AGE_SECONDS = 60.0
"""A balanced server's connections last about this long (gRPC adds +-10% jitter), so clients find new replicas
within about a minute."""
DEFAULT_MAX_CONNECTION_AGE_GRACE_SECONDS = 300.0
"""Time an aged connection's calls in flight have to finish. New calls move to a new connection at once, so a
long grace costs nothing; a short one would cut calls, and a call longer than age + grace (a Score batch may
take up to the controller's 300 s reward deadline) would be cut on every connection, however often retried."""

_ROUND_ROBIN = json.dumps({"loadBalancingConfig": [{"round_robin": {}}]})


@dataclass(frozen=True)
class TlsFiles:
    """PEM paths of mutual TLS between services."""

    cert: Path
    key: Path
    ca: Path
    server_name: str = ""  # expected in servers' certificates; "": the host dialed

    def _read(self) -> tuple[bytes, bytes, bytes]:
        contents = []
        for what, path in (("certificate", self.cert), ("private key", self.key), ("CA", self.ca)):
            try:
                contents.append(path.read_bytes())
            except OSError as e:
                raise ValueError(f"gRPC TLS {what} {str(path)!r} cannot be read: {e.strerror}") from None
        return contents[0], contents[1], contents[2]

    def server_credentials(self) -> grpc.ServerCredentials:
        cert, key, ca = self._read()
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        cert, key, ca = self._read()
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def tls_from_env(environ: Mapping[str, str] | None = None) -> TlsFiles | None:
    """The TLS files the environment names, or None (plaintext); ValueError when only some are set."""
    environ = os.environ if environ is None else environ
    values = {name: environ.get(name, "") for name in (ENV_CERT, ENV_KEY, ENV_CA)}
    given = [name for name, value in values.items() if value]
    if not given:
        return None
    if len(given) < 3:
        missing = ", ".join(name for name, value in values.items() if not value)
        raise ValueError(f"gRPC TLS needs {ENV_CERT}, {ENV_KEY} and {ENV_CA} together; missing {missing}")
    return TlsFiles(Path(values[ENV_CERT]), Path(values[ENV_KEY]), Path(values[ENV_CA]),
                    environ.get(ENV_SERVER_NAME, ""))


def max_message_bytes(default: int = DEFAULT_MAX_MESSAGE_BYTES) -> int:
    """The message size limit: EVERSTEP_GRPC_MAX_MESSAGE_BYTES when set, else `default`."""
    value = os.environ.get(ENV_MAX_MESSAGE_BYTES, "")
    if not value:
        return default
    try:
        limit = int(value)
    except ValueError:
        raise ValueError(f"{ENV_MAX_MESSAGE_BYTES} must be a whole number of bytes, got {value!r}") from None
    if limit < 1024:
        raise ValueError(f"{ENV_MAX_MESSAGE_BYTES} must be at least 1024, got {limit}")
    return limit


def message_size_options(limit: int) -> list[tuple[str, int]]:
    return [("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit)]


def _seconds_from_env(name: str, default: float) -> float:
    value = os.environ.get(name, "")
    if not value:
        return default
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"{name} must be a number of seconds, got {value!r}") from None
    if not 0 <= seconds < float("inf"):
        raise ValueError(f"{name} must be 0 or more seconds, got {value!r}")
    return seconds


def connection_age_options() -> list[tuple[str, int]]:
    """A balanced server's connection age options (environment, else the defaults); none when the age is 0."""
    age = _seconds_from_env(ENV_MAX_CONNECTION_AGE_SECONDS, DEFAULT_MAX_CONNECTION_AGE_SECONDS)
    grace = _seconds_from_env(ENV_MAX_CONNECTION_AGE_GRACE_SECONDS, DEFAULT_MAX_CONNECTION_AGE_GRACE_SECONDS)
    if age == 0:
        return []
    return [("grpc.max_connection_age_ms", max(1, round(age * 1000))),
            ("grpc.max_connection_age_grace_ms", round(grace * 1000))]


def server_options(default_max_message_bytes: int, extra: Sequence[tuple[str, int | str]] = ()) -> list:
    """Options of a service's gRPC server: explicit send/receive limits (the knob, else the service's default)."""
    return [*message_size_options(max_message_bytes(default_max_message_bytes)), *extra]


def new_server(max_workers: int, default_max_message_bytes: int, *, thread_name_prefix: str = "grpc",
               balanced: bool = False, extra_options: Sequence[tuple[str, int | str]] = ()) -> grpc.Server:
    """The gRPC server of every service: `server_options`, and never SO_REUSEPORT, which gRPC turns on by
    default: with it, a second server on a port already served binds too and silently takes half its calls.

    `balanced`: a replicated stateless service that clients reach through `balanced_channel` (reward, sandbox);
    its connections end at the maximum connection age (`connection_age_options`). Never for a service holding
    per-client state or long streams (a rollout engine, a trainer)."""
    age = connection_age_options() if balanced else []
    return grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=thread_name_prefix),
                       options=server_options(default_max_message_bytes,
                                              [("grpc.so_reuseport", 0), *age, *extra_options]))


def bind(server: grpc.Server, address: str) -> int:
    """Adds the listening port, with mutual TLS when the environment configures it; OSError naming the address
    if it cannot bind (a port another process serves included)."""
    tls = tls_from_env()
    try:
        port = server.add_secure_port(address, tls.server_credentials()) if tls else server.add_insecure_port(address)
    except RuntimeError as e:  # grpcio raises this where older releases returned 0
        raise OSError(f"cannot bind gRPC port {address}: {e}") from None
    if port == 0:
        raise OSError(f"cannot bind gRPC port {address}")
    return port


def channel(address: str, options: Sequence[tuple[str, int | str]] | None = None) -> grpc.Channel:
    """A channel to another service: TLS with this process's certificate when configured, else plaintext."""
    options = list(options) if options is not None else message_size_options(DEFAULT_MAX_MESSAGE_BYTES)
    tls = tls_from_env()
    if tls is None:
        return grpc.insecure_channel(address, options=options)
    if tls.server_name:
        options.append(("grpc.ssl_target_name_override", tls.server_name))
    return grpc.secure_channel(address, tls.channel_credentials(), options=options)


def balanced_channel(target: str, options: Sequence[tuple[str, int | str]] | None = None) -> grpc.Channel:
    """A `channel` to a replicated stateless service whose calls go round robin over every ready address of
    `target` (``dns:///host:port``, ``ipv4:a:p,b:p``, or ``host:port``). A call in flight to a replica that dies
    fails (UNAVAILABLE) and is the caller's to retry; later calls go to the others. With TLS and a many-address
    target, set the expected server name (EVERSTEP_GRPC_TLS_SERVER_NAME): no one host is dialed."""
    options = list(options) if options is not None else message_size_options(DEFAULT_MAX_MESSAGE_BYTES)
    return channel(target, [*options, ("grpc.service_config", _ROUND_ROBIN)])


def add_transport_arguments(parser: argparse.ArgumentParser, *, balanced: bool = False) -> None:
    """The flags every service takes for its gRPC transport (each overrides its environment variable);
    `balanced` (a server made with `new_server(..., balanced=True)`) adds the connection age flags."""
    group = parser.add_argument_group("gRPC transport", "mutual TLS between services (all three paths, or "
                                      "none for plaintext) and the message size limit; see docs/security.md")
    group.add_argument("--grpc-tls-cert", default=None, help=f"PEM certificate of this process (env {ENV_CERT})")
    group.add_argument("--grpc-tls-key", default=None, help=f"PEM private key of this process (env {ENV_KEY})")
    group.add_argument("--grpc-tls-ca", default=None, help=f"PEM CA of every service's certificate (env {ENV_CA})")
    group.add_argument("--grpc-tls-server-name", default=None,
                       help=f"name expected in servers' certificates (env {ENV_SERVER_NAME}; default: the host dialed)")
    group.add_argument("--grpc-max-message-bytes", type=int, default=None,
                       help=f"largest gRPC message served (env {ENV_MAX_MESSAGE_BYTES}; default: the service's)")
    if balanced:
        group.add_argument("--grpc-max-connection-age-seconds", type=float, default=None,
                           help=f"close each client connection after this long, so that clients resolve the "
                                f"service's addresses again and spread over new replicas; 0: never (env "
                                f"{ENV_MAX_CONNECTION_AGE_SECONDS}; default {DEFAULT_MAX_CONNECTION_AGE_SECONDS:g})")
        group.add_argument("--grpc-max-connection-age-grace-seconds", type=float, default=None,
                           help=f"time the calls in flight on an aged connection have to finish (env "
                                f"{ENV_MAX_CONNECTION_AGE_GRACE_SECONDS}; default "
                                f"{DEFAULT_MAX_CONNECTION_AGE_GRACE_SECONDS:g})")


def apply_transport_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exports the given flags to the environment (this process's servers and channels, and the processes
    it starts, read them there) and checks the result; exits with the parser's error naming the flag."""
    for flag, env in (("grpc_tls_cert", ENV_CERT), ("grpc_tls_key", ENV_KEY), ("grpc_tls_ca", ENV_CA),
                      ("grpc_tls_server_name", ENV_SERVER_NAME), ("grpc_max_message_bytes", ENV_MAX_MESSAGE_BYTES),
                      ("grpc_max_connection_age_seconds", ENV_MAX_CONNECTION_AGE_SECONDS),
                      ("grpc_max_connection_age_grace_seconds", ENV_MAX_CONNECTION_AGE_GRACE_SECONDS)):
        value = getattr(args, flag, None)  # the connection age flags: balanced services only
        if value is not None:
            os.environ[env] = str(value)
    try:
        tls = tls_from_env()
        if tls is not None:
            tls._read()
        max_message_bytes()
        if hasattr(args, "grpc_max_connection_age_seconds"):
            connection_age_options()
    except ValueError as e:
        parser.error(f"{e} (flags --grpc-tls-cert/--grpc-tls-key/--grpc-tls-ca, --grpc-max-message-bytes, "
                     f"--grpc-max-connection-age-seconds/--grpc-max-connection-age-grace-seconds)")
