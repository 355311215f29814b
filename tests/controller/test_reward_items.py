"""The reward item of a response: the job's reward spec merged with the row's data, as the real reward
service reads it (prompt, token count, answer, code tests, language, params)."""

from __future__ import annotations

import json

import pytest
from google.protobuf import json_format
from tokenizers import Tokenizer, models, pre_tokenizers

from everstep.rest.job_spec import RewardSpec
from everstep.reward_error_kind import error_kind_label
from everstep.v1 import common_pb2, reward_pb2
from everstep_controller.data.dataset import PromptRow, load_prompt_rows
from everstep_controller.data.prompt_rendering import PromptEncoder
from everstep_controller.data.reward_errors import ErrorClass, classify, part_errors
from everstep_controller.data.reward_items import RewardItemBuilder
from everstep_controller.run.clients import RewardClient

JOB = RewardSpec.model_validate({"verifiers": [
    {"name": "math", "weight": 1.0},
    {"name": "code", "weight": 2.0, "language": "python", "params": {"reward_mode": "all_pass"}},
    {"name": "length", "weight": 0.5, "params": {"max_length": 4, "cache_length": 2}},
]}).verifiers
ROWS = [
    {"prompt": "1 + 2 =", "answer": "3", "verifiers": ["math", "length"]},
    {"prompt": "add", "tests": [{"stdin": "1 2\n", "expected_stdout": "3\n"}], "verifiers": ["code"]},
    {"prompt": "add", "tests": [{"arguments": [1, 2], "expected": 3}], "function_name": "add", "language": "nodejs",
     "verifiers": ["code"]},
    {"prompt": "add", "tests": [{"input": "1\n", "output": "1\n"}]},
]


@pytest.fixture(scope="module")
def rows(tmp_path_factory: pytest.TempPathFactory) -> list[PromptRow]:
    """The rows as the controller loads them from a JSONL file."""
    path = tmp_path_factory.mktemp("rows") / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    tokenizer = Tokenizer(models.WordLevel(vocab={"<unk>": 0}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    loaded = load_prompt_rows(str(path), PromptEncoder(tokenizer), verifier_names=[v.name for v in JOB])
    assert loaded.num_skipped == 0
    return loaded.rows


def _sequence(text: str, num_tokens: int) -> common_pb2.Sequence:
    return common_pb2.Sequence(id="s", prompt_ids=[1], output_ids=list(range(num_tokens)), output_text=text)


def _specs(item: reward_pb2.RewardItem) -> dict[str, reward_pb2.VerifierSpec]:
    return {spec.name: spec for spec in item.verifiers}


def test_a_math_row_gets_prompt_token_count_answer_and_the_jobs_params(rows: list[PromptRow]) -> None:
    item = RewardItemBuilder(JOB)("s0", rows[0], _sequence("so \\boxed{3}", 7))
    assert (item.id, item.response, item.prompt) == ("s0", "so \\boxed{3}", "1 + 2 =")
    assert item.HasField("num_response_tokens") and item.num_response_tokens == 7
    specs = _specs(item)
    assert list(specs) == ["math", "length"], "the row's verifiers, in the job's order"
    assert (specs["math"].weight, specs["math"].answer) == (1.0, "3")
    assert not specs["math"].HasField("params"), "a verifier without options gets none"
    assert json_format.MessageToDict(specs["length"].params) == {"max_length": 4, "cache_length": 2}
    assert specs["length"].weight == 0.5


def test_a_code_row_with_stdin_tests_gets_them_and_the_jobs_default_language(rows: list[PromptRow]) -> None:
    (code,) = RewardItemBuilder(JOB)("s1", rows[1], _sequence("```python\nprint(3)\n```", 5)).verifiers
    assert (code.name, code.weight, code.language, code.function_name) == ("code", 2.0, "python", "")
    assert [(t.stdin, t.expected_stdout) for t in code.tests] == [("1 2\n", "3\n")]
    assert not code.function_tests
    assert json_format.MessageToDict(code.params) == {"reward_mode": "all_pass"}


def test_a_code_row_with_function_tests_gets_them_its_function_and_its_own_language(rows: list[PromptRow]) -> None:
    (code,) = RewardItemBuilder(JOB)("s2", rows[2], _sequence("function add(a, b) { return a + b }", 9)).verifiers
    assert (code.language, code.function_name) == ("nodejs", "add")
    assert [(t.arguments_json, t.expected_json) for t in code.function_tests] == [("[1, 2]", "3")]
    assert not code.tests


def test_a_row_without_verifiers_gets_all_of_the_jobs(rows: list[PromptRow]) -> None:
    item = RewardItemBuilder(JOB)("s3", rows[3], _sequence("x", 1))
    assert [s.name for s in item.verifiers] == ["math", "code", "length"]
    assert [(t.stdin, t.expected_stdout) for t in _specs(item)["code"].tests] == [("1\n", "1\n")]


def test_the_reward_service_reads_params_token_counts_and_code_cases(rows: list[PromptRow],
                                                                      reward_address: str) -> None:
    """Through the real service (math workers, no sandbox): length's params and the token count make
    the penalty, math reads the answer, and code cases pass the service's checks up to the sandbox."""
    build = RewardItemBuilder(JOB)
    words = "a b c d e f g h \\boxed{3}"  # 9 words: counted as words (the fallback) the penalty would be -1
    items = [build("math", rows[0], _sequence(words, 3)), build("code-stdin", rows[1], _sequence("print(3)", 4)),
             build("code-call", rows[2], _sequence("function add(a, b) { return a + b }", 4))]
    client = RewardClient(reward_address, timeout_seconds=60)
    try:
        results = client.score(items)
    finally:
        client.close()
    math = results["math"]
    assert not math.error
    assert {p.verifier: p.score for p in math.parts} == pytest.approx({"math": 1.0, "length": -0.5})
    assert math.reward == pytest.approx(1.0 - 0.25)
    for item_id in ("code-stdin", "code-call"):  # valid cases; this reward service has no sandbox behind it
        kinds = [error_kind_label(p.error_kind) for p in results[item_id].parts]
        assert kinds == ["sandbox_unavailable"], results[item_id].error
        assert classify(part_errors(results[item_id]), results[item_id].error) == ErrorClass.TRANSIENT

