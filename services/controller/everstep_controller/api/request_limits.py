"""A limit on the size of REST request bodies (a pure ASGI middleware: bodies are never buffered past it)."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from everstep_controller.settings import ControllerSettings

__all__ = ["DEFAULT_MAX_REQUEST_BYTES", "RequestSizeLimit"]

DEFAULT_MAX_REQUEST_BYTES: int = ControllerSettings.default("max_request_bytes")
"""The controller's --max-request-bytes by default. A job spec is a few kilobytes; datasets and models
travel by path, never in a request."""

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


def _detail(max_bytes: int) -> str:
    return (f"request body larger than {max_bytes} bytes; the controller's --max-request-bytes "
            "(EVERSTEP_MAX_REQUEST_BYTES) sets the limit")


class RequestSizeLimit:
    """413 for a body over `max_bytes`: at once when Content-Length says so, else as soon as the
    streamed (chunked) body passes the limit."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            await self._reject(send, 413 if declared.isdigit() else 400,
                               _detail(self.max_bytes) if declared.isdigit() else "Content-Length is not a number")
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # raised inside the route's body read: FastAPI's exception handling answers 413
                    from starlette.exceptions import HTTPException

                    raise HTTPException(status_code=413, detail=_detail(self.max_bytes))
            return message

        await self.app(scope, limited_receive, send)

    @staticmethod
    async def _reject(send: Send, status: int, detail: str) -> None:
        body = json.dumps({"detail": detail}).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})
