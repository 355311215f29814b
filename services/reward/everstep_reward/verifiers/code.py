"""Code answers, judged by the sandbox's test cases over gRPC (`everstep.v1.Sandbox/RunTests`).

One RunTests call per sample: the sandbox compiles once and runs every case; stdout is compared
by the sandbox's judge rules (line endings and trailing whitespace, per line and at the end, are
ignored). Two case forms:

- stdin/stdout (`VerifierSpec.tests`): `stdin` is fed to the program, `expected_stdout` is the
  expected output.
- function call (`VerifierSpec.function_tests` with `function_name`, python and nodejs): each
  case calls the function with JSON arguments and compares its return value as JSON; the code is
  wrapped in a driver program (function_call.py), so the cases still share one compile.
A sample has cases of one form: the two would be two programs.

The score is the fraction of cases passed, or 1/0 for all passed or not (`reward_mode`). A wrong
answer, a time limit, a crash and a compile error are scores (0 for that case or sample), not
errors; only a sandbox that cannot judge makes the part an error.
"""

from __future__ import annotations

import re
import threading
from enum import StrEnum

import grpc
from pydantic import Field

from everstep.transport import channels
from everstep.v1 import reward_pb2, sandbox_pb2, sandbox_pb2_grpc
from everstep_reward import metrics
from everstep_reward.verifiers.base import VerifierResult
from everstep_reward.verifiers.function_call import function_call_program, parse_function_call_case
from everstep_reward.verifiers.params import SpecError, VerifierParams, read_params

__all__ = ["CodeParams", "CodeRewardMode", "CodeVerdict", "CodeVerifier", "extract_code", "verdict_of"]

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


class CodeParams(VerifierParams):
    """The code verifier's options (service flags give the defaults; `VerifierSpec.params` per item)."""

    reward_mode: CodeRewardMode = Field(CodeRewardMode.FRACTION,
                                        description="fraction: passed cases / all cases; all_pass: 1 or 0.")
    run_timeout_seconds: float = Field(5.0, gt=0, description="Sandbox run limit per test case.")
    compile_timeout_seconds: float = Field(10.0, gt=0, description="Sandbox compile limit per sample.")
    memory_limit_mb: int = Field(0, ge=0, description="Sandbox memory limit per run (0: the sandbox's default).")


class CodeVerifier:
    """Scores a response's last fenced code block by the spec's test cases, run in `spec.language`."""

    name = "code"
    params_model = CodeParams

    def __init__(self, sandbox_endpoint: str | None, *, timeout_seconds: float,
                 defaults: CodeParams | None = None) -> None:
        """`timeout_seconds`: limit of one RunTests call (compile and every case)."""
        self._endpoint = sandbox_endpoint
        self._timeout_seconds = timeout_seconds
        self._defaults = defaults or CodeParams()
        self._lock = threading.Lock()
        self._channel: grpc.Channel | None = None
        self._stub: sandbox_pb2_grpc.SandboxStub | None = None

    def score(self, item: reward_pb2.RewardItem, spec: reward_pb2.VerifierSpec) -> VerifierResult:
        params = read_params(spec, self._defaults)
        if not spec.language:
            raise SpecError("`language` is empty (the sandbox language of the code, e.g. python)")
        code, cases = self._program(extract_code(item.response), spec)
        if not self._endpoint:
            return VerifierResult.failure(reward_pb2.REWARD_ERROR_KIND_SANDBOX_UNAVAILABLE,
                                          "no sandbox configured (start the reward service with --sandbox-endpoint)")
        request = sandbox_pb2.RunTestsRequest(code=code, language=spec.language, cases=cases,
                                              run_timeout=params.run_timeout_seconds,
                                              compile_timeout=params.compile_timeout_seconds,
                                              memory_limit_mb=params.memory_limit_mb)
        try:
            reply = self._sandbox().RunTests(request, timeout=self._timeout_seconds)
        except grpc.RpcError as e:
            return _rpc_failure(e, self._endpoint)
        if reply.status == "SandboxError":
            return VerifierResult.failure(reward_pb2.REWARD_ERROR_KIND_SANDBOX_ERROR, f"sandbox error: {reply.message}")
        if len(reply.results) != len(cases):
            return VerifierResult.failure(reward_pb2.REWARD_ERROR_KIND_SANDBOX_ERROR,
                                          f"sandbox returned {len(reply.results)} results for {len(cases)} cases")
        metrics.CODE_RESULTS.labels(spec.language, verdict_of(reply).value).inc()
        passed = sum(1 for result in reply.results if result.passed)
        if params.reward_mode == CodeRewardMode.ALL_PASS:
            return VerifierResult(1.0 if passed == len(cases) else 0.0)
        return VerifierResult(passed / len(cases))

    def close(self) -> None:
        with self._lock:
            if self._channel is not None:
                self._channel.close()
                self._channel = self._stub = None

    @staticmethod
    def _program(code: str, spec: reward_pb2.VerifierSpec) -> tuple[str, list[sandbox_pb2.TestCase]]:
        """The program to run and its stdin/stdout cases; SpecError for cases that cannot be run."""
        if spec.tests and spec.function_tests:
            raise SpecError("set `tests` (stdin/stdout) or `function_tests`, not both: one sample is one program")
        if spec.tests:
            if spec.function_name:
                raise SpecError("`function_name` is set but the cases are stdin/stdout `tests`")
            return code, [sandbox_pb2.TestCase(stdin=t.stdin, expected_stdout=t.expected_stdout) for t in spec.tests]
        if not spec.function_tests:
            raise SpecError("no test cases: set `tests` (stdin/stdout) or `function_tests` with `function_name`")
        if not spec.function_name:
            raise SpecError("`function_name` is empty (the function that `function_tests` call)")
        cases = []
        for index, test in enumerate(spec.function_tests):
            try:
                stdin, expected = parse_function_call_case(test.arguments_json, test.expected_json, spec.language)
            except ValueError as e:
                raise SpecError(f"function_tests[{index}]: {e}") from None
            cases.append(sandbox_pb2.TestCase(stdin=stdin, expected_stdout=expected))
        try:
            return function_call_program(code, spec.language, spec.function_name), cases
        except ValueError as e:
            raise SpecError(str(e)) from None

    def _sandbox(self) -> sandbox_pb2_grpc.SandboxStub:
        with self._lock:
            if self._stub is None:
                assert self._endpoint
                self._channel = channels.balanced_channel(self._endpoint)
                self._stub = sandbox_pb2_grpc.SandboxStub(self._channel)
            return self._stub


def _rpc_failure(error: grpc.RpcError, endpoint: str) -> VerifierResult:
    code = error.code() if isinstance(error, grpc.Call) else None
    details = error.details() if isinstance(error, grpc.Call) else str(error)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return VerifierResult.failure(reward_pb2.REWARD_ERROR_KIND_TIMEOUT, "timeout")
    if code == grpc.StatusCode.UNAVAILABLE:
        return VerifierResult.failure(reward_pb2.REWARD_ERROR_KIND_SANDBOX_UNAVAILABLE,
                                      f"sandbox at {endpoint} unreachable: {details}")
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return VerifierResult.failure(reward_pb2.REWARD_ERROR_KIND_INVALID_SPEC,
                                      f"sandbox rejected the request: {details}")
    return VerifierResult.failure(reward_pb2.REWARD_ERROR_KIND_SANDBOX_ERROR,
                                  f"sandbox call failed ({code}): {details}")
