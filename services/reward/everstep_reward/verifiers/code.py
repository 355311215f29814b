"""Code answers, judged by the sandbox's test cases over gRPC (`everstep.v1.Sandbox/RunTests`)."""

from __future__ import annotations

import re
import threading

import grpc

from everstep.v1 import reward_pb2, sandbox_pb2, sandbox_pb2_grpc
from everstep_reward.verifiers.base import ErrorKind, VerifierResult

__all__ = ["CodeVerifier", "extract_code"]

_FENCE = re.compile(r"```[^\n`]*\n(.*?)```", re.DOTALL)


def extract_code(response: str) -> str:
    """The last fenced code block of the response, or the whole response if it has none."""
    blocks = _FENCE.findall(response)
    return blocks[-1] if blocks else response


class CodeVerifier:
    """Score = fraction of `spec.tests` whose expected stdout the program reproduces."""

    name = "code"

    def __init__(self, sandbox_endpoint: str | None, *, timeout_seconds: float,
                 run_timeout_seconds: float) -> None:
        self._endpoint = sandbox_endpoint
        self._timeout_seconds = timeout_seconds
        self._run_timeout_seconds = run_timeout_seconds
        self._lock = threading.Lock()
        self._channel: grpc.Channel | None = None
        self._stub: sandbox_pb2_grpc.SandboxStub | None = None

    def score(self, response: str, spec: reward_pb2.VerifierSpec) -> VerifierResult:
        if not spec.tests:
            return VerifierResult.failure(ErrorKind.INVALID_SPEC, "code verifier needs `tests`")
        if not spec.language:
            return VerifierResult.failure(ErrorKind.INVALID_SPEC, "code verifier needs `language`")
        if not self._endpoint:
            return VerifierResult.failure(ErrorKind.SANDBOX_UNAVAILABLE,
                                          "no sandbox configured (start the reward service with --sandbox-endpoint)")
        request = sandbox_pb2.RunTestsRequest(
            code=extract_code(response), language=spec.language, run_timeout=self._run_timeout_seconds,
            cases=[sandbox_pb2.TestCase(stdin=t.stdin, expected_stdout=t.expected_stdout) for t in spec.tests],
        )
        try:
            reply = self._sandbox().RunTests(request, timeout=self._timeout_seconds)
        except grpc.RpcError as e:
            return _rpc_failure(e, self._endpoint)
        if reply.status == "SandboxError":
            return VerifierResult.failure(ErrorKind.SANDBOX_ERROR, f"sandbox error: {reply.message}")
        passed = sum(1 for result in reply.results if result.passed)
        return VerifierResult(passed / len(spec.tests))

    def close(self) -> None:
        with self._lock:
            if self._channel is not None:
                self._channel.close()
                self._channel = self._stub = None

    def _sandbox(self) -> sandbox_pb2_grpc.SandboxStub:
        with self._lock:
            if self._stub is None:
                assert self._endpoint
                self._channel = grpc.insecure_channel(self._endpoint)
                self._stub = sandbox_pb2_grpc.SandboxStub(self._channel)
            return self._stub


def _rpc_failure(error: grpc.RpcError, endpoint: str) -> VerifierResult:
    code = error.code() if isinstance(error, grpc.Call) else None
    details = error.details() if isinstance(error, grpc.Call) else str(error)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return VerifierResult.failure(ErrorKind.TIMEOUT, "timeout")
    if code == grpc.StatusCode.UNAVAILABLE:
        return VerifierResult.failure(ErrorKind.SANDBOX_UNAVAILABLE, f"sandbox at {endpoint} unreachable: {details}")
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return VerifierResult.failure(ErrorKind.INVALID_SPEC, f"sandbox rejected the request: {details}")
    return VerifierResult.failure(ErrorKind.SANDBOX_ERROR, f"sandbox call failed ({code}): {details}")
