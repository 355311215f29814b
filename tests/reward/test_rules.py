"""Pure rules: the format rules with repetition, DAPO's overlong penalty, function-call cases, verdicts."""

from __future__ import annotations

import json

import pytest

from everstep.v1 import reward_pb2, sandbox_pb2
from everstep_reward.verifiers.base import Outcome
from everstep_reward.verifiers.code import CodeVerdict, verdict_of
from everstep_reward.verifiers.format import (
    FormatRule,
    FormatRules,
    FormatVerifier,
    find_format_violation,
    has_degenerate_repetition,
)
from everstep_reward.verifiers.function_call import canonical_json, function_call_program, parse_function_call_case
from everstep_reward.verifiers.length import LengthParams, LengthUnit, LengthVerifier, overlong_penalty

SPEC = reward_pb2.VerifierSpec()


def item(response: str, **fields: object) -> reward_pb2.RewardItem:
    return reward_pb2.RewardItem(id="a", response=response, **fields)


@pytest.mark.parametrize(("response", "rules", "violation"), [
    ("<think> 12 + 1 </think> so \\boxed{ 13 }", FormatRules(require_think=True), None),
    ("so \\boxed{ 13 }", FormatRules(require_think=True), FormatRule.THINK_BLOCK),
    ("so \\boxed{ 13 }", FormatRules(), None),
    ("<think> 12 + 1 so \\boxed{ 13 }", FormatRules(), FormatRule.THINK_BLOCK),
    ("<think> a </think> <think> b </think> \\boxed{1}", FormatRules(), FormatRule.THINK_BLOCK),
    ("<think> \\boxed{ 13 } </think> no answer after", FormatRules(), FormatRule.ANSWER),
    ("<think> ok </think> \\boxed{}", FormatRules(), FormatRule.ANSWER),
    ("<think> " + "let me check again. " * 30 + "</think> \\boxed{1}", FormatRules(), FormatRule.REPETITION),
    ("\\boxed{1} " + "wait " * 60, FormatRules(), FormatRule.REPETITION),
])
def test_format_rules(response: str, rules: FormatRules, violation: FormatRule | None) -> None:
    assert find_format_violation(response, rules) == violation
    assert FormatVerifier(rules).score(item(response), SPEC).score == (1.0 if violation is None else 0.0)


def test_repetition_needs_both_enough_copies_and_enough_words() -> None:
    def check(text: str) -> bool:
        return has_degenerate_repetition(text, min_repeats=10, min_words=40, max_period=32)

    assert check("x " * 40)
    assert not check("x " * 39)  # 39 copies of one word: too few words
    assert check("so 1 + 1 = 2 and " * 10)  # a period of 7 words, 10 times: 70 words
    assert not check("so 1 + 1 = 2 and " * 9)  # 63 words but only 9 copies
    assert not check(" ".join(str(i) for i in range(500)))  # long but never repeats
    long_period = " ".join(f"w{i}" for i in range(40))
    assert not check((long_period + " ") * 12)  # a period longer than max_period is not looked for


def test_format_rules_validate() -> None:
    with pytest.raises(ValueError, match="repetition_min_repeats"):
        FormatRules(repetition_min_repeats=1)


@pytest.mark.parametrize(("length", "penalty"), [
    (0, 0.0), (3000, 0.0), (3072, 0.0),         # L <= L_max - L_cache = 3072
    (3073, -1 / 1024), (3584, -0.5), (4096, -1.0),  # linear in the cache band
    (4097, -1.0), (10_000, -1.0),               # beyond L_max
])
def test_overlong_penalty_matches_dapo(length: int, penalty: float) -> None:
    assert overlong_penalty(length, max_length=4096, cache_length=1024) == pytest.approx(penalty)


def test_overlong_penalty_without_a_cache_band_is_a_hard_cut() -> None:
    assert overlong_penalty(100, max_length=100, cache_length=0) == 0.0
    assert overlong_penalty(101, max_length=100, cache_length=0) == -1.0


def test_length_verifier_counts_tokens_and_falls_back_to_words_or_characters() -> None:
    words = LengthVerifier(LengthParams(max_length=10, cache_length=4))
    assert words.score(item("a b c d e f"), SPEC).score == 0.0
    half = words.score(item("a b c d e f g h"), SPEC)
    assert half.score == pytest.approx(-0.5) and half.metric_outcome() == Outcome.PARTIAL
    over = words.score(item("a " * 11), SPEC)
    assert over.score == -1.0 and over.metric_outcome() == Outcome.INCORRECT
    assert words.score(item(""), SPEC).metric_outcome() == Outcome.CORRECT
    # The token count, when the caller sends it, is L whatever the text says (0 included).
    assert words.score(item("a " * 11, num_response_tokens=7), SPEC).score == pytest.approx(-0.25)
    assert words.score(item("a " * 11, num_response_tokens=0), SPEC).score == 0.0
    assert words.score(item("a", num_response_tokens=11), SPEC).score == -1.0
    chars = LengthVerifier(LengthParams(max_length=10, cache_length=4, fallback_unit=LengthUnit.CHARS))
    assert chars.score(item("abcdefgh"), SPEC).score == pytest.approx(-0.5)
    with pytest.raises(ValueError, match="cache_length"):
        LengthParams(max_length=10, cache_length=11)
    with pytest.raises(ValueError, match="fallback_unit"):
        LengthParams(fallback_unit=LengthUnit.TOKENS)


def spec_with(name: str, **params: object) -> reward_pb2.VerifierSpec:
    spec = reward_pb2.VerifierSpec(name=name, weight=1.0)
    spec.params.update(params)
    return spec


def test_items_override_the_service_defaults_through_params() -> None:
    length = LengthVerifier(LengthParams(max_length=10, cache_length=4))
    tokens = item("", num_response_tokens=100)
    assert length.score(tokens, SPEC).score == -1.0
    assert length.score(tokens, spec_with("length", max_length=200, cache_length=100)).score == 0.0
    assert length.score(tokens, spec_with("length", max_length=150, cache_length=100)).score == pytest.approx(-0.5)
    text = item("abcdefghijkl")  # 1 word, 12 characters
    assert length.score(text, spec_with("length", fallback_unit="chars")).score == -1.0

    fmt = FormatVerifier(FormatRules())
    tagged = item("<think> hmm </think> <answer> 12 </answer>")
    assert fmt.score(tagged, SPEC).score == 0.0  # no \\boxed{}
    assert fmt.score(tagged, spec_with("format", required_tags=["answer"], require_boxed=False)).score == 1.0
    assert fmt.score(item("<answer> </answer>"), spec_with("format", required_tags=["answer"],
                                                                  require_boxed=False)).score == 0.0
    assert fmt.score(item("\\boxed{1}"), spec_with("format", require_think=True)).score == 0.0


@pytest.mark.parametrize(("verifier", "params", "message"), [
    ("length", {"max_tokens": 10},
     "params.max_tokens: unknown option (known: max_length, cache_length, fallback_unit)"),
    ("length", {"max_length": 10.5}, "params.max_length:"),
    ("length", {"max_length": 10, "cache_length": 20}, "cache_length (20) must not exceed max_length (10)"),
    ("format", {"required_tags": ["<answer>"]}, "params.required_tags: "),
    ("format", {"require_think": "maybe"}, "params.require_think:"),
    ("format", {"repetition_min_repeats": 1}, "params.repetition_min_repeats:"),
])
def test_bad_params_are_params_errors_naming_the_key(verifier: str, params: dict, message: str) -> None:
    from everstep_reward.verifiers.params import ParamsError

    rule = LengthVerifier() if verifier == "length" else FormatVerifier()
    with pytest.raises(ParamsError) as error:
        rule.score(item("\\boxed{1}"), spec_with(verifier, **params))
    assert message in str(error.value)


def test_negative_token_count_is_a_spec_error() -> None:
    from everstep_reward.verifiers.params import SpecError

    with pytest.raises(SpecError, match="num_response_tokens"):
        LengthVerifier().score(item("x", num_response_tokens=-1), SPEC)


def test_canonical_json() -> None:
    assert canonical_json('{"b": [1.0, 2.5, 3], "a": "é"}') == '{"a":"é","b":[1,2.5,3]}'
    assert parse_function_call_case("[1, 2]", " 3.0 ", "python") == ("[1, 2]", "3\n")
    with pytest.raises(ValueError, match="not JSON"):
        parse_function_call_case("[1, 2]", "three", "python")
    with pytest.raises(ValueError, match="JSON array"):
        parse_function_call_case('{"a": 1}', "1", "nodejs")
    with pytest.raises(ValueError, match="JSON array"):
        parse_function_call_case("7", "1", "python")


def test_function_call_program_rejects_bad_names_and_languages() -> None:
    with pytest.raises(ValueError, match="not `name`"):
        function_call_program("", "python", "os.system('x')")
    with pytest.raises(ValueError, match="support python, nodejs"):
        function_call_program("", "cpp", "add")
    program = function_call_program("def f(): return 1\n", "python", "f")
    compile(program, "driver.py", "exec")  # the driver is valid Python
    assert json.dumps("def f(): return 1\n")[1:-1] in function_call_program("def f(): return 1\n", "nodejs", "f")


def _reply(compile_status: str | None, *runs: tuple[bool, str, int]) -> sandbox_pb2.RunTestsResponse:
    reply = sandbox_pb2.RunTestsResponse(results=[
        sandbox_pb2.TestCaseResult(passed=p, run_result=sandbox_pb2.CommandResult(status=s, return_code=rc))
        for p, s, rc in runs])
    if compile_status is not None:
        reply.compile_result.CopyFrom(sandbox_pb2.CommandResult(status=compile_status,
                                                                return_code=0 if compile_status == "Finished" else 1))
    return reply


def test_verdicts() -> None:
    assert verdict_of(_reply(None, (True, "Finished", 0))) == CodeVerdict.ACCEPTED
    assert verdict_of(_reply("Finished", (True, "Finished", 0), (False, "Finished", 0))) == CodeVerdict.WRONG_ANSWER
    assert verdict_of(_reply(None, (False, "TimeLimitExceeded", -9))) == CodeVerdict.TIME_LIMIT
    assert verdict_of(_reply(None, (False, "Finished", 1))) == CodeVerdict.RUNTIME_ERROR
    assert verdict_of(_reply("Error", (False, "", 0))) == CodeVerdict.COMPILE_ERROR
