"""gRPC `everstep.v1.Sandbox` of a real sandbox process."""

from __future__ import annotations

import grpc
import pytest

from everstep.v1 import sandbox_pb2, sandbox_pb2_grpc

ADD_ONE_CPP = "#include <iostream>\nint main() { long x; std::cin >> x; std::cout << x + 1 << '\\n'; }"


@pytest.fixture(scope="module")
def stub(sandbox_service) -> sandbox_pb2_grpc.SandboxStub:
    with grpc.insecure_channel(sandbox_service.grpc_address) as channel:
        yield sandbox_pb2_grpc.SandboxStub(channel)


def test_run_tests_python(stub: sandbox_pb2_grpc.SandboxStub) -> None:
    cases = [sandbox_pb2.TestCase(stdin=f"{i}\n", expected_stdout=f"{i * i}\n") for i in range(4)]
    reply = stub.RunTests(sandbox_pb2.RunTestsRequest(code="n = int(input())\nprint(n * n)", language="python",
                                                      cases=cases), timeout=30)
    assert reply.status == "Success"
    assert [r.passed for r in reply.results] == [True] * 4
    assert all(r.run_result.status == "Finished" for r in reply.results)


def test_run_tests_cpp_partial_pass(stub: sandbox_pb2_grpc.SandboxStub) -> None:
    cases = [sandbox_pb2.TestCase(stdin="1", expected_stdout="2"), sandbox_pb2.TestCase(stdin="1", expected_stdout="3")]
    reply = stub.RunTests(sandbox_pb2.RunTestsRequest(code=ADD_ONE_CPP, language="cpp", cases=cases), timeout=60)
    assert reply.status == "Failed"
    assert reply.compile_result.status == "Finished" and reply.compile_result.return_code == 0
    assert [r.passed for r in reply.results] == [True, False]


def test_run_tests_timeout_case_fails(stub: sandbox_pb2_grpc.SandboxStub) -> None:
    cases = [sandbox_pb2.TestCase(stdin="", expected_stdout="")]
    reply = stub.RunTests(sandbox_pb2.RunTestsRequest(code="while True: pass", language="python", cases=cases,
                                                      run_timeout=0.3), timeout=30)
    assert reply.status == "Failed"
    assert reply.results[0].run_result.status == "TimeLimitExceeded" and not reply.results[0].passed


def test_run_code_with_files(stub: sandbox_pb2_grpc.SandboxStub) -> None:
    reply = stub.RunCode(sandbox_pb2.RunCodeRequest(
        code="open('b.txt', 'w').write(open('a.txt').read() * 2)", language="python",
        files={"a.txt": b"xy"}, fetch_files=["b.txt"]), timeout=30)
    assert reply.status == "Success"
    assert not reply.HasField("compile_result")
    assert reply.files["b.txt"] == b"xyxy"


def test_unknown_language_is_invalid_argument(stub: sandbox_pb2_grpc.SandboxStub) -> None:
    with pytest.raises(grpc.RpcError) as error:
        stub.RunCode(sandbox_pb2.RunCodeRequest(code="x", language="cobol"), timeout=10)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_sigterm_stops_with_exit_code_zero(service_process) -> None:
    sandbox = service_process("sandbox")
    sandbox.stop()
    assert sandbox.process.returncode == 0, sandbox.log()
