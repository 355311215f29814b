"""A fast path in front of the FastAPI app for the two endpoints that carry the load.

FastAPI spends more CPU per request than the sandbox's own bookkeeping: routing, dependency
solving, a middleware stack, anyio's thread hand-off. For `POST /run_code` and `POST /run_tests`
with a JSON body, `HotPathApp` validates the body with the endpoint's own pydantic model, runs the
same handler in a thread pool and sends its response unchanged. Anything else (other paths and
methods, other content types, a body that does not validate) goes to FastAPI with the body
replayed, so errors (422 with field paths) and the OpenAPI schema stay FastAPI's own.

While the handler runs, the fast path listens for the client's disconnect: when the client goes
away the request's CancelToken fires, which drops it from the slot queue or kills its run.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from everstep_sandbox.cancel import CancelToken

__all__ = ["HotPathApp", "HotRoute"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HotRoute:
    model: type[BaseModel]
    """The request body's model (the one FastAPI validates the same route with)."""
    handler: Callable[[BaseModel, CancelToken | None], Response]
    """Blocking; runs in the thread pool. May raise HTTPException, answered as FastAPI would. The token
    fires when the client disconnects."""


class HotPathApp:
    def __init__(self, app: ASGIApp, routes: Mapping[str, HotRoute], *, max_threads: int = 64) -> None:
        self.app = app
        self._routes = dict(routes)
        self._executor = concurrent.futures.ThreadPoolExecutor(max_threads, thread_name_prefix="sandbox-http")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = self._routes.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if route is None or not _is_json(scope):
            await self.app(scope, receive, send)
            return
        body = await _read_body(receive)
        if body is None:  # the client went away
            return
        try:
            request = route.model.model_validate_json(body)
        except ValidationError:
            await self.app(scope, _replay(body, receive), send)  # FastAPI answers with its 422
            return
        cancel = CancelToken()
        work = asyncio.get_running_loop().run_in_executor(self._executor, route.handler, request, cancel)
        disconnect = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait((work, disconnect), return_when=asyncio.FIRST_COMPLETED)
        finally:
            disconnect.cancel()
        if not work.done():  # the client went away: drop the request, answer nobody
            cancel.cancel()
            with contextlib.suppress(Exception):
                await work
            return
        try:
            response = work.result()
        except HTTPException as e:
            response = JSONResponse({"detail": e.detail}, status_code=e.status_code, headers=e.headers)
        except Exception:
            log.exception("%s failed", scope["path"])
            response = PlainTextResponse("Internal Server Error", status_code=500)
        await response(scope, receive, send)


def _is_json(scope: Scope) -> bool:
    """FastAPI's rule: a body is JSON when its content type's subtype is `json` or ends in `+json`."""
    for name, value in scope["headers"]:
        if name == b"content-type":
            subtype = value.split(b";", 1)[0].strip().lower().partition(b"/")[2]
            return subtype == b"json" or subtype.endswith(b"+json")
    return False


async def _read_body(receive: Receive) -> bytes | None:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _disconnected(receive: Receive) -> None:
    """Returns when the client disconnects (after the body, `receive` yields nothing else)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def _replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that yields the already-read body once, then defers to the real one."""
    replayed = False

    async def replay() -> Message:
        nonlocal replayed
        if replayed:
            return await receive()
        replayed = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay
