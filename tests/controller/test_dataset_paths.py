"""dataset.train_path / eval_path as verl's data.train_files: one file, or a list of files and glob patterns."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError
from tokenizers import Tokenizer, models, pre_tokenizers

from everstep.rest.job_spec import DatasetSpec, JobSpec
from everstep_controller.data.dataset import DatasetPathError, dataset_paths, load_prompt_rows
from everstep_controller.data.dataset_columns import DatasetFieldError, check_dataset_fields
from everstep_controller.data.file_checks import check_job_input
from everstep_controller.data.prompt_rendering import PromptEncoder
from everstep_controller.spec.submission_checks import JobInputError


@pytest.fixture(scope="module")
def encoder() -> PromptEncoder:
    words = ["<unk>", "+", "="] + [str(i) for i in range(10)]
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PromptEncoder(tok)


def _jsonl(path: Path, rows: list[dict]) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_a_string_stays_valid_and_a_list_needs_entries() -> None:
    assert DatasetSpec(train_path="/d/a.jsonl").train_path == "/d/a.jsonl"
    assert DatasetSpec(train_path=["/d/a.jsonl", "/d/*.parquet"]).train_path == ["/d/a.jsonl", "/d/*.parquet"]
    with pytest.raises(ValidationError, match="train_path"):
        DatasetSpec(train_path=[])
    with pytest.raises(ValidationError, match="train_path"):
        DatasetSpec(train_path=["/d/a.jsonl", ""])


def test_files_and_sorted_glob_matches_in_order(tmp_path: Path) -> None:
    for name in ("b.jsonl", "a.jsonl", "c.txt"):
        _jsonl(tmp_path / "shards" / name, [{"prompt": "1", "answer": "1"}])
    first = _jsonl(tmp_path / "first.jsonl", [{"prompt": "1", "answer": "1"}])
    files = dataset_paths([first, str(tmp_path / "shards" / "*.jsonl")])
    assert files == [first, str(tmp_path / "shards" / "a.jsonl"), str(tmp_path / "shards" / "b.jsonl")]
    assert dataset_paths(str(tmp_path / "shards" / "*.jsonl"))[0].endswith("a.jsonl"), "a string pattern expands"
    assert dataset_paths("/nowhere/plain.jsonl") == ["/nowhere/plain.jsonl"], "a plain name is left to the reader"


def test_a_pattern_matching_nothing_names_the_field_and_entry(tmp_path: Path) -> None:
    with pytest.raises(DatasetPathError, match=r"dataset.eval_path\[1\]: the pattern .* matches no file") as e:
        dataset_paths(["/x.jsonl", str(tmp_path / "*.parquet")], "eval_path")
    assert e.value.loc == ("dataset", "eval_path", 1)
    with pytest.raises(DatasetPathError, match="dataset.train_path: the pattern") as e:
        dataset_paths(str(tmp_path / "*.parquet"))
    assert e.value.loc == ("dataset", "train_path")


def test_rows_concatenate_with_indexes_across_files_and_formats(tmp_path: Path, encoder: PromptEncoder) -> None:
    a = _jsonl(tmp_path / "a.jsonl", [{"prompt": "1 + 1 =", "answer": "2"}, {"prompt": "no answer"}])
    b = tmp_path / "b.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "2 + 2 =", "answer": "4"}]), b)
    loaded = load_prompt_rows([a, str(b)], encoder)
    assert [(r.index, r.answer) for r in loaded.rows] == [(0, "2"), (2, "4")], "indexes continue after file a"
    assert loaded.num_skipped == 1 and loaded.skipped[0].index == 1 and loaded.skipped[0].reason.startswith(a)
    with pytest.raises(ValueError, match="is named as parquet but dataset.format is .jsonl."):  # every file's
        load_prompt_rows([a, str(b)], encoder, file_format="jsonl")


def test_every_file_is_checked_for_the_fields(tmp_path: Path) -> None:
    good = _jsonl(tmp_path / "good.jsonl", [{"question": "1", "answer": "1"}])
    bad = _jsonl(tmp_path / "bad.jsonl", [{"prompt": "1", "answer": "1"}])
    with pytest.raises(DatasetFieldError, match="bad.jsonl"):
        check_dataset_fields(DatasetSpec(train_path=[good, bad], prompt_field="question"))


def test_submission_refuses_a_pattern_matching_nothing_in_an_existing_folder(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    train = _jsonl(tmp_path / "train.jsonl", [{"prompt": "1", "answer": "1"}])
    spec = JobSpec(model_path=str(model), dataset={"train_path": [train, str(tmp_path / "shards-*.jsonl")]})
    with pytest.raises(JobInputError, match="matches no file") as e:
        check_job_input(spec)
    assert e.value.loc == ("dataset", "train_path", 1)
    # a folder that does not exist yet: not checkable now, the job's load reports it
    check_job_input(JobSpec(model_path=str(model), dataset={"train_path": "/not/yet/*.jsonl"}))


def test_at_load_a_pattern_matching_nothing_fails_naming_the_field(tmp_path: Path) -> None:
    train = _jsonl(tmp_path / "train.jsonl", [{"prompt": "1", "answer": "1"}])
    with pytest.raises(FileNotFoundError, match=r"dataset.eval_path: the pattern .*later-\*.jsonl' matches no file"):
        check_dataset_fields(DatasetSpec(train_path=train, eval_path=str(tmp_path / "later-*.jsonl")))
