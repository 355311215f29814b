"""free_port: the ports it hands to servers are never ones the kernel gives outgoing connections."""

from __future__ import annotations

import socket

from everstep.processes import ephemeral_ports, free_port


def test_ports_lie_outside_the_ephemeral_range_are_distinct_and_bindable() -> None:
    # the CI failure this prevents: an outgoing connection (given a port from the ephemeral range) took the
    # sandbox's port between free_port() and the sandbox's bind, and `everstep up` failed
    ephemeral = ephemeral_ports()
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    assert not [p for p in ports if p in ephemeral], f"ports in the ephemeral range {ephemeral}: {ports}"
    for port in ports[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_listening_port_is_skipped(monkeypatch) -> None:
    import everstep.processes as processes

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        taken = listener.getsockname()[1]
        # the only candidate is the port a server already listens on: the kernel's choice is the fallback
        monkeypatch.setattr(processes, "LISTEN_PORTS", range(taken, taken + 1))
        monkeypatch.setattr(processes, "ephemeral_ports", lambda: range(0))
        assert free_port() != taken
