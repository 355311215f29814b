"""gRPC `everstep.v1.Sandbox`: the same runner as the HTTP API, for batch use inside the platform."""

from __future__ import annotations

import grpc

from everstep.v1 import sandbox_pb2, sandbox_pb2_grpc
from everstep_sandbox.cancel import CancelToken
from everstep_sandbox.process import CommandResult
from everstep_sandbox.runner import InvalidRequest, ProgramSpec, SandboxRunner, TestCase

__all__ = ["SandboxServicer"]


def _command_pb(result: CommandResult | None) -> sandbox_pb2.CommandResult | None:
    if result is None:
        return None
    # proto3 has no null: a missing return code (timeout, error) reads as 0 next to its status.
    return sandbox_pb2.CommandResult(
        status=result.status.value, execution_time=result.execution_time or 0.0,
        return_code=result.return_code or 0, stdout=result.stdout, stderr=result.stderr,
    )


def _cancel_on_termination(context: grpc.ServicerContext) -> CancelToken:
    """A token that fires when the RPC ends: a cancelled call (client gone) drops its request. After a
    normal end it fires too, harmlessly: the request is already done."""
    token = CancelToken()
    context.add_callback(token.cancel)
    return token


class SandboxServicer(sandbox_pb2_grpc.SandboxServicer):
    def __init__(self, runner: SandboxRunner, pod_name: str) -> None:
        self._runner = runner
        self._pod_name = pod_name

    def RunCode(self, request: sandbox_pb2.RunCodeRequest, context: grpc.ServicerContext
                ) -> sandbox_pb2.RunCodeResponse:
        spec = ProgramSpec(code=request.code, language=request.language,
                           compile_timeout_seconds=request.compile_timeout,
                           run_timeout_seconds=request.run_timeout, memory_limit_mb=request.memory_limit_mb,
                           files=dict(request.files))
        try:
            result = self._runner.run_code(spec, stdin=request.stdin, fetch_files=list(request.fetch_files),
                                           cancel=_cancel_on_termination(context))
        except InvalidRequest as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return sandbox_pb2.RunCodeResponse(
            status=result.status.value, message=result.message,
            compile_result=_command_pb(result.compile_result), run_result=_command_pb(result.run_result),
            executor_pod_name=self._pod_name, files=result.files,
        )

    def RunTests(self, request: sandbox_pb2.RunTestsRequest, context: grpc.ServicerContext
                 ) -> sandbox_pb2.RunTestsResponse:
        spec = ProgramSpec(code=request.code, language=request.language,
                           compile_timeout_seconds=request.compile_timeout,
                           run_timeout_seconds=request.run_timeout, memory_limit_mb=request.memory_limit_mb)
        cases = [TestCase(c.stdin, c.expected_stdout) for c in request.cases]
        try:
            result = self._runner.run_tests(spec, cases, cancel=_cancel_on_termination(context))
        except InvalidRequest as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return sandbox_pb2.RunTestsResponse(
            status=result.status.value, message=result.message,
            compile_result=_command_pb(result.compile_result),
            results=[sandbox_pb2.TestCaseResult(passed=r.passed, run_result=_command_pb(r.run_result))
                     for r in result.results],
        )
