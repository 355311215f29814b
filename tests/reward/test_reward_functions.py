"""The user's reward functions in the reward service: both conventions (verl per row, TRL per batch), async,
the extra values of a verl dict, and every way a function fails a row (raises, hangs past the per-call limit,
returns junk, imports what the operator does not allow, reaches for the network) as a function_error part with
the text, while a function that cannot load at all, or asks for a network the operator refuses, is the job's
error (invalid_params). Real worker processes with their isolation."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from everstep.v1 import reward_pb2
from everstep_reward.config import DEFAULT_FUNCTION_IMPORTS
from everstep_reward.functions import FunctionSettings, FunctionVerifier
from everstep_reward.scoring import RewardScorer
from everstep_reward.verifiers import VerifierRegistry

SOURCE = '''
import re

def verl_float(data_source, solution_str, ground_truth, extra_info):
    return float(ground_truth in solution_str)

def verl_dict(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": 0.5, "length": len(solution_str), "note": "not a number", "hit": True}

async def verl_async(data_source, solution_str, ground_truth, extra_info):
    return 0.25

def trl_batch(prompts, completions, answer, **kwargs):
    return [1.0 if answer[i] in c else 0.0 for i, c in enumerate(completions)]

async def trl_async(prompts, completions, **kwargs):
    return [len(prompts[0]) / 10]

def trl_none(prompts, completions, **kwargs):
    return [None]

def raises(data_source, solution_str, ground_truth, extra_info):
    return {}["missing"]

def hangs(data_source, solution_str, ground_truth, extra_info):
    while True:
        pass

def junk_string(data_source, solution_str, ground_truth, extra_info):
    return "1.0"

def junk_nan(data_source, solution_str, ground_truth, extra_info):
    return float("nan")

def junk_dict(data_source, solution_str, ground_truth, extra_info):
    return {"reward": 1.0}

def junk_length(prompts, completions, **kwargs):
    return [1.0, 0.0]

def imports_os(data_source, solution_str, ground_truth, extra_info):
    import os
    return 1.0

def imports_allowed(data_source, solution_str, ground_truth, extra_info):
    import json, fractions
    return float(fractions.Fraction(json.loads("[1, 2]")[0], 2))

def connects(data_source, solution_str, ground_truth, extra_info):
    import socket
    socket.create_connection(("203.0.113.1", 80), timeout=2)
    return 1.0

def raw_socket(data_source, solution_str, ground_truth, extra_info):
    import socket
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(2)
    s.connect(("203.0.113.1", 80))
    return 1.0

def scratch(data_source, solution_str, ground_truth, extra_info):
    import tempfile
    with open("note.txt", "w") as f:
        f.write("x")
    return 1.0 if tempfile.gettempdir() != "/tmp" and open("note.txt").read() == "x" else 0.0

def allocates(data_source, solution_str, ground_truth, extra_info):
    block = bytearray(3 * 1024 ** 3)
    return 1.0
'''

TOP_LEVEL_IMPORT = "import subprocess\n\ndef compute_score(data_source, solution_str, ground_truth, extra_info):\n" \
                   "    return 1.0\n"


@pytest.fixture(scope="module")
def verifier() -> Iterator[FunctionVerifier]:
    settings = FunctionSettings(workers=1, timeout_seconds=3.0, memory_bytes=1024**3, max_pools=64,
                                allowed_imports=(*DEFAULT_FUNCTION_IMPORTS, "socket", "tempfile"))
    verifier = FunctionVerifier(settings)
    yield verifier
    verifier.close()


def _spec(name: str, source: str = SOURCE, *, network: bool = False) -> reward_pb2.VerifierSpec:
    return reward_pb2.VerifierSpec(name="function", weight=1.0, answer="13", function=reward_pb2.RewardFunction(
        name=name, source=source, path="/home/user/rewards.py", allow_network=network))


ITEM = reward_pb2.RewardItem(id="s0", prompt="6 + 7 =", response="so \\boxed{13}")


@pytest.mark.parametrize(("name", "score"), [
    ("verl_float", 1.0), ("verl_async", 0.25), ("trl_batch", 1.0), ("trl_async", 0.7), ("trl_none", 0.0),
    ("imports_allowed", 0.5), ("scratch", 1.0),
])
def test_both_conventions_and_async_score(verifier: FunctionVerifier, name: str, score: float) -> None:
    result = verifier.score(ITEM, _spec(name))
    assert result.ok, result.error
    assert result.score == pytest.approx(score)


def test_a_dicts_other_numeric_keys_become_metrics(verifier: FunctionVerifier) -> None:
    result = verifier.score(ITEM, _spec("verl_dict"))
    assert result.ok and result.score == 0.5
    assert result.metrics == {"length": float(len(ITEM.response)), "hit": 1.0}


@pytest.mark.parametrize(("name", "message"), [
    ("raises", "raises: KeyError: 'missing' (/home/user/rewards.py, line 23)"),
    ("hangs", "hangs: no result within 3s"),
    ("junk_string", "returned '1.0', not a finite number"),
    ("junk_nan", "returned nan, not a finite number"),
    ("junk_dict", "returned a dict without 'score' (keys: ['reward'])"),
    ("junk_length", "returned 2 scores ([1.0, 0.0]) for 1 completion: it must return one score per completion"),
    ("imports_os", "ImportError: import of 'os' is not allowed in a reward function (allowed: "),
    ("connects", "PermissionError: network access is refused to reward functions"),
    ("raw_socket", "PermissionError: network access is refused to reward functions (socket.connect)"),
    ("allocates", "MemoryError"),
])
def test_a_failing_function_fails_the_row_with_its_text(verifier: FunctionVerifier, name: str, message: str) -> None:
    result = verifier.score(ITEM, _spec(name))
    assert result.error_kind == reward_pb2.REWARD_ERROR_KIND_FUNCTION_ERROR and result.score == 0.0
    assert message in result.error, result.error


def test_the_pool_recovers_after_a_hang(verifier: FunctionVerifier) -> None:
    verifier.score(ITEM, _spec("hangs"))
    assert verifier.score(ITEM, _spec("hangs")).error_kind == reward_pb2.REWARD_ERROR_KIND_FUNCTION_ERROR
    assert verifier.score(ITEM, _spec("verl_float")).score == 1.0


def test_a_function_that_cannot_load_is_the_jobs_error(verifier: FunctionVerifier) -> None:
    result = verifier.score(ITEM, _spec("compute_score", TOP_LEVEL_IMPORT))
    assert result.error_kind == reward_pb2.REWARD_ERROR_KIND_INVALID_PARAMS
    assert "cannot load compute_score from /home/user/rewards.py: ImportError: import of 'subprocess'" in result.error
    result = verifier.score(ITEM, _spec("nowhere"))
    assert result.error_kind == reward_pb2.REWARD_ERROR_KIND_INVALID_PARAMS and "no function 'nowhere'" in result.error


def test_network_needs_the_job_and_the_operator(verifier: FunctionVerifier) -> None:
    result = verifier.score(ITEM, _spec("verl_float", network=True))
    assert result.error_kind == reward_pb2.REWARD_ERROR_KIND_INVALID_PARAMS
    assert "does not allow" in result.error
    allowed = FunctionVerifier(FunctionSettings(workers=1, timeout_seconds=10.0, allow_network=True,
                                                allowed_imports=(*DEFAULT_FUNCTION_IMPORTS, "socket")))
    try:
        result = allowed.score(ITEM, _spec("raw_socket", network=True))
        assert "network access is refused" not in result.error, "granted: the socket calls reach the kernel"
    finally:
        allowed.close()


def test_in_process_is_the_operators_setting() -> None:
    here = FunctionVerifier(FunctionSettings(isolated=False, allowed_imports=DEFAULT_FUNCTION_IMPORTS))
    try:
        assert here.score(ITEM, _spec("trl_batch")).score == 1.0
        assert "import of 'os' is not allowed" in here.score(ITEM, _spec("imports_os")).error
        assert here.score(ITEM, _spec("raises")).error_kind == reward_pb2.REWARD_ERROR_KIND_FUNCTION_ERROR
    finally:
        here.close()


def test_the_scorer_names_the_part_and_carries_the_metrics(verifier: FunctionVerifier) -> None:
    scorer = RewardScorer(VerifierRegistry([]), max_concurrent_items=2, functions=verifier)
    try:
        item = reward_pb2.RewardItem(id="s1", prompt="p", response="so \\boxed{13}")
        item.verifiers.append(_spec("verl_dict"))
        item.verifiers.append(_spec("raises"))
        result = scorer.score_item(item)
    finally:
        scorer.close()
    ok, failed = result.parts
    assert ok.verifier == "function:rewards.verl_dict" and dict(ok.metrics)["hit"] == 1.0
    assert failed.verifier == "function:rewards.raises" and failed.error_kind == 10
    assert result.reward == 0.5 and "KeyError" in result.error


def test_workers_do_not_run_in_the_services_directory(verifier: FunctionVerifier) -> None:
    assert verifier.score(ITEM, _spec("scratch")).score == 1.0
    assert not os.path.exists("note.txt")


EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize(("file", "name"), [("verl_boxed.py", "compute_score"),
                                            ("trl_boxed.py", "boxed_answer_reward")])
def test_the_shipped_examples_score_the_demo_models_answers(file: str, name: str) -> None:
    here = FunctionVerifier(FunctionSettings(isolated=False, allowed_imports=DEFAULT_FUNCTION_IMPORTS))
    path = EXAMPLES / "rewards" / file
    spec = reward_pb2.VerifierSpec(name="function", answer="-3", function=reward_pb2.RewardFunction(
        name=name, source=path.read_text(), path=str(path)))
    try:
        right = here.score(reward_pb2.RewardItem(id="a", response="2 - 5 = \\boxed{ -3 }"), spec)
        wrong = here.score(reward_pb2.RewardItem(id="b", response="2 - 5 = \\boxed{ 3 }"), spec)
    finally:
        here.close()
    assert (right.score, wrong.score) == (1.0, 0.0), (right, wrong)


def test_a_worker_past_its_cpu_time_is_replaced_and_the_row_reported() -> None:
    source = ("import time\n\ndef burns(data_source, solution_str, ground_truth, extra_info):\n"
              "    end = time.process_time() + 5\n    while time.process_time() < end:\n        pass\n"
              "    return 1.0\n")
    limited = FunctionVerifier(FunctionSettings(workers=1, timeout_seconds=30.0, cpu_seconds=1,
                                                allowed_imports=(*DEFAULT_FUNCTION_IMPORTS, "time")))
    try:
        result = limited.score(ITEM, _spec("burns", source))
    finally:
        limited.close()
    assert result.error_kind == reward_pb2.REWARD_ERROR_KIND_FUNCTION_ERROR
    assert "its worker died twice on this row" in result.error


def test_the_operators_flags_reach_the_settings() -> None:
    from everstep_reward.__main__ import _parser
    from everstep_reward.config import RewardConfig
    from everstep_reward.server import function_settings

    args = _parser().parse_args(["--function-isolation", "none", "--function-allowed-imports", "math,sympy",
                                 "--function-timeout-seconds", "2.5", "--function-allow-network"])
    settings = function_settings(RewardConfig(**{k: v for k, v in vars(args).items() if v is not None and k.startswith(
        "function_")}))
    assert (settings.isolated, settings.allowed_imports, settings.timeout_seconds, settings.allow_network) == (
        False, ("math", "sympy"), 2.5, True)
    assert function_settings(RewardConfig()).isolated and "os" not in RewardConfig().function_allowed_imports
