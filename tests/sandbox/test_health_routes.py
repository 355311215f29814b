"""The sandbox's HTTP probe routes (the chart's startup and liveness probes use /livez)."""

from __future__ import annotations

import httpx


def test_livez_readyz_and_healthz(client: httpx.Client) -> None:
    for path in ("/livez", "/readyz", "/healthz"):
        reply = client.get(path)
        assert reply.status_code == 200 and reply.json() == {"status": "ok"}, (path, reply.text)
