"""SandboxFusion-compatible HTTP API (`POST /run_code`, `POST /run_jupyter`, `GET /v1/ping`) plus everstep's
`POST /run_tests`, `/healthz` (also `/livez`, `/readyz`) and `/metrics`.

Request and response JSON match SandboxFusion's `sandbox/server/sandbox_api.py` field for field,
so SandboxFusion clients work unchanged. Differences: an unsupported language is a 422 naming the
supported ones (SandboxFusion's schema also answers 422), `args` is passed to pytest and ignored
with a warning by the other languages, and `c` is an extra language. `POST /run_tests` is the batch endpoint:
compile once, run every test case. `GET /v1/isolation` says what isolation this host gives.
The three run endpoints are served through `hot_path.HotPathApp` (same models, same handlers,
less CPU per request); FastAPI answers everything else.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import logging
import os
import socket
from typing import Any, Literal

from fastapi import FastAPI, HTTPException, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest, multiprocess
from pydantic import BaseModel, Field

from everstep_sandbox.api.hot_path import HotPathApp, HotRoute
from everstep_sandbox.cancel import CancelToken
from everstep_sandbox.jupyter import JupyterSpec
from everstep_sandbox.process import CommandResult, CommandRunStatus, RunStatus
from everstep_sandbox.runner import InvalidRequest, ProgramSpec, SandboxRunner, TestCase

__all__ = ["create_app"]

log = logging.getLogger(__name__)


class CommandRunResult(BaseModel):
    status: CommandRunStatus
    execution_time: float | None = None
    return_code: int | None = None
    stdout: str | None = None
    stderr: str | None = None


class RunCodeRequest(BaseModel):
    compile_timeout: float = Field(10, description="compile timeout for compiled languages")
    run_timeout: float = Field(10, description="code run timeout")
    memory_limit_MB: int = Field(-1, description="maximum memory allowed in megabytes")
    code: str = Field(..., examples=['print("hello")'], description="the code to run")
    stdin: str | None = Field(None, examples=[""], description="optional string to pass into stdin")
    language: str = Field(..., examples=["python"], description="the language to run the code in")
    files: dict[str, str | None] = Field({}, description="a dict from file path to base64 encoded file content")
    fetch_files: list[str] = Field([], description="a list of file paths to fetch after code execution")
    args: list[str] = Field([], description="additional command-line arguments passed to pytest (ignored by "
                                             "the other languages)")


class RunCodeResponse(BaseModel):
    status: RunStatus
    message: str
    compile_result: CommandRunResult | None = None
    run_result: CommandRunResult | None = None
    executor_pod_name: str | None = None
    files: dict[str, str] = {}


class RunJupyterRequest(BaseModel):
    cells: list[str] = Field(..., examples=[["a = 123", "a", "print(a)", "raise RuntimeError('error message')"]],
                             description="list of code blocks to run in jupyter notebook")
    cell_timeout: float = Field(0, description="max run time for each of the cells")
    total_timeout: float = Field(45, description="max run time for all the cells")
    memory_limit_MB: int = Field(-1, description="maximum memory allowed in megabytes")
    kernel: Literal["python3"] = "python3"
    files: dict[str, str | None] = Field({}, description="a dict from file path to base64 encoded file content")
    fetch_files: list[str] = Field([], description="a list of file paths to fetch after code execution")


class CellRunResult(BaseModel):
    stdout: str
    stderr: str
    display: list[dict[str, Any]]
    error: list[dict[str, Any]]


class RunJupyterResponse(BaseModel):
    status: RunStatus
    message: str
    driver: CommandRunResult | None = None
    cells: list[CellRunResult] = []
    executor_pod_name: str | None = None
    files: dict[str, str] = {}


class TestCaseModel(BaseModel):
    stdin: str = ""
    expected_stdout: str


class RunTestsRequest(BaseModel):
    code: str
    language: str
    cases: list[TestCaseModel]
    compile_timeout: float = 10
    run_timeout: float = 10
    memory_limit_MB: int = -1
    files: dict[str, str | None] = {}


class TestCaseResultModel(BaseModel):
    passed: bool
    run_result: CommandRunResult | None = None


class RunTestsResponse(BaseModel):
    status: RunStatus
    message: str
    compile_result: CommandRunResult | None = None
    results: list[TestCaseResultModel] = []
    executor_pod_name: str | None = None


def _command_json(result: CommandResult | None) -> CommandRunResult | None:
    if result is None:
        return None
    return CommandRunResult(status=result.status, execution_time=result.execution_time,
                            return_code=result.return_code, stdout=result.stdout, stderr=result.stderr)


def _decode_files(files: dict[str, str | None]) -> dict[str, bytes]:
    decoded = {}
    for path, content in files.items():
        if content is None:  # SandboxFusion allows null contents and skips them
            continue
        try:
            decoded[path] = base64.b64decode(content, validate=True)
        except binascii.Error:
            raise _unprocessable(("body", "files", path), "file content is not valid base64") from None
    return decoded


def _unprocessable(loc: tuple[str, ...], message: str) -> HTTPException:
    return HTTPException(status_code=422, detail=[{"loc": list(loc), "msg": message, "type": "value_error"}])


def _json_response(model: BaseModel) -> Response:
    """Serialises an already-typed response once (FastAPI would validate it again on the hot path)."""
    return Response(model.model_dump_json(), media_type="application/json")


def create_app(runner: SandboxRunner) -> HotPathApp:
    """The ASGI app: FastAPI (`.app`) behind the fast path for `/run_code` and `/run_tests`."""
    app = FastAPI(title="everstep sandbox")
    pod_name = os.environ.get("MY_POD_NAME") or socket.gethostname()

    def check_language(language: str) -> None:
        if language not in runner.languages:
            raise _unprocessable(("body", "language"),
                                 f"unsupported language {language!r}; supported: {', '.join(runner.languages)}")

    # Plain `def` handlers: FastAPI (and the fast path) run them in a thread pool, so a long run never
    # blocks the loop.
    def run_code(request: RunCodeRequest, cancel: CancelToken | None) -> Response:
        check_language(request.language)
        if request.args and request.language != "pytest":
            log.warning("ignoring `args` %s: only pytest takes them", request.args)
        spec = ProgramSpec(code=request.code, language=request.language,
                           compile_timeout_seconds=request.compile_timeout,
                           run_timeout_seconds=request.run_timeout, memory_limit_mb=request.memory_limit_MB,
                           files=_decode_files(request.files),
                           args=tuple(request.args) if request.language == "pytest" else ())
        try:
            result = runner.run_code(spec, stdin=request.stdin or "", fetch_files=request.fetch_files, cancel=cancel)
        except InvalidRequest as e:
            raise _unprocessable(("body",), str(e)) from None
        return _json_response(RunCodeResponse(
            status=result.status, message=result.message,
            compile_result=_command_json(result.compile_result), run_result=_command_json(result.run_result),
            executor_pod_name=pod_name,
            files={path: base64.b64encode(content).decode() for path, content in result.files.items()},
        ))

    def run_tests(request: RunTestsRequest, cancel: CancelToken | None) -> Response:
        check_language(request.language)
        spec = ProgramSpec(code=request.code, language=request.language,
                           compile_timeout_seconds=request.compile_timeout,
                           run_timeout_seconds=request.run_timeout, memory_limit_mb=request.memory_limit_MB,
                           files=_decode_files(request.files))
        cases = [TestCase(c.stdin, c.expected_stdout) for c in request.cases]
        try:
            result = runner.run_tests(spec, cases, cancel=cancel)
        except InvalidRequest as e:
            raise _unprocessable(("body",), str(e)) from None
        return _json_response(RunTestsResponse(
            status=result.status, message=result.message,
            compile_result=_command_json(result.compile_result),
            results=[TestCaseResultModel(passed=r.passed, run_result=_command_json(r.run_result))
                     for r in result.results],
            executor_pod_name=pod_name,
        ))

    def run_jupyter(request: RunJupyterRequest, cancel: CancelToken | None) -> Response:
        spec = JupyterSpec(cells=request.cells, cell_timeout_seconds=request.cell_timeout,
                           total_timeout_seconds=request.total_timeout, memory_limit_mb=request.memory_limit_MB,
                           files=_decode_files(request.files), fetch_files=request.fetch_files)
        try:
            result = runner.run_jupyter(spec, cancel=cancel)
        except InvalidRequest as e:
            raise _unprocessable(("body",), str(e)) from None
        return _json_response(RunJupyterResponse(
            status=result.status, message=result.message, driver=_command_json(result.driver),
            cells=[CellRunResult(stdout=c.stdout, stderr=c.stderr, display=c.display, error=c.error)
                   for c in result.cells],
            executor_pod_name=pod_name,
            files={path: base64.b64encode(content).decode() for path, content in result.files.items()},
        ))

    # FastAPI's routes (what the fast path does not take): no disconnect watch.
    @app.post("/run_code", response_model=RunCodeResponse, tags=["sandbox"])
    def run_code_route(request: RunCodeRequest) -> Response:
        return run_code(request, None)

    @app.post("/run_tests", response_model=RunTestsResponse, tags=["sandbox"])
    def run_tests_route(request: RunTestsRequest) -> Response:
        return run_tests(request, None)

    @app.post("/run_jupyter", name="Run Code in Jupyter", response_model=RunJupyterResponse, tags=["sandbox"])
    def run_jupyter_route(request: RunJupyterRequest) -> Response:
        return run_jupyter(request, None)

    @app.get("/v1/ping")
    def ping() -> str:
        return "pong"

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/livez")
    def livez() -> dict[str, str]:
        """Liveness (the chart's startup and liveness probes): the process serves; nothing else is checked."""
        return {"status": "ok"}

    @app.get("/readyz")
    def readyz() -> dict[str, str]:
        """Readiness of the HTTP API: it depends on nothing outside the pod, so serving is being ready. (The chart
        probes readiness over gRPC, the API the reward service calls.)"""
        return {"status": "ok"}

    @app.get("/v1/isolation")
    def isolation() -> dict:
        """What isolation every run gets on this host (see docs/sandbox.md)."""
        return dataclasses.asdict(runner.isolation)

    @app.get("/metrics")
    def prometheus_metrics() -> Response:
        if "PROMETHEUS_MULTIPROC_DIR" in os.environ:  # worker processes: sum every process's metrics
            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
            return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    # One handler thread per slot (base and elastic) and some more for requests waiting for one.
    return HotPathApp(app, {"/run_code": HotRoute(RunCodeRequest, run_code),
                            "/run_tests": HotRoute(RunTestsRequest, run_tests),
                            "/run_jupyter": HotRoute(RunJupyterRequest, run_jupyter)},
                      max_threads=runner.pool.max_slots + 32)
