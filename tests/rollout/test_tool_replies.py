"""What a tool call gets back, as docs/tools.md says, through the engine's own tool loop (`ToolSession` on the
`ToolRuntime`'s threads) with real tools: an HTTP environment served here and the python tool in a sandbox service
process. The model's turn is given as tokens of a byte-level tokenizer with Qwen2.5's template."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from tool_fixtures import make_byte_level_tokenizer, python_call_text

from everstep.settings.tools import ToolSettings
from everstep.tools.error_kind import tool_error_kind_name
from everstep.v1 import common_pb2
from everstep_rollout.tools import ToolRuntime, ToolSession

SEARCH = {"type": "function", "function": {"name": "search", "description": "Search the index.", "parameters": {
    "type": "object",
    "properties": {
        "q": {"type": "string"},
        "mode": {"enum": ["fast", "exact"]},
        "filters": {"type": "object", "properties": {"lang": {"type": "string"}}, "required": ["lang"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "since": {"type": "string", "format": "date"},
    },
    "required": ["q"],
}}}


class Environment(ThreadingHTTPServer):
    """An HTTP environment (docs/tools.md's contract) whose /step answers what a test sets: status and raw body."""

    step_status = 200
    step_body = b'{"observation": "ok"}'

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.steps: list[dict] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    server: Environment

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        status, answer = 200, b"{}"
        if self.path == "/reset":
            answer = b'{"session": "s1"}'
        elif self.path == "/step":
            self.server.steps.append(body)
            status, answer = self.server.step_status, self.server.step_body
        self.send_response(status)
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def environment() -> Iterator[Environment]:
    server = Environment()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    return make_byte_level_tokenizer(tmp_path_factory.mktemp("tokenizer"), [
        '{"name": "search", "arguments": {"q": "cats"}}', "print('partial')", "Traceback ZeroDivisionError",
        "cats cats cats cats"])


@pytest.fixture(scope="module")
def runtime() -> Iterator[ToolRuntime]:
    tools = ToolRuntime()
    yield tools
    tools.shutdown()


def call_once(tokenizer, runtime: ToolRuntime, settings: ToolSettings, call_text: str,
              sandbox_address: str = "") -> common_pb2.ToolCall:
    """One model turn that ends with `call_text`, its call run as the engine runs it; the call's record."""
    session = ToolSession(settings, runtime.client(settings, sandbox_address), tokenizer, common_pb2.ToolTrajectory(),
                          turn_start=0)
    turn = tokenizer.encode(call_text, add_special_tokens=False) + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    assert session.end_turn(turn, runtime.submit), "the turn's call was submitted"
    session.pending.result(timeout=60)
    end = session.take_reply(turn)
    assert not end.finished and end.reply_ids, "the reply follows the turn"
    (record,) = session.trajectory.calls
    return record


def search_call(arguments: dict) -> str:
    return f'<tool_call>\n{json.dumps({"name": "search", "arguments": arguments})}\n</tool_call>'


def http_tools(environment: Environment, **limits) -> ToolSettings:
    return ToolSettings(environment="http", url=environment.url, functions=[SEARCH], **limits)


@pytest.mark.parametrize(("arguments", "reply"), [
    ({"q": 3}, "error: search: arguments.q: 3 is not of type 'string'"),
    ({"mode": "fast"}, "error: search: arguments: 'q' is a required property"),
    ({"q": "cats", "mode": "slow"}, "error: search: arguments.mode: 'slow' is not one of ['fast', 'exact']"),
    ({"q": "cats", "filters": {"lang": 1}}, "error: search: arguments.filters.lang: 1 is not of type 'string'"),
    ({"q": "cats", "filters": {}}, "error: search: arguments.filters: 'lang' is a required property"),
    ({"q": "cats", "tags": ["a", 2]}, "error: search: arguments.tags[1]: 2 is not of type 'string'"),
    ({"q": "cats", "since": "04/12/2026"}, "error: search: arguments.since: '04/12/2026' is not a 'date'"),
], ids=["type", "required", "enum", "nested-type", "nested-required", "array-items", "format"])
def test_arguments_that_do_not_fit_the_schema_go_back_as_bad_arguments(tokenizer, runtime: ToolRuntime,
                                                                       environment: Environment, arguments: dict,
                                                                       reply: str) -> None:
    record = call_once(tokenizer, runtime, http_tools(environment), search_call(arguments))
    assert record.error == common_pb2.TOOL_ERROR_KIND_BAD_ARGUMENTS and tool_error_kind_name(record.error) == \
        "bad_arguments"
    assert record.reply == reply
    assert environment.steps == [], "the environment never sees a call that does not fit"


def test_arguments_that_fit_reach_the_environment(tokenizer, runtime: ToolRuntime, environment: Environment) -> None:
    arguments = {"q": "cats", "mode": "exact", "filters": {"lang": "en"}, "tags": ["a"], "since": "2026-12-04"}
    record = call_once(tokenizer, runtime, http_tools(environment), search_call(arguments))
    assert record.error == common_pb2.TOOL_ERROR_KIND_UNSPECIFIED and record.reply == "ok"
    assert environment.steps == [{"session": "s1", "call_index": 0, "name": "search", "arguments": arguments}]


@pytest.mark.parametrize(("status", "body", "kind", "reply"), [
    (200, b"<html>hello</html>", "environment",
     "error: the environment failed: Expecting value: line 1 column 1 (char 0)"),
    (200, b'["ok"]', "environment", "error: the environment failed: /step answered list, not a JSON object"),
    (200, b"", "none", ""),
    (500, b"the index is down", "environment", "error: the index is down"),
    (200, b'{"observation": {"hits": 2}}', "none", '{"hits": 2}'),
], ids=["not-json", "not-an-object", "empty-body", "http-error", "object-observation"])
def test_what_an_environments_answer_becomes(tokenizer, runtime: ToolRuntime, environment: Environment, status: int,
                                             body: bytes, kind: str, reply: str) -> None:
    """docs/tools.md's contract: a 200 whose body is not a JSON object is an `environment` error, an empty body
    counts as {}, an HTTP error status is an `environment` error with its body, a non-string observation is sent as
    JSON."""
    environment.step_status, environment.step_body = status, body
    record = call_once(tokenizer, runtime, http_tools(environment), search_call({"q": "cats"}))
    assert tool_error_kind_name(record.error) == kind and record.reply == reply


@pytest.mark.parametrize("num_tokens", [8, 9, 40])
def test_the_truncation_marker_comes_after_the_cut_and_does_not_count(tokenizer, runtime: ToolRuntime,
                                                                      environment: Environment,
                                                                      num_tokens: int) -> None:
    """`max_tool_reply_tokens: 8`: a reply of 8 tokens stays whole; a longer one keeps its first 8 tokens' text and
    then `\\n[truncated: K more tokens]` (K: the tokens cut), so a cut reply is 8 tokens plus the marker's."""
    observation = " ".join(["cats"] * num_tokens)
    offsets = tokenizer(observation, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    assert len(offsets) == num_tokens, "one token per word"
    environment.step_body = json.dumps({"observation": observation}).encode()
    record = call_once(tokenizer, runtime, http_tools(environment, max_tool_reply_tokens=8), search_call({"q": "cats"}))
    if num_tokens == 8:
        assert record.reply == observation and not record.truncated
        return
    kept = " ".join(["cats"] * 8)
    assert record.reply == f"{kept}\n[truncated: {num_tokens - 8} more tokens]" and record.truncated
    assert len(tokenizer.encode(record.reply, add_special_tokens=False)) > 8


@pytest.mark.parametrize(("code", "reply_start", "reply_end"), [
    ("print('partial')\nraise SystemExit(3)", "partial\n", "partial\n(exit code 3)"),
    ("print('partial')\n1 / 0", "partial\nTraceback (most recent call last):",
     "ZeroDivisionError: division by zero\n(exit code 1)"),
    ("print('fine')", "fine\n", "fine\n"),
], ids=["exit-3", "exception", "success"])
def test_a_failing_program_replies_with_its_output_and_exit_code_and_no_error_kind(
        tokenizer, runtime: ToolRuntime, sandbox_address: str, code: str, reply_start: str, reply_end: str) -> None:
    """The python tool: stdout, then stderr, then `(exit code N)` when the program failed; a failing program is the
    model's business (kind `none`), not a tool error."""
    record = call_once(tokenizer, runtime, ToolSettings(environment="python", tool_timeout_seconds=30,
                                                                max_tool_reply_tokens=4096),
                       python_call_text(code), sandbox_address)
    assert tool_error_kind_name(record.error) == "none"
    assert record.reply.startswith(reply_start) and record.reply.endswith(reply_end), record.reply


def test_the_test_tokenizer_reads_a_python_call(tokenizer) -> None:
    """The byte-level tokenizer gives the call's text back (the other tests rely on it)."""
    text = python_call_text("print('partial')")
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False), skip_special_tokens=False) == text
