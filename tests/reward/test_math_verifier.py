"""The math verifier on a labeled set, through real worker processes; timeouts and crashes."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from math_cases import MATH_CASES
from misbehaving_checks import hang_or_check

from everstep.math_answers import extract_boxed_answer, extract_last_number
from everstep.v1 import reward_pb2
from everstep_reward.verifiers import SpecError
from everstep_reward.verifiers.math import MathVerifier, prepare_math_worker
from everstep_reward.verifiers.params import ParamsError
from everstep_reward.worker_pool import ProcessWorkerPool


@pytest.fixture(scope="module")
def pool() -> Iterator[ProcessWorkerPool]:
    pool = ProcessWorkerPool(2, initializer=prepare_math_worker)
    pool.start()
    yield pool
    pool.close()


def spec(answer: str) -> reward_pb2.VerifierSpec:
    return reward_pb2.VerifierSpec(name="math", weight=1.0, answer=answer)


def item(response: str) -> reward_pb2.RewardItem:
    return reward_pb2.RewardItem(id="a", response=response)


def test_labeled_set_is_big_balanced_and_covers_every_form() -> None:
    assert len(MATH_CASES) >= 200
    assert sum(ok for _, _, ok in MATH_CASES) >= 80 and sum(not ok for _, _, ok in MATH_CASES) >= 80
    text = " ".join(response + " " + answer for response, answer, _ in MATH_CASES)
    for form in ("\\frac", "0.", "\\%", "\\text{", "\\cup", "\\{", "pmatrix", "bmatrix", "\\sqrt", "[", "^\\circ"):
        assert form in text, form
    assert len({(r, a) for r, a, _ in MATH_CASES}) == len(MATH_CASES), "a pair appears twice"


def test_labeled_set(pool: ProcessWorkerPool) -> None:
    verifier = MathVerifier(pool, timeout_seconds=20)
    with ThreadPoolExecutor(pool.max_workers) as threads:
        results = list(threads.map(lambda case: verifier.score(item(case[0]), spec(case[1])), MATH_CASES))
    errors = [(case, r) for case, r in zip(MATH_CASES, results, strict=True) if not r.ok]
    assert errors == []
    wrong = [(case, r.score) for case, r in zip(MATH_CASES, results, strict=True)
             if r.score != (1.0 if case[2] else 0.0)]
    assert wrong == []


@pytest.mark.parametrize(("text", "expected"), [
    ("so \\boxed{ 13 }", "13"),
    ("\\boxed{\\frac{1}{2}} and later \\boxed{ \\frac{3}{4} }", "\\frac{3}{4}"),
    ("\\boxed {x^{2}}", "x^{2}"),
    ("no box here", None),
    ("\\boxed{ }", None),
    ("\\boxed{ 12", None),
])
def test_extract_boxed_answer(text: str, expected: str | None) -> None:
    assert extract_boxed_answer(text) == expected


def test_missing_answer_or_a_param_is_a_spec_error_not_a_zero(pool: ProcessWorkerPool) -> None:
    with pytest.raises(SpecError, match="`answer` is empty") as row_error:
        MathVerifier(pool, timeout_seconds=20).score(item("\\boxed{ 1 }"), spec(""))
    assert not isinstance(row_error.value, ParamsError), "the row's data, not the job's params"
    with_params = spec("1")
    with_params.params.update({"tolerance": 0.1})
    with pytest.raises(ParamsError, match="params.tolerance: unknown option"):
        MathVerifier(pool, timeout_seconds=20).score(item("\\boxed{ 1 }"), with_params)


def test_unparseable_reference_is_an_error(pool: ProcessWorkerPool) -> None:
    result = MathVerifier(pool, timeout_seconds=20).score(item("\\boxed{ 1 }"), spec("\\frac{"))
    assert result.error_kind == reward_pb2.REWARD_ERROR_KIND_INVALID_SPEC


@pytest.mark.slow
def test_hung_check_times_out_and_later_items_still_score() -> None:
    pool = ProcessWorkerPool(1, initializer=prepare_math_worker)
    pool.start()
    try:
        verifier = MathVerifier(pool, timeout_seconds=1.0, check=hang_or_check)
        start = time.monotonic()
        result = verifier.score(item("HANG \\boxed{ 1 }"), spec("1"))
        assert time.monotonic() - start < 2.5
        assert result.error == "timeout" and result.score == 0.0
        assert result.error_kind == reward_pb2.REWARD_ERROR_KIND_TIMEOUT
        # The only worker hung: the pool must have been replaced for these to score at all.
        assert verifier.score(item("\\boxed{ 13 }"), spec("13")).score == 1.0
        assert verifier.score(item("\\boxed{ 12 }"), spec("13")).score == 0.0

        crashed = verifier.score(item("CRASH"), spec("1"))
        assert crashed.error_kind == reward_pb2.REWARD_ERROR_KIND_WORKER_CRASHED
        assert verifier.score(item("\\boxed{ 7 }"), spec("7")).score == 1.0
    finally:
        pool.close()


@pytest.mark.slow
def test_items_running_beside_a_hung_one_still_score() -> None:
    pool = ProcessWorkerPool(2, initializer=prepare_math_worker)
    pool.start()
    try:
        verifier = MathVerifier(pool, timeout_seconds=1.5, check=hang_or_check)
        requests = [("HANG", "1")] + [(f"\\boxed{{ {i} }}", str(i if i % 2 else i + 1)) for i in range(8)]
        with ThreadPoolExecutor(len(requests)) as threads:
            results = list(threads.map(lambda r: verifier.score(item(r[0]), spec(r[1])), requests))
        assert results[0].error == "timeout"
        assert [r.score for r in results[1:]] == [0.0, 1.0] * 4
        assert all(r.ok for r in results[1:])
    finally:
        pool.close()


@pytest.mark.parametrize(("text", "expected"), [
    ("2 x 6 = 12", "12"),
    ("Answer: -3.5.", "-3.5"),
    ("7 plus 5 is 12, not 13", "13"),
    ("no number", None),
])
def test_extract_last_number(text: str, expected: str | None) -> None:
    assert extract_last_number(text) == expected


@pytest.mark.parametrize(("response", "answer", "boxed_score", "last_number_score"), [
    ("2 x 6 = 12", "12", 0.0, 1.0),            # no box: only the lenient rule reads the number
    ("The answer is 14 or maybe 13.", "14", 0.0, 0.0),  # the LAST number is the answer
    ("\\boxed{12} since 2 x 6 = 12 and not 11", "12", 1.0, 1.0),  # a box wins over later numbers
    ("It is 0.5", "\\frac{1}{2}", 0.0, 1.0),  # compared by math-verify, as a box is
    ("I do not know.", "12", 0.0, 0.0),
])
def test_last_number_rule(pool: ProcessWorkerPool, response: str, answer: str, boxed_score: float,
                          last_number_score: float) -> None:
    verifier = MathVerifier(pool, timeout_seconds=20)
    lenient = spec(answer)
    lenient.params.update({"extract": "last_number"})
    assert verifier.score(item(response), spec(answer)).score == boxed_score
    assert verifier.score(item(response), lenient).score == last_number_score


def test_unknown_extract_rule_names_the_param(pool: ProcessWorkerPool) -> None:
    bad = spec("1")
    bad.params.update({"extract": "first_number"})
    with pytest.raises(ParamsError, match="params.extract"):
        MathVerifier(pool, timeout_seconds=20).score(item("1"), bad)
