"""Prompt datasets: JSONL or Parquet rows with a prompt and an answer or tests, tokenized without torch.

A row needs the prompt field and at least one of the answer and tests fields (a math task has an
answer, a code task has tests). Rows without them, or whose fields have the wrong type, are
skipped: each is logged with its row number and cause, counted, and the first few are kept for
the job record, so a user sees what was left out.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

log = logging.getLogger(__name__)

MAX_REPORTED_SKIPS = 20


@dataclass(frozen=True)
class PromptRow:
    index: int  # row number in the file (0-based), stable across restarts
    prompt: str
    answer: str  # "" when the row has tests only
    prompt_ids: tuple[int, ...]
    tests: tuple[Any, ...] = ()  # the row's tests as given (JSON values), for code verifiers


@dataclass(frozen=True)
class SkippedRow:
    index: int
    reason: str


@dataclass(frozen=True)
class LoadedDataset:
    rows: list[PromptRow]
    num_skipped: int  # rows without a prompt, or without both answer and tests, reported and left out
    skipped: list[SkippedRow] = field(default_factory=list)  # the first MAX_REPORTED_SKIPS of them


@dataclass(frozen=True)
class RowFields:
    """Which fields of a row hold what."""

    prompt: str = "prompt"
    answer: str = "answer"
    tests: str = "tests"


def load_tokenizer(model_path: str) -> Tokenizer:
    path = Path(model_path) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"model_path {model_path!r} has no tokenizer.json")
    return Tokenizer.from_file(str(path))


def dataset_format(path: str, declared: str = "auto") -> str:
    """'jsonl' or 'parquet': as declared, else from the file name."""
    if declared != "auto":
        return declared
    suffix = Path(path).suffix.lower()
    if suffix in (".jsonl", ".json", ".ndjson"):
        return "jsonl"
    if suffix in (".parquet", ".pq"):
        return "parquet"
    raise ValueError(f"cannot tell the format of dataset {path!r} from its name; set dataset.format "
                     "to 'jsonl' or 'parquet'")


def load_prompt_rows(path: str, tokenizer: Tokenizer, *, fields: RowFields | None = None,
                     file_format: str = "auto") -> LoadedDataset:
    fields = fields or RowFields()
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"dataset file {path!r} does not exist")
    reader = _parquet_rows if dataset_format(path, file_format) == "parquet" else _jsonl_rows
    rows: list[PromptRow] = []
    skipped: list[SkippedRow] = []
    num_skipped = 0
    for index, raw in reader(file):
        try:
            prompt, answer, tests = _fields_of(raw, fields)
        except ValueError as e:
            num_skipped += 1
            if len(skipped) < MAX_REPORTED_SKIPS:
                skipped.append(SkippedRow(index, str(e)))
            log.warning("dataset %s row %d skipped: %s", path, index, e)
            continue
        rows.append(PromptRow(index, prompt, answer, tuple(tokenizer.encode(prompt).ids), tests))
    if not rows:
        raise ValueError(f"dataset {path!r} has no usable rows ({num_skipped} skipped"
                         + (f", e.g. row {skipped[0].index}: {skipped[0].reason})" if skipped else ")"))
    return LoadedDataset(rows, num_skipped, skipped)


def _fields_of(raw: Any, fields: RowFields) -> tuple[str, str, tuple[Any, ...]]:
    if isinstance(raw, _Unreadable):
        raise ValueError(raw.reason)
    if not isinstance(raw, dict):
        raise ValueError(f"row is a {type(raw).__name__}, not an object")
    prompt = raw.get(fields.prompt)
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError(f"no prompt in field {fields.prompt!r}")
    answer = raw.get(fields.answer)
    tests = raw.get(fields.tests)
    if isinstance(tests, str):  # tests stored as a JSON string (common in Parquet exports)
        try:
            tests = json.loads(tests)
        except json.JSONDecodeError as e:
            raise ValueError(f"field {fields.tests!r} is a string but not JSON: {e}") from None
    if tests is not None and not isinstance(tests, list | tuple):
        raise ValueError(f"field {fields.tests!r} must be a list, got {type(tests).__name__}")
    if answer is None and not tests:
        raise ValueError(f"neither an answer in field {fields.answer!r} nor tests in field {fields.tests!r}")
    if isinstance(answer, dict | list):
        raise ValueError(f"field {fields.answer!r} must be a string or number, got {type(answer).__name__}")
    return prompt, "" if answer is None else str(answer), tuple(tests or ())


def _jsonl_rows(file: Path) -> Iterator[tuple[int, Any]]:
    with file.open() as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield line_number - 1, json.loads(line)
            except json.JSONDecodeError as e:
                yield line_number - 1, _Unreadable(f"not JSON: {e}")


def _parquet_rows(file: Path) -> Iterator[tuple[int, Any]]:
    import pyarrow.parquet as pq  # only Parquet datasets need it

    index = 0
    for batch in pq.ParquetFile(file).iter_batches(batch_size=4096):
        for row in batch.to_pylist():
            yield index, row
            index += 1


class _Unreadable:
    """A row that could not be parsed; `_fields_of` reports it with its cause."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

