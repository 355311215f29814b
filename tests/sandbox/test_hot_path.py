"""The fast path for /run_code and /run_tests answers exactly as the FastAPI app behind it."""

from __future__ import annotations

import asyncio
import json

import pytest
from starlette.testclient import TestClient

from everstep_sandbox.api.http_app import create_app
from everstep_sandbox.runner import SandboxRunner

CASES = [
    ("/run_code", {"code": "print(input()[::-1])", "language": "python", "stdin": "abc"}, "application/json"),
    ("/run_code", {"code": "print(1)", "language": "python"}, "application/json; charset=utf-8"),
    ("/run_code", {"code": "import sys; sys.exit(3)", "language": "python"}, "application/vnd.x+json"),
    ("/run_code", {"language": "python"}, "application/json"),  # missing field: FastAPI's 422
    ("/run_code", {"code": "x", "language": "cobol"}, "application/json"),  # the handler's 422
    ("/run_code", {"code": "x", "language": "python", "files": {"a": "not base64!"}}, "application/json"),
    ("/run_code", {"code": "x", "language": "python", "run_timeout": "soon"}, "application/json"),
    ("/run_code", {"code": "print(1)", "language": "python"}, "text/plain"),  # not JSON: FastAPI's 422
    ("/run_tests", {"code": "print(int(input()) * 2)", "language": "python",
                    "cases": [{"stdin": "2", "expected_stdout": "4"}, {"stdin": "3", "expected_stdout": "7"}]},
     "application/json"),
    ("/run_tests", {"code": "x", "language": "python", "cases": [{"stdin": "2"}]}, "application/json"),
]


def _without_timings(value: object) -> object:
    if isinstance(value, dict):
        return {k: _without_timings(v) for k, v in value.items() if k != "execution_time"}
    if isinstance(value, list):
        return [_without_timings(v) for v in value]
    return value


@pytest.mark.parametrize(("path", "request_body", "content_type"), CASES)
def test_fast_path_answers_as_fastapi_does(runner: SandboxRunner, path: str, request_body: dict,
                                           content_type: str) -> None:
    app = create_app(runner)
    content = json.dumps(request_body)
    with TestClient(app) as fast, TestClient(app.app) as plain:
        replies = [client.post(path, content=content, headers={"content-type": content_type})
                   for client in (fast, plain)]
    assert replies[0].status_code == replies[1].status_code, [r.text for r in replies]
    assert replies[0].headers["content-type"] == replies[1].headers["content-type"]
    assert _without_timings(replies[0].json()) == _without_timings(replies[1].json())


def test_a_client_that_goes_away_is_not_run(runner: SandboxRunner) -> None:
    app = create_app(runner)
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/run_code", "headers": [(b"content-type", b"application/json")]}
    asyncio.run(app(scope, receive, send))
    assert sent == []
