"""The SandboxFusion-compatible HTTP API of a real sandbox process."""

from __future__ import annotations

import base64

import httpx

# Field sets of SandboxFusion's RunCodeResponse and CommandRunResult (sandbox/server/sandbox_api.py).
RUN_CODE_RESPONSE_FIELDS = {"status", "message", "compile_result", "run_result", "executor_pod_name", "files"}
COMMAND_RESULT_FIELDS = {"status", "execution_time", "return_code", "stdout", "stderr"}


def run_code(client: httpx.Client, **request) -> dict:
    reply = client.post("/run_code", json=request)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert set(body) == RUN_CODE_RESPONSE_FIELDS
    for key in ("compile_result", "run_result"):
        assert body[key] is None or set(body[key]) == COMMAND_RESULT_FIELDS
    return body


def test_ping(client: httpx.Client) -> None:
    reply = client.get("/v1/ping")
    assert reply.status_code == 200 and reply.json() == "pong"


def test_python_success_shape(client: httpx.Client) -> None:
    body = run_code(client, code="print(input()[::-1])", language="python", stdin="abc")
    assert body["status"] == "Success" and body["message"] == ""
    assert body["compile_result"] is None
    run = body["run_result"]
    assert run["status"] == "Finished" and run["return_code"] == 0 and run["stdout"] == "cba\n"
    assert isinstance(run["execution_time"], float) and run["execution_time"] > 0
    assert isinstance(body["executor_pod_name"], str) and body["files"] == {}


def test_sandboxfusion_request_defaults_are_accepted(client: httpx.Client) -> None:
    # Exactly what a SandboxFusion client sends, all optional fields included.
    body = run_code(client, code="print(1)", language="python", compile_timeout=10, run_timeout=10,
                    memory_limit_MB=-1, stdin=None, files={}, fetch_files=[], args=[])
    assert body["status"] == "Success"


def test_compile_error_is_failed_with_null_run_result(client: httpx.Client) -> None:
    body = run_code(client, code="int main() { nope }", language="cpp")
    assert body["status"] == "Failed"
    assert body["run_result"] is None
    assert body["compile_result"]["status"] == "Finished" and body["compile_result"]["return_code"] != 0


def test_runtime_error_and_timeout_are_failed(client: httpx.Client) -> None:
    body = run_code(client, code="import sys; sys.exit(2)", language="python")
    assert body["status"] == "Failed" and body["run_result"]["return_code"] == 2
    body = run_code(client, code="sleep 10", language="bash", run_timeout=0.3)
    assert body["status"] == "Failed"
    assert body["run_result"]["status"] == "TimeLimitExceeded" and body["run_result"]["return_code"] is None


def test_files_round_trip_as_base64(client: httpx.Client) -> None:
    files = {"in.bin": base64.b64encode(b"\x00\x01payload").decode()}
    code = "data = open('in.bin', 'rb').read()\nopen('out.bin', 'wb').write(data[::-1])"
    body = run_code(client, code=code, language="python", files=files, fetch_files=["out.bin"])
    assert body["status"] == "Success"
    assert base64.b64decode(body["files"]["out.bin"]) == b"daolyap\x01\x00"


def test_unknown_language_is_422(client: httpx.Client) -> None:
    reply = client.post("/run_code", json={"code": "x", "language": "cobol"})
    assert reply.status_code == 422
    assert "cobol" in reply.text


def test_missing_code_is_422(client: httpx.Client) -> None:
    assert client.post("/run_code", json={"language": "python"}).status_code == 422


def test_run_tests_over_http(client: httpx.Client) -> None:
    request = {"code": "print(int(input()) * 2)", "language": "python",
               "cases": [{"stdin": "2", "expected_stdout": "4"}, {"stdin": "3", "expected_stdout": "7"}]}
    reply = client.post("/run_tests", json=request)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["status"] == "Failed"
    assert [r["passed"] for r in body["results"]] == [True, False]
    assert body["results"][1]["run_result"]["stdout"] == "6\n"


def test_healthz_and_metrics(client: httpx.Client) -> None:
    run_code(client, code="print(1)", language="python")
    run_code(client, code="int main() { return 0; }", language="c")
    assert client.get("/healthz").status_code == 200
    text = client.get("/metrics").text
    assert 'everstep_sandbox_requests_total{language="python",status="Success"}' in text
    assert 'everstep_sandbox_compile_cache_total{language="c",result=' in text
    for name in ("everstep_sandbox_run_seconds_bucket", "everstep_sandbox_inflight_requests",
                 "everstep_sandbox_queue_depth"):
        assert name in text


def test_isolation_report(client: httpx.Client) -> None:
    report = client.get("/v1/isolation").json()
    assert set(report) == {"bubblewrap", "distinct_uid", "cgroups", "seccomp", "warnings"}
    assert report["cgroups"] in ("v1", "v2", "none")
    # A degraded mechanism is always explained.
    degraded = not report["bubblewrap"] or not report["seccomp"] or report["cgroups"] == "none"
    assert bool(report["warnings"]) == (degraded or not report["distinct_uid"])


def test_sandboxfusion_language_identifiers(client: httpx.Client) -> None:
    body = run_code(client, code="console.log([1, 2].map(x => x * 2).join(' '))", language="nodejs")
    assert body["status"] == "Success" and body["run_result"]["stdout"] == "2 4\n"
    body = run_code(client, code='puts "ruby"', language="ruby")
    assert body["run_result"]["stdout"] == "ruby\n"
