"""Prompt datasets: JSONL and Parquet rows with a prompt and an answer or tests; bad rows are skipped,
counted and reported with their row number and cause."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from everstep_controller.dataset import RowFields, dataset_format, load_prompt_rows
from everstep_controller.row_tests import RowTests, StdioCase

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
def tokenizer() -> Tokenizer:
    words = ["<unk>", "+", "=", "write", "add"] + [str(i) for i in range(10)]
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tok


def _check(loaded) -> None:  # noqa: ANN001
    assert [(r.index, r.prompt, r.answer) for r in loaded.rows] == [(0, "1 + 2 =", "3"), (1, "write add", ""),
                                                                   (4, "4 + 4 =", "8")]
    assert loaded.rows[1].tests == RowTests(stdio=(StdioCase("1 2\n", "3\n"),))
    assert loaded.rows[0].prompt_ids == (6, 1, 7, 2)
    assert loaded.num_skipped == 4
    reasons = {s.index: s.reason for s in loaded.skipped}
    assert set(reasons) == {2, 3, 5, 6}
    assert "neither an answer" in reasons[2] and "no prompt" in reasons[3] and "not JSON" in reasons[6]


def test_jsonl_rows(tmp_path: Path, tokenizer: Tokenizer) -> None:
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    _check(load_prompt_rows(str(path), tokenizer))


def test_parquet_rows(tmp_path: Path, tokenizer: Tokenizer) -> None:
    path = tmp_path / "train.parquet"
    table = pa.table({
        "prompt": [r.get("prompt") for r in ROWS],
        "answer": [None if r.get("answer") is None else str(r["answer"]) for r in ROWS],
        # tests as a JSON string column, as many exports store them
        "tests": [json.dumps(r["tests"]) if isinstance(r.get("tests"), list) else r.get("tests") for r in ROWS],
    })
    pq.write_table(table, path)
    _check(load_prompt_rows(str(path), tokenizer))


def test_field_names_and_format_are_configurable(tmp_path: Path, tokenizer: Tokenizer) -> None:
    path = tmp_path / "rows.data"
    path.write_text(json.dumps({"question": "2 + 2 =", "solution": "4"}) + "\nnot json\n")
    with pytest.raises(ValueError, match="dataset.format"):
        load_prompt_rows(str(path), tokenizer)
    loaded = load_prompt_rows(str(path), tokenizer, fields=RowFields(prompt="question", answer="solution"),
                              file_format="jsonl")
    assert [r.answer for r in loaded.rows] == ["4"] and loaded.num_skipped == 1
    assert "not JSON" in loaded.skipped[0].reason
    assert dataset_format("x.PARQUET") == "parquet" and dataset_format("x.ndjson") == "jsonl"


def test_a_dataset_without_usable_rows_is_an_error(tmp_path: Path, tokenizer: Tokenizer) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text(json.dumps({"prompt": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"no usable rows \(1 skipped, e.g. row 0"):
        load_prompt_rows(str(path), tokenizer)
    with pytest.raises(FileNotFoundError):
        load_prompt_rows(str(tmp_path / "missing.jsonl"), tokenizer)
