"""Scoring in-process: weights, errors that never crash and never hide as zeros, format rule."""

from __future__ import annotations

import socket

import pytest

from everstep.reward_error_kind import error_kind_label
from everstep.v1 import reward_pb2
from everstep_reward.scoring import RewardScorer
from everstep_reward.verifiers import VerifierRegistry
from everstep_reward.verifiers.code import CodeParams, CodeVerifier, extract_code
from everstep_reward.verifiers.format import FormatRules, FormatVerifier, find_format_violation


def make_scorer(sandbox_endpoint: str | None = None) -> RewardScorer:
    code = CodeVerifier(sandbox_endpoint, timeout_seconds=5, defaults=CodeParams(run_timeout_seconds=2))
    return RewardScorer(VerifierRegistry([FormatVerifier(), code]), max_concurrent_items=4)


def item(response: str, *verifiers: reward_pb2.VerifierSpec, item_id: str = "a") -> reward_pb2.RewardItem:
    return reward_pb2.RewardItem(id=item_id, response=response, verifiers=verifiers)


def test_reward_is_weighted_sum_of_parts() -> None:
    result = make_scorer().score_item(item(
        "<think>hmm</think> \\boxed{ 3 }",
        reward_pb2.VerifierSpec(name="format", weight=0.25), reward_pb2.VerifierSpec(name="format", weight=2.0)))
    assert result.error == ""
    assert [p.score for p in result.parts] == [1.0, 1.0]
    assert result.reward == pytest.approx(2.25)


def test_unknown_verifier_is_an_item_error() -> None:
    result = make_scorer().score_item(item(
        "\\boxed{ 3 }", reward_pb2.VerifierSpec(name="format", weight=1.0),
        reward_pb2.VerifierSpec(name="astrology", weight=1.0)))
    assert result.parts[1].error.startswith("unknown verifier 'astrology'")
    assert error_kind_label(result.parts[1].error_kind) == "unknown_verifier"
    assert result.parts[0].error_kind == reward_pb2.REWARD_ERROR_KIND_UNSPECIFIED
    assert "astrology" in result.error
    assert result.parts[0].error == "" and result.reward == 1.0


def test_item_without_verifiers_is_an_error() -> None:
    assert make_scorer().score_item(item("x")).error == "`verifiers` is empty: the item names no verifier"


STDIN_TESTS = [reward_pb2.CodeTest(stdin="", expected_stdout="1")]
CALL_TESTS = [reward_pb2.FunctionCallTest(arguments_json="[1]", expected_json="1")]


def code_spec(**fields: object) -> reward_pb2.VerifierSpec:
    params = fields.pop("params", {})
    spec = reward_pb2.VerifierSpec(name="code", weight=1, **fields)
    spec.params.update(params)
    return spec


@pytest.mark.parametrize(("spec", "message"), [
    (code_spec(language="python"), "no test cases: set `tests` (stdin/stdout) or `function_tests`"),
    (code_spec(tests=STDIN_TESTS), "`language` is empty"),
    (code_spec(language="python", tests=STDIN_TESTS, function_tests=CALL_TESTS, function_name="f"), "not both"),
    (code_spec(language="python", function_tests=CALL_TESTS), "`function_name` is empty"),
    (code_spec(language="python", tests=STDIN_TESTS, function_name="f"), "`function_name` is set but"),
    (code_spec(language="python", function_name="f", function_tests=[
        reward_pb2.FunctionCallTest(arguments_json="[1]", expected_json="1"),
        reward_pb2.FunctionCallTest(arguments_json="1, 2", expected_json="3")]),
     "function_tests[1]: `arguments_json` is not JSON"),
    (code_spec(language="cpp", function_name="f", function_tests=CALL_TESTS), "support python, nodejs, not 'cpp'"),
    (code_spec(language="python", function_name="os.system('x')", function_tests=CALL_TESTS), "`function_name`"),
    (code_spec(language="python", tests=STDIN_TESTS, params={"reward_mode": "most"}), "params.reward_mode:"),
    (code_spec(language="python", tests=STDIN_TESTS, params={"run_timeout_seconds": 0}),
     "params.run_timeout_seconds:"),
    (code_spec(language="python", tests=STDIN_TESTS, params={"timeout": 3}), "params.timeout: unknown option"),
])
def test_code_spec_errors_name_the_field(spec: reward_pb2.VerifierSpec, message: str) -> None:
    result = make_scorer("127.0.0.1:1").score_item(item("```python\nprint(1)\n```", spec))
    assert message in result.parts[0].error and message in result.error
    kind = "invalid_params" if message.startswith("params.") else "invalid_spec"  # the job's options, or the row's
    assert error_kind_label(result.parts[0].error_kind) == kind and result.reward == 0.0


def test_code_verifier_errors_are_reported() -> None:
    scorer = make_scorer()
    tests = STDIN_TESTS
    no_sandbox = scorer.score_item(item("print(1)", reward_pb2.VerifierSpec(name="code", weight=1,
                                                                            language="python", tests=tests)))
    assert "--sandbox-endpoint" in no_sandbox.parts[0].error


def test_unreachable_sandbox_is_an_item_error(free_port: int) -> None:
    tests = [reward_pb2.CodeTest(stdin="", expected_stdout="1")]
    result = make_scorer(f"127.0.0.1:{free_port}").score_item(
        item("print(1)", reward_pb2.VerifierSpec(name="code", weight=1, language="python", tests=tests)))
    assert "unreachable" in result.parts[0].error and result.error
    assert result.reward == 0.0


def test_a_sandbox_that_never_answers_is_a_counted_timeout() -> None:
    from prometheus_client import REGISTRY

    def timeouts() -> float:
        return REGISTRY.get_sample_value("everstep_reward_timeouts_total", {"verifier": "code"}) or 0.0

    with socket.socket() as silent:  # accepts connections, never speaks: a hung sandbox
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        code = CodeVerifier(f"127.0.0.1:{silent.getsockname()[1]}", timeout_seconds=0.5)
        before = timeouts()
        result = RewardScorer(VerifierRegistry([code]), max_concurrent_items=1).score_item(
            item("print(1)", code_spec(language="python", tests=STDIN_TESTS)))
        code.close()
    assert error_kind_label(result.parts[0].error_kind) == "timeout" and result.error == "code: timeout"
    assert timeouts() == before + 1


def test_score_batch_yields_every_item_once() -> None:
    items = [item(f"\\boxed{{ {i} }}" if i % 2 else "none", reward_pb2.VerifierSpec(name="format", weight=1.0),
                  item_id=str(i)) for i in range(20)]
    results = {r.id: r for r in make_scorer().score_batch(items)}
    assert sorted(results, key=int) == [str(i) for i in range(20)]
    assert all(results[str(i)].reward == (1.0 if i % 2 else 0.0) for i in range(20))


@pytest.mark.parametrize(("response", "ok"), [
    ("\\boxed{ 13 }", True),
    ("<think> 12 + 1 </think> so \\boxed{ 13 }", True),
    ("<think> \\boxed{ 13 }", False),
    ("<think> \\boxed{ 13 } </think>", False),
    ("</think> <think> \\boxed{ 1 }", False),
    ("the answer is 13", False),
    ("\\boxed{}", False),
])
def test_format_rule(response: str, ok: bool) -> None:
    assert (find_format_violation(response, FormatRules()) is None) is ok


def test_extract_code_takes_last_fenced_block() -> None:
    response = "try:\n```python\nprint(0)\n```\nbetter:\n```python\nprint(1)\n```"
    assert extract_code(response) == "print(1)\n"
    assert extract_code("print(2)") == "print(2)"


def test_non_finite_weight_is_a_part_error_not_a_nan_reward() -> None:
    result = make_scorer().score_item(item(
        "\\boxed{ 3 }", reward_pb2.VerifierSpec(name="format", weight=float("inf")),
        reward_pb2.VerifierSpec(name="format", weight=0.5)))
    assert "finite" in result.parts[0].error and result.parts[0].weight == 0.0
    assert result.reward == 0.5


def test_errors_are_counted_by_verifier_and_kind() -> None:
    from prometheus_client import REGISTRY

    def count(verifier: str, kind: str) -> float:
        return REGISTRY.get_sample_value("everstep_reward_errors_total", {"verifier": verifier, "kind": kind}) or 0.0

    before = count("none", "invalid_spec"), count("unknown", "unknown_verifier")
    scorer = make_scorer()
    scorer.score_item(item("x"))
    scorer.score_item(item("x", reward_pb2.VerifierSpec(name="astrology", weight=1.0)))
    assert (count("none", "invalid_spec"), count("unknown", "unknown_verifier")) == (before[0] + 1, before[1] + 1)
