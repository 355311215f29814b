"""Prompt datasets: JSONL and Parquet rows with a prompt and an answer or tests; bad rows are skipped,
counted and reported with their row number and cause."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from everstep_controller.data.dataset import RowFields, dataset_format, load_prompt_rows
from everstep_controller.data.prompt_rendering import PromptEncoder
from everstep_controller.data.row_tests import FunctionCallCase, RowTests, StdioCase

ROWS = [
    {"prompt": "1 + 2 =", "answer": "3"},
    {"prompt": "write add", "tests": [{"stdin": "1 2\n", "expected_stdout": "3\n"}]},
    {"prompt": "no answer here"},
    {"answer": "4"},
    {"prompt": "4 + 4 =", "answer": 8},
    {"prompt": "", "answer": "1"},
    {"prompt": "bad tests", "tests": "not json"},
]


@pytest.fixture(scope="module")
def encoder() -> PromptEncoder:
    """The raw format: prompt strings tokenized as they are."""
    words = ["<unk>", "+", "=", "write", "add"] + [str(i) for i in range(10)]
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PromptEncoder(tok)


def _check(loaded) -> None:  # noqa: ANN001
    assert [(r.index, r.prompt, r.answer) for r in loaded.rows] == [(0, "1 + 2 =", "3"), (1, "write add", ""),
                                                                   (4, "4 + 4 =", "8")]
    assert loaded.rows[1].tests == RowTests(stdio=(StdioCase("1 2\n", "3\n"),))
    assert loaded.rows[0].prompt_ids == (6, 1, 7, 2)
    assert loaded.num_skipped == 4
    reasons = {s.index: s.reason for s in loaded.skipped}
    assert set(reasons) == {2, 3, 5, 6}
    assert "neither an answer" in reasons[2] and "no prompt" in reasons[3] and "not JSON" in reasons[6]


def test_jsonl_rows(tmp_path: Path, encoder: PromptEncoder) -> None:
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    _check(load_prompt_rows(str(path), encoder))


def test_parquet_rows(tmp_path: Path, encoder: PromptEncoder) -> None:
    path = tmp_path / "train.parquet"
    table = pa.table({
        "prompt": [r.get("prompt") for r in ROWS],
        "answer": [None if r.get("answer") is None else str(r["answer"]) for r in ROWS],
        # tests as a JSON string column, as many exports store them
        "tests": [json.dumps(r["tests"]) if isinstance(r.get("tests"), list) else r.get("tests") for r in ROWS],
    })
    pq.write_table(table, path)
    _check(load_prompt_rows(str(path), encoder))


def test_field_names_and_format_are_configurable(tmp_path: Path, encoder: PromptEncoder) -> None:
    path = tmp_path / "rows.data"
    path.write_text(json.dumps({"question": "2 + 2 =", "solution": "4"}) + "\nnot json\n")
    with pytest.raises(ValueError, match="dataset.format"):
        load_prompt_rows(str(path), encoder)
    loaded = load_prompt_rows(str(path), encoder, fields=RowFields(prompt="question", answer="solution"),
                              file_format="jsonl")
    assert [r.answer for r in loaded.rows] == ["4"] and loaded.num_skipped == 1
    assert "not JSON" in loaded.skipped[0].reason
    assert dataset_format("x.PARQUET") == "parquet" and dataset_format("x.ndjson") == "jsonl"


def test_a_dataset_without_usable_rows_is_an_error(tmp_path: Path, encoder: PromptEncoder) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text(json.dumps({"prompt": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"no usable rows \(1 skipped, e.g. row 0"):
        load_prompt_rows(str(path), encoder)
    with pytest.raises(FileNotFoundError):
        load_prompt_rows(str(tmp_path / "missing.jsonl"), encoder)


CODE_ROWS = [
    # 0: stdin/stdout cases, the input/output spelling, the row's language
    {"prompt": "add", "tests": [{"input": "1 2\n", "output": "3\n", "testtype": "stdin"}], "language": "cpp"},
    # 1: function-call cases with the function they call; only the code verifier applies
    {"prompt": "add", "tests": [{"arguments": [1, 2], "expected": 3}, {"arguments": {"a": 0, "b": 0}, "expected": 0}],
     "function_name": "Solution.add", "verifiers": ["code"]},
    # malformed: each skipped, counted, and reported with its row and field
    {"prompt": "add", "tests": [{"stdin": "1\n", "arguments": [1], "expected": 1}]},
    {"prompt": "add", "tests": [{"stdin": "1\n", "expected_stdout": "1\n"}, {"arguments": [1], "expected": 1}],
     "function_name": "f"},
    {"prompt": "add", "tests": [{"arguments": [1], "expected": 1}]},
    {"prompt": "add", "tests": [{"stdin": 1, "expected_stdout": "1\n"}]},
    {"prompt": "add", "tests": [{"arguments": "1, 2", "expected": 3}], "function_name": "f"},
    {"prompt": "add", "tests": [{"arguments": [1]}], "function_name": "f"},
    {"prompt": "add", "tests": [["1\n", "1\n"]]},
    {"prompt": "add", "tests": [{"stdin": "1\n", "input": "1\n", "output": "1\n"}]},
    {"prompt": "add", "tests": [{"name": "case 1"}]},
    {"prompt": "add", "tests": [{"stdin": "1\n", "expected_stdout": "1\n"}], "function_name": "f"},
    {"prompt": "1 + 1 =", "answer": "2", "verifiers": ["maths"]},
    {"prompt": "1 + 1 =", "answer": "2", "verifiers": "math"},
    {"prompt": "1 + 1 =", "answer": "2", "language": 3},
]
EXPECTED_REASONS = {
    2: "tests[0] mixes stdin/stdout keys with function-call keys",
    3: "tests mixes stdin/stdout and function-call cases",
    4: "tests are function-call cases but field 'function_name' names no function",
    5: "tests[0].stdin must be a string, got int",
    6: "tests[0].arguments must be a list",
    7: "tests[0] has no 'expected'",
    8: "tests[0] must be an object, got list",
    9: "tests[0] needs exactly one of 'stdin' and 'input', got 2",
    10: "tests[0] has neither stdin/expected_stdout (or input/output) nor arguments/expected",
    11: "field 'function_name' is set but tests are stdin/stdout cases",
    12: "field 'verifiers' names 'maths', which the job's reward.verifiers do not list (math, code)",
    13: "field 'verifiers' must be a non-empty list of verifier names",
    14: "field 'language' must be a string, got int",
}


def test_code_rows_are_read_and_malformed_tests_skip_their_row(tmp_path: Path, encoder: PromptEncoder) -> None:
    path = tmp_path / "code.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in CODE_ROWS))
    loaded = load_prompt_rows(str(path), encoder, verifier_names=["math", "code"])
    stdio, calls = loaded.rows
    assert (stdio.index, stdio.language, stdio.verifiers) == (0, "cpp", ())
    assert stdio.tests == RowTests(stdio=(StdioCase("1 2\n", "3\n"),))
    assert (calls.index, calls.language, calls.verifiers) == (1, "", ("code",))
    assert calls.tests == RowTests(function_calls=(FunctionCallCase("[1, 2]", "3"),
                                                   FunctionCallCase('{"a": 0, "b": 0}', "0")),
                                   function_name="Solution.add")
    assert loaded.num_skipped == len(EXPECTED_REASONS)
    reasons = {s.index: s.reason for s in loaded.skipped}
    assert set(reasons) == set(EXPECTED_REASONS)
    for index, expected in EXPECTED_REASONS.items():
        assert expected in reasons[index], (index, reasons[index])
    # without the job's verifier names (no check), a row may name any
    assert 12 not in {s.index for s in load_prompt_rows(str(path), encoder).skipped}


def test_code_field_names_are_configurable(tmp_path: Path, encoder: PromptEncoder) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"q": "add", "cases": [{"arguments": [1], "expected": 1}], "fn_name": "f",
                                "lang": "python", "apply": ["code"]}) + "\n")
    fields = RowFields(prompt="q", tests="cases", function_name="fn_name", language="lang", verifiers="apply")
    (row,) = load_prompt_rows(str(path), encoder, fields=fields, verifier_names=["code"]).rows
    assert (row.tests.function_name, row.language, row.verifiers) == ("f", "python", ("code",))
    assert row.tests.function_calls == (FunctionCallCase("[1]", "1"),)
