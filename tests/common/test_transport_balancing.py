"""`everstep.transport` for replicated services: a balanced channel spreads calls over every address of its
target and moves off a replica that stopped; a balanced server closes connections at the maximum connection age,
so clients connect again; the age settings are checked."""

from __future__ import annotations

import argparse
import collections
import time
from collections.abc import Iterator

import grpc
import pytest

from everstep.transport import channels as transport

METHOD = "/everstep.test.Peer/Get"


def _server(balanced: bool = False) -> tuple[grpc.Server, int, collections.Counter]:
    """A server whose one method answers with the caller's address; counts the calls by that address."""
    calls: collections.Counter = collections.Counter()

    def get(request: bytes, context: grpc.ServicerContext) -> bytes:
        calls[context.peer()] += 1
        return context.peer().encode()

    server = transport.new_server(2, 1024 * 1024, balanced=balanced)
    handler = grpc.unary_unary_rpc_method_handler(get)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("everstep.test.Peer", {"Get": handler})])
    port = transport.bind(server, "127.0.0.1:0")
    server.start()
    return server, port, calls


@pytest.fixture
def replicas() -> Iterator[list[tuple[grpc.Server, int, collections.Counter]]]:
    started = [_server(), _server()]
    yield started
    for server, _, _ in started:
        server.stop(0)


def test_a_balanced_channel_spreads_calls_and_leaves_a_stopped_replica(replicas: list) -> None:
    target = "ipv4:" + ",".join(f"127.0.0.1:{port}" for _, port, _ in replicas)
    with transport.balanced_channel(target) as channel:
        get = channel.unary_unary(METHOD)
        for _ in range(40):
            get(b"", timeout=10)
        counts = [sum(calls.values()) for _, _, calls in replicas]
        assert sum(counts) == 40 and min(counts) >= 10, counts  # the first calls may precede the second connection

        replicas[0][0].stop(0).wait()
        deadline = time.monotonic() + 10
        while True:  # the calls in flight when a replica stops fail; the channel notices at once
            try:
                get(b"", timeout=10)
                break
            except grpc.RpcError:
                assert time.monotonic() < deadline
        before = sum(replicas[1][2].values())
        for _ in range(10):
            get(b"", timeout=10)
        assert sum(replicas[1][2].values()) == before + 10


def test_a_plain_channel_keeps_one_replica(replicas: list) -> None:
    target = "ipv4:" + ",".join(f"127.0.0.1:{port}" for _, port, _ in replicas)
    with transport.channel(target) as channel:
        for _ in range(10):
            channel.unary_unary(METHOD)(b"", timeout=10)
    assert sorted(sum(calls.values()) for _, _, calls in replicas) == [0, 10]


def test_a_balanced_server_ends_connections_at_their_maximum_age(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(transport.ENV_MAX_CONNECTION_AGE_SECONDS, "0.3")
    monkeypatch.setenv(transport.ENV_MAX_CONNECTION_AGE_GRACE_SECONDS, "1")
    aged, aged_port, aged_calls = _server(balanced=True)
    kept, kept_port, kept_calls = _server(balanced=False)  # a rollout engine or trainer: never
    try:
        with (transport.balanced_channel(f"127.0.0.1:{aged_port}") as a,
              transport.channel(f"127.0.0.1:{kept_port}") as k):
            deadline = time.monotonic() + 2
            while time.monotonic() < deadline:
                a.unary_unary(METHOD)(b"", timeout=10)
                k.unary_unary(METHOD)(b"", timeout=10)
                time.sleep(0.05)
        assert len(aged_calls) >= 3, f"one client connection per age: {aged_calls}"
        assert len(kept_calls) == 1, kept_calls
    finally:
        aged.stop(0)
        kept.stop(0)


def test_connection_age_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    # "" is unset; monkeypatch restores what apply_transport_arguments writes to the environment below
    monkeypatch.setenv(transport.ENV_MAX_CONNECTION_AGE_SECONDS, "")
    monkeypatch.setenv(transport.ENV_MAX_CONNECTION_AGE_GRACE_SECONDS, "")
    assert transport.connection_age_options() == [("grpc.max_connection_age_ms", 60_000),
                                                   ("grpc.max_connection_age_grace_ms", 300_000)]
    monkeypatch.setenv(transport.ENV_MAX_CONNECTION_AGE_SECONDS, "0")
    assert transport.connection_age_options() == [], "0: connections never aged"
    for bad in ("-1", "soon", "inf"):
        monkeypatch.setenv(transport.ENV_MAX_CONNECTION_AGE_SECONDS, bad)
        with pytest.raises(ValueError, match=transport.ENV_MAX_CONNECTION_AGE_SECONDS):
            transport.connection_age_options()

    monkeypatch.setenv(transport.ENV_MAX_CONNECTION_AGE_SECONDS, "")
    parser = argparse.ArgumentParser()
    transport.add_transport_arguments(parser, balanced=True)
    transport.apply_transport_arguments(parser, parser.parse_args(["--grpc-max-connection-age-seconds", "30"]))
    assert transport.connection_age_options()[0] == ("grpc.max_connection_age_ms", 30_000)
    with pytest.raises(SystemExit):
        transport.apply_transport_arguments(parser, parser.parse_args(["--grpc-max-connection-age-grace-seconds",
                                                                       "-5"]))
    plain = argparse.ArgumentParser()
    transport.add_transport_arguments(plain)
    with pytest.raises(SystemExit):  # a stateful service's server never ages its connections: no such flag
        plain.parse_args(["--grpc-max-connection-age-seconds", "30"])
