"""Code answers, judged by the sandbox's test cases over gRPC (`everstep.v1.Sandbox/RunTests`).

One RunTests call per sample: the sandbox compiles once and runs every case; stdout is compared
by the sandbox's judge rules (line endings and trailing whitespace, per line and at the end, are
ignored). Two case forms:

- stdin/stdout: `CodeTest.stdin` is fed to the program, `expected_stdout` is the expected output.
- function call (interim encoding, see docs/reward.md): when `VerifierSpec.answer` is set it names
  the function (`name` or `Class.method`), each `CodeTest.stdin` holds the JSON arguments and
  `expected_stdout` the JSON return value (function_call.py).

The score is the fraction of cases passed, or 1/0 for all passed or not (`reward_mode`). A wrong
answer, a time limit, a crash and a compile error are scores (0 for that case or sample), not
errors; only a sandbox that cannot judge makes the part an error.
"""

from __future__ import annotations

import re
import threading
from enum import StrEnum

import grpc

from everstep.v1 import reward_pb2, sandbox_pb2, sandbox_pb2_grpc
from everstep_reward import metrics
from everstep_reward.verifiers.base import ErrorKind, VerifierResult
from everstep_reward.verifiers.function_call import function_call_program, parse_function_call_case

__all__ = ["CodeRewardMode", "CodeVerdict", "CodeVerifier", "extract_code", "verdict_of"]

_FENCE = re.compile(r"```[^\n`]*\n(.*?)```", re.DOTALL)
_TIME_LIMIT = "TimeLimitExceeded"
_FINISHED = "Finished"


class CodeRewardMode(StrEnum):
    FRACTION = "fraction"
    """Score = passed cases / all cases."""
    ALL_PASS = "all_pass"
    """Score = 1 when every case passed, else 0."""


class CodeVerdict(StrEnum):
    """A sample's verdict (the `verdict` label of everstep_reward_code_results_total)."""

    ACCEPTED = "accepted"
    WRONG_ANSWER = "wrong_answer"
    TIME_LIMIT = "time_limit"
    RUNTIME_ERROR = "runtime_error"
    COMPILE_ERROR = "compile_error"


def extract_code(response: str) -> str:
    """The last fenced code block of the response, or the whole response if it has none."""
    blocks = _FENCE.findall(response)
    return blocks[-1] if blocks else response


def verdict_of(reply: sandbox_pb2.RunTestsResponse) -> CodeVerdict:
    """Judge-style verdict: compile error first, else the first failing case decides."""
    if reply.HasField("compile_result") and (reply.compile_result.status != _FINISHED
                                             or reply.compile_result.return_code != 0):
        return CodeVerdict.COMPILE_ERROR
    for case in reply.results:
        if case.passed:
            continue
        run = case.run_result
        if run.status == _TIME_LIMIT:
            return CodeVerdict.TIME_LIMIT
        if run.status != _FINISHED or run.return_code != 0:
            return CodeVerdict.RUNTIME_ERROR
        return CodeVerdict.WRONG_ANSWER
    return CodeVerdict.ACCEPTED


class CodeVerifier:
    """Scores a response's last fenced code block by `spec.tests` run in `spec.language`."""

    name = "code"

    def __init__(self, sandbox_endpoint: str | None, *, timeout_seconds: float, run_timeout_seconds: float,
                 compile_timeout_seconds: float = 10.0,
                 reward_mode: CodeRewardMode = CodeRewardMode.FRACTION) -> None:
        self._endpoint = sandbox_endpoint
        self._timeout_seconds = timeout_seconds
        self._run_timeout_seconds = run_timeout_seconds
        self._compile_timeout_seconds = compile_timeout_seconds
        self._reward_mode = reward_mode
        self._lock = threading.Lock()
        self._channel: grpc.Channel | None = None
        self._stub: sandbox_pb2_grpc.SandboxStub | None = None

    def score(self, response: str, spec: reward_pb2.VerifierSpec) -> VerifierResult:
        if not spec.tests:
            return VerifierResult.failure(ErrorKind.INVALID_SPEC, "code verifier needs `tests`")
        if not spec.language:
            return VerifierResult.failure(ErrorKind.INVALID_SPEC, "code verifier needs `language`")
        try:
            code, cases = self._program(extract_code(response), spec)
        except ValueError as e:
            return VerifierResult.failure(ErrorKind.INVALID_SPEC, str(e))
        if not self._endpoint:
            return VerifierResult.failure(ErrorKind.SANDBOX_UNAVAILABLE,
                                          "no sandbox configured (start the reward service with --sandbox-endpoint)")
        request = sandbox_pb2.RunTestsRequest(code=code, language=spec.language, cases=cases,
                                              run_timeout=self._run_timeout_seconds,
                                              compile_timeout=self._compile_timeout_seconds)
        try:
            reply = self._sandbox().RunTests(request, timeout=self._timeout_seconds)
        except grpc.RpcError as e:
            return _rpc_failure(e, self._endpoint)
        if reply.status == "SandboxError":
            return VerifierResult.failure(ErrorKind.SANDBOX_ERROR, f"sandbox error: {reply.message}")
        if len(reply.results) != len(cases):
            return VerifierResult.failure(ErrorKind.SANDBOX_ERROR,
                                          f"sandbox returned {len(reply.results)} results for {len(cases)} cases")
        metrics.CODE_RESULTS.labels(spec.language, verdict_of(reply).value).inc()
        passed = sum(1 for result in reply.results if result.passed)
        if self._reward_mode == CodeRewardMode.ALL_PASS:
            return VerifierResult(1.0 if passed == len(cases) else 0.0)
        return VerifierResult(passed / len(cases))

    def close(self) -> None:
        with self._lock:
            if self._channel is not None:
                self._channel.close()
                self._channel = self._stub = None

    @staticmethod
    def _program(code: str, spec: reward_pb2.VerifierSpec) -> tuple[str, list[sandbox_pb2.TestCase]]:
        function_name = spec.answer.strip()
        if not function_name:
            return code, [sandbox_pb2.TestCase(stdin=t.stdin, expected_stdout=t.expected_stdout) for t in spec.tests]
        cases = []
        for index, test in enumerate(spec.tests):
            try:
                stdin, expected = parse_function_call_case(test.stdin, test.expected_stdout, spec.language)
            except ValueError as e:
                raise ValueError(f"function-call test {index}: {e}") from None
            cases.append(sandbox_pb2.TestCase(stdin=stdin, expected_stdout=expected))
        return function_call_program(code, spec.language, function_name), cases

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
