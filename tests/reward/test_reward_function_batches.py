"""TRL reward functions are called once per batch: the parts of one Score call that run the same TRL function
are one call with lists of all their rows (as TRL calls them once per generation batch), under one per-call
limit, and what it returns is mapped back to the rows in order. A raise, a non-list or a list of the wrong
length fails every row of that batch with the text; a timeout fails the batch as a whole (its rows are not
retried alone); the items' other parts still score. verl functions stay per row. Real worker processes with
their isolation, the scorer's Score path, and the service as a real process."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from everstep.v1 import reward_pb2, reward_pb2_grpc
from everstep_reward.config import DEFAULT_FUNCTION_IMPORTS
from everstep_reward.functions import FunctionSettings, FunctionVerifier
from everstep_reward.scoring import RewardScorer
from everstep_reward.verifiers import VerifierRegistry
from everstep_reward.verifiers.format import FormatRules, FormatVerifier

# Each worker loads the module once: CALLS counts the calls that worker ran. A function's pool is keyed by its
# source, so a test that counts gives the source its own first line (a fresh pool, a fresh count).
SOURCE = '''
import asyncio

CALLS = 0

def counts(prompts, completions, **kwargs):
    """Every row of a call gets 100 * (the worker's calls so far) + the call's number of rows."""
    global CALLS
    CALLS += 1
    return [100.0 * CALLS + len(prompts)] * len(completions)

def verl_counts(data_source, solution_str, ground_truth, extra_info):
    global CALLS
    CALLS += 1
    return float(CALLS)

def echo(prompts, completions, answer, ground_truth, **kwargs):
    """Each row's own values: its completion (a number) + its answer / 100; the columns are lists of the rows'."""
    assert answer == ground_truth and len(prompts) == len(completions) == len(answer), (prompts, answer)
    return [float(c) + float(a) / 100 + (0.5 if p == "p" + c else 0.0) for p, c, a in zip(prompts, completions, answer)]

async def echo_async(prompts, completions, answer, **kwargs):
    await asyncio.sleep(0)
    return [float(c) + float(a) / 100 for c, a in zip(completions, answer)]

def normalised(prompts, completions, **kwargs):
    """Depends on the whole batch, as a function that normalises across it does."""
    values = [float(c) for c in completions]
    return [v / max(values) for v in values]

def as_numpy(prompts, completions, **kwargs):
    import numpy
    return numpy.array([float(c) for c in completions]) * 2

def some_do_not_apply(prompts, completions, **kwargs):
    return [None if c == "0" else ("junk" if c == "2" else 1.0) for c in completions]

def short(prompts, completions, **kwargs):
    return [1.0] * (len(completions) - 1)

def not_a_list(prompts, completions, **kwargs):
    return 1.0

def raises(prompts, completions, **kwargs):
    return [1.0 / (len(completions) - len(prompts))]

def hangs(prompts, completions, **kwargs):
    while True:
        pass
'''


@pytest.fixture(scope="module")
def verifier() -> Iterator[FunctionVerifier]:
    settings = FunctionSettings(workers=1, timeout_seconds=3.0, memory_bytes=1024**3, max_pools=64,
                                allowed_imports=DEFAULT_FUNCTION_IMPORTS)
    verifier = FunctionVerifier(settings)
    yield verifier
    verifier.close()


@pytest.fixture(scope="module")
def scorer(verifier: FunctionVerifier) -> Iterator[RewardScorer]:
    scorer = RewardScorer(VerifierRegistry([FormatVerifier(FormatRules())]), max_concurrent_items=8,
                          functions=verifier)
    yield scorer
    scorer.close()


def _function(name: str, *, fresh: str = "", weight: float = 1.0, answer: str = "0") -> reward_pb2.VerifierSpec:
    source = f"# {fresh}\n{SOURCE}" if fresh else SOURCE
    return reward_pb2.VerifierSpec(name="function", weight=weight, answer=answer, function=reward_pb2.RewardFunction(
        name=name, source=source, path="/home/user/rewards.py"))


def _items(n: int, *specs: reward_pb2.VerifierSpec) -> list[reward_pb2.RewardItem]:
    """Item i: response str(i + 1), prompt "p" + response, answer str(10 * i) for every function part."""
    items = []
    for i in range(n):
        item = reward_pb2.RewardItem(id=f"s{i}", prompt=f"p{i + 1}", response=str(i + 1))
        for spec in specs:
            part = item.verifiers.add()
            part.CopyFrom(spec)
            if spec.name == "function":
                part.answer = str(10 * i)
        items.append(item)
    return items


def _score(scorer: RewardScorer, items: list[reward_pb2.RewardItem]) -> dict[str, reward_pb2.ScoreResult]:
    results = {r.id: r for r in scorer.score_batch(items)}
    assert sorted(results) == sorted(item.id for item in items)
    return results


def _part(result: reward_pb2.ScoreResult, name: str) -> reward_pb2.RewardPart:
    (part,) = [p for p in result.parts if p.verifier == f"function:rewards.{name}"]
    return part


def test_a_trl_function_is_called_once_per_batch(scorer: RewardScorer) -> None:
    results = _score(scorer, _items(6, _function("counts", fresh="once")))
    assert {r.id: r.reward for r in results.values()} == {f"s{i}": 106.0 for i in range(6)}, "one call of 6 rows"
    results = _score(scorer, _items(3, _function("counts", fresh="once")))
    assert {r.reward for r in results.values()} == {203.0}, "the next Score call: the worker's second call, 3 rows"


def test_a_verl_function_stays_per_row(scorer: RewardScorer) -> None:
    results = _score(scorer, _items(5, _function("verl_counts", fresh="verl")))
    assert sorted(r.reward for r in results.values()) == [1.0, 2.0, 3.0, 4.0, 5.0], "five calls of one row"


@pytest.mark.parametrize("name", ["echo", "echo_async"])
def test_each_row_gets_its_own_score_in_order(scorer: RewardScorer, name: str) -> None:
    results = _score(scorer, _items(7, _function(name)))
    prompt_bonus = 0.5 if name == "echo" else 0.0
    for i in range(7):
        result = results[f"s{i}"]
        assert result.error == "" and result.reward == pytest.approx(i + 1 + i / 10 + prompt_bonus), result


def test_the_batch_is_what_the_function_sees_as_a_whole(scorer: RewardScorer) -> None:
    results = _score(scorer, _items(4, _function("normalised")))
    assert [results[f"s{i}"].reward for i in range(4)] == [0.25, 0.5, 0.75, 1.0]


def test_a_1d_numpy_array_is_read_as_the_list(scorer: RewardScorer) -> None:
    results = _score(scorer, _items(3, _function("as_numpy")))
    assert [results[f"s{i}"].reward for i in range(3)] == [2.0, 4.0, 6.0]


def test_none_does_not_apply_and_a_bad_entry_fails_its_row_alone(scorer: RewardScorer) -> None:
    results = _score(scorer, _items(4, _function("some_do_not_apply")))
    assert (results["s0"].reward, results["s0"].error) == (1.0, "")
    assert (results["s2"].reward, results["s2"].error) == (1.0, "")
    assert (results["s3"].reward, results["s3"].error) == (1.0, "")
    bad = _part(results["s1"], "some_do_not_apply")
    assert bad.error_kind == reward_pb2.REWARD_ERROR_KIND_FUNCTION_ERROR and bad.score == 0.0
    assert "returned 'junk' at index 1 of 4: a score must be a finite number or None" in bad.error
    none_row = _items(1, _function("some_do_not_apply"))[0]
    none_row.response = "0"
    (result,) = scorer.score_batch([none_row])
    assert (result.reward, result.error) == (0.0, ""), "None: does not apply (0, no error)"


@pytest.mark.parametrize(("name", "message"), [
    ("short", "short: returned 4 scores ([1.0, 1.0, 1.0, 1.0]) for 5 completions: it must return one score per "
              "completion, in order"),
    ("not_a_list", "not_a_list: returned 1.0, not a list with one score per completion (5)"),
    ("raises", "raises: ZeroDivisionError: float division by zero (/home/user/rewards.py, line "),
    ("hangs", "hangs: no result within 3s on this batch of 5 rows (one call) (--function-timeout-seconds)"),
])
def test_a_failing_batch_fails_each_of_its_rows_and_keeps_the_other_parts(scorer: RewardScorer, name: str,
                                                                           message: str) -> None:
    items = _items(5, _function(name), reward_pb2.VerifierSpec(name="format", weight=0.5),
                   _function("echo", weight=2.0))
    results = _score(scorer, items)
    for i in range(5):
        result = results[f"s{i}"]
        failed = _part(result, name)
        assert failed.error_kind == reward_pb2.REWARD_ERROR_KIND_FUNCTION_ERROR and failed.score == 0.0
        assert message in failed.error, failed.error
        assert f"function:rewards.{name}: {name}: " in result.error
        echo = _part(result, "echo")
        assert echo.error == "" and echo.score == pytest.approx(i + 1 + i / 10 + 0.5), "the other function's part"
        assert result.reward == pytest.approx(2.0 * echo.score + 0.5 * [p for p in result.parts
                                                                         if p.verifier == "format"][0].score)


def test_the_pool_recovers_after_a_batch_that_hangs(scorer: RewardScorer) -> None:
    _score(scorer, _items(3, _function("hangs")))
    results = _score(scorer, _items(3, _function("echo")))
    assert all(r.error == "" for r in results.values())


def test_mixed_verl_and_trl_functions(scorer: RewardScorer) -> None:
    """One job with a verl and two TRL functions: each TRL function is its own call, the verl one per row."""
    items = _items(4, _function("verl_counts", fresh="mixed-verl"), _function("counts", fresh="mixed-trl"),
                   _function("echo", weight=0.5))
    results = _score(scorer, items)
    assert sorted(_part(r, "verl_counts").score for r in results.values()) == [1.0, 2.0, 3.0, 4.0]
    assert {_part(r, "counts").score for r in results.values()} == {104.0}
    for i in range(4):
        assert _part(results[f"s{i}"], "echo").score == pytest.approx(i + 1 + i / 10 + 0.5)


def test_items_of_one_score_call_without_the_function_are_left_out(scorer: RewardScorer) -> None:
    items = _items(5, _function("counts", fresh="some"))
    for item in items[3:]:
        del item.verifiers[:]
        item.verifiers.add(name="format", weight=1.0)
    results = _score(scorer, items)
    assert {results[f"s{i}"].reward for i in range(3)} == {103.0}, "one call of the 3 rows that run it"


def test_in_process_functions_are_batched_too() -> None:
    here = FunctionVerifier(FunctionSettings(isolated=False, allowed_imports=DEFAULT_FUNCTION_IMPORTS))
    scorer = RewardScorer(VerifierRegistry([]), max_concurrent_items=1, functions=here)  # the call runs first
    try:
        results = _score(scorer, _items(5, _function("counts", fresh="in-process")))
    finally:
        scorer.close()
        here.close()
    assert {r.reward for r in results.values()} == {105.0}


def test_the_service_calls_a_trl_function_once_per_score_call(service_process) -> None:
    reward = service_process("reward", "--math-workers", "1", "--function-workers", "1")
    items = _items(8, _function("counts", fresh="service"), reward_pb2.VerifierSpec(name="format", weight=1.0))
    with grpc.insecure_channel(reward.grpc_address) as channel:
        stub = reward_pb2_grpc.RewardStub(channel)
        first = {r.id: r for r in stub.Score(reward_pb2.ScoreRequest(items=items), timeout=120)}
        second = {r.id: r for r in stub.Score(reward_pb2.ScoreRequest(items=items[:2]), timeout=120)}
    assert {_part(r, "counts").score for r in first.values()} == {108.0}
    assert {_part(r, "counts").score for r in second.values()} == {202.0}
