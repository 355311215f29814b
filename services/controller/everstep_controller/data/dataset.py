"""Prompt datasets: JSONL or Parquet rows with a prompt and an answer or tests, tokenized without torch.

A row needs the prompt field (a string or a list of {role, content} messages, rendered by
`prompt_rendering`) and at least one of the answer and tests fields (a math task has an answer, a code
task has tests); fields are named by dotted paths into nested columns (`field_paths`). A row may also say
which of the job's verifiers apply to it (`verifiers`, default all), the sandbox language of its code
(`language`) and the function its function-call tests call (`function_name`); `row_tests` reads the
tests. Rows without a prompt or an answer or tests, whose fields have the wrong type, whose tests are
malformed, that name a verifier the job does not have, whose prompt the chat template refuses or whose
prompt is longer than `max_prompt_length` (the job's dataset.max_prompt_length) or `max_prompt_tokens` (what the
model's positions leave), are skipped: each is logged with its row number and cause,
counted, and the first few are kept for the job record, so a user sees what was left out.
"""

from __future__ import annotations

import glob
import json
import logging
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from everstep_controller.data.chat_template import ChatMessage
from everstep_controller.data.prompt_rendering import PromptEncoder, RowPrompt, read_row_prompt, user_content
from everstep_controller.data.row_tests import RowTests, read_row_tests
from everstep_controller.spec.field_paths import MISSING, field_value

log = logging.getLogger(__name__)

MAX_REPORTED_SKIPS = 20


@dataclass(frozen=True)
class PromptRow:
    index: int  # row number in the file (0-based), stable across restarts
    prompt: str  # the user's text (the prompt string, or the last user message's), what the reward service reads
    answer: str  # "" when the row has tests only
    prompt_ids: tuple[int, ...]
    tests: RowTests = RowTests()  # code cases (empty when the row has an answer only)
    language: str = ""  # sandbox language of the row's code; "": the job's code verifier default
    verifiers: tuple[str, ...] = ()  # the job's verifiers that apply to this row; (): all of them
    messages: tuple[ChatMessage, ...] = ()  # the row's prompt when it is a list of messages; (): it is `prompt`

    @property
    def row_prompt(self) -> RowPrompt:
        """The prompt as the row gave it: its messages, or its string."""
        return self.messages or self.prompt


@dataclass(frozen=True)
class SkippedRow:
    index: int
    reason: str


@dataclass(frozen=True)
class LoadedDataset:
    rows: list[PromptRow]
    num_skipped: int  # rows left out at load (no prompt, neither answer nor tests, malformed, too long), reported
    skipped: list[SkippedRow] = field(default_factory=list)  # the first MAX_REPORTED_SKIPS of them


@dataclass(frozen=True)
class RowFields:
    """Which fields of a row hold what: column names, or dotted paths into nested columns."""

    prompt: str = "prompt"
    answer: str = "answer"
    tests: str = "tests"
    function_name: str = "function_name"
    language: str = "language"
    verifiers: str = "verifiers"


def load_tokenizer(model_path: str) -> Tokenizer:
    path = Path(model_path) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"model_path {model_path!r} has no tokenizer.json")
    return Tokenizer.from_file(str(path))


def dataset_file(path: str) -> Path:
    """The dataset file at `path`; FileNotFoundError when there is none."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"dataset file {path!r} does not exist")
    return file


class DatasetPathError(FileNotFoundError):
    """A `dataset.<setting>` entry naming no file: a glob pattern that matches nothing, or a missing file.

    `loc`: the spec field, e.g. ("dataset", "train_path") or ("dataset", "train_path", 1) for a list's entry."""

    def __init__(self, loc: tuple[str | int, ...], message: str) -> None:
        super().__init__(message)
        self.loc = loc


def dataset_paths(paths: str | Sequence[str], setting: str = "train_path") -> list[str]:
    """The files `paths` names, in order, as verl's data.train_files: a file, or a list of files and glob
    patterns, each pattern's matches sorted by name. A name that is a file is taken as it is (even when it
    looks like a pattern); a pattern is what `glob.has_magic` says is one.

    DatasetPathError naming `dataset.<setting>` (and the list entry) for a pattern that matches no file.
    A plain name is not checked here: reading it reports a missing file."""
    entries = [paths] if isinstance(paths, str) else list(paths)
    files: list[str] = []
    for i, entry in enumerate(entries):
        loc: tuple[str | int, ...] = ("dataset", setting) if isinstance(paths, str) else ("dataset", setting, i)
        if not glob.has_magic(entry) or Path(entry).is_file():
            files.append(entry)
            continue
        matches = sorted(m for m in glob.glob(entry, recursive=True) if Path(m).is_file())
        if not matches:
            name = f"dataset.{setting}" + ("" if isinstance(paths, str) else f"[{i}]")
            raise DatasetPathError(loc, f"{name}: the pattern {entry!r} matches no file")
        files.extend(matches)
    return files


def pattern_folder(pattern: str) -> Path:
    """The folder of a glob pattern before its first wildcard part: whether it exists tells if the
    pattern can be checked now."""
    parts = Path(pattern).parts
    fixed = [p for p in parts[: next((i for i, p in enumerate(parts) if glob.has_magic(p)), len(parts))]]
    return Path(*fixed) if fixed else Path(".")


_FORMAT_BY_SUFFIX = {".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet", ".pq": "parquet"}


def dataset_format(path: str, declared: str = "auto") -> str:
    """'jsonl' or 'parquet': as declared, else from the file name. A file whose name says the other format
    than the declared one is a ValueError naming both (every file of a job shares dataset.format; with
    'auto', each file has its own)."""
    suffix = Path(path).suffix.lower()
    named = _FORMAT_BY_SUFFIX.get(suffix)
    if declared != "auto":
        if named is not None and named != declared:
            raise ValueError(f"dataset file {path!r} is named as {named} but dataset.format is {declared!r}; "
                             "set dataset.format to 'auto' to read each file by its name")
        return declared
    if named is not None:
        return named
    raise ValueError(f"cannot tell the format of dataset {path!r} from its name; set dataset.format "
                     "to 'jsonl' or 'parquet'")


def load_prompt_rows(path: str | Sequence[str], encoder: PromptEncoder, *, fields: RowFields | None = None,
                     file_format: str = "auto", verifier_names: Collection[str] | None = None,
                     max_prompt_tokens: int | None = None, setting: str = "train_path",
                     max_prompt_length: int | None = None) -> LoadedDataset:
    """path: a file, or a list of files and glob patterns (`dataset_paths`; `setting` names the spec field
    in its errors): the files' rows in order, numbered across the files (a row's index is its row number
    in the first file, then continues after the first file's last row, and so on).
    file_format: every file's ('auto': each file's from its name).
    encoder: how prompts become ids (`PromptEncoder(tokenizer)`: the raw text).
    verifier_names: the job's verifiers; a row naming another one is skipped (None: not checked).
    max_prompt_tokens: a row whose prompt ids are more is skipped (None: any length).
    max_prompt_length: the same, the user's limit (dataset.max_prompt_length, named in the skip's reason)."""
    fields = fields or RowFields()
    files = [(name, dataset_file(name)) for name in dataset_paths(path, setting)]
    rows: list[PromptRow] = []
    skipped: list[SkippedRow] = []
    num_skipped = 0
    offset = 0
    for name, file in files:
        prefix = f"{name}: " if len(files) > 1 else ""
        offset, file_skipped = _load_file(name, file, offset, encoder, fields, file_format, verifier_names,
                                          (max_prompt_length, max_prompt_tokens), rows, skipped, prefix)
        num_skipped += file_skipped
    if not rows:
        shown = path if isinstance(path, str) else ", ".join(path)
        raise ValueError(f"dataset {shown!r} has no usable rows ({num_skipped} skipped"
                         + (f", e.g. row {skipped[0].index}: {skipped[0].reason})" if skipped else ")"))
    return LoadedDataset(rows, num_skipped, skipped)


def _load_file(path: str, file: Path, offset: int, encoder: PromptEncoder, fields: RowFields, file_format: str,
               verifier_names: Collection[str] | None, prompt_limits: tuple[int | None, int | None],
               rows: list[PromptRow], skipped: list[SkippedRow], prefix: str) -> tuple[int, int]:
    """Appends the file's rows (indexes from `offset`) and its first skips; the next file's offset and the
    number of rows skipped."""
    reader = _parquet_rows if dataset_format(path, file_format) == "parquet" else _jsonl_rows
    num_skipped = 0
    end = offset
    for local, raw in reader(file):
        index = offset + local
        end = index + 1
        try:
            row = _row_of(index, raw, fields, verifier_names)
            row = replace(row, prompt_ids=encoder.encode(row.row_prompt, fields.prompt))
            max_prompt_length, max_prompt_tokens = prompt_limits
            if max_prompt_length is not None and len(row.prompt_ids) > max_prompt_length:
                raise ValueError(f"prompt is {len(row.prompt_ids)} tokens, more than dataset.max_prompt_length "
                                 f"({max_prompt_length})")
            if max_prompt_tokens is not None and len(row.prompt_ids) > max_prompt_tokens:
                raise ValueError(f"prompt is {len(row.prompt_ids)} tokens, more than max_prompt_tokens "
                                 f"({max_prompt_tokens})")
        except ValueError as e:
            num_skipped += 1
            if len(skipped) < MAX_REPORTED_SKIPS:
                skipped.append(SkippedRow(index, f"{prefix}{e}"))
            log.warning("dataset %s row %d skipped: %s", path, local, e)
            continue
        rows.append(row)
    return end, num_skipped


def _row_of(index: int, raw: Any, fields: RowFields, verifier_names: Collection[str] | None) -> PromptRow:
    """The row without its prompt ids; ValueError naming the field that is wrong."""
    if isinstance(raw, _Unreadable):
        raise ValueError(raw.reason)
    if not isinstance(raw, dict):
        raise ValueError(f"row is a {type(raw).__name__}, not an object")
    prompt = read_row_prompt(_value(raw, fields.prompt), fields.prompt)
    answer = _value(raw, fields.answer)
    cases = _value(raw, fields.tests)
    if isinstance(cases, str):  # tests stored as a JSON string (common in Parquet exports)
        try:
            cases = json.loads(cases)
        except json.JSONDecodeError as e:
            raise ValueError(f"field {fields.tests!r} is a string but not JSON: {e}") from None
    if cases is not None and not isinstance(cases, list | tuple):
        raise ValueError(f"field {fields.tests!r} must be a list, got {type(cases).__name__}")
    if answer is None and not cases:
        raise ValueError(f"neither an answer in field {fields.answer!r} nor tests in field {fields.tests!r}")
    if isinstance(answer, dict | list):
        raise ValueError(f"field {fields.answer!r} must be a string or number, got {type(answer).__name__}")
    tests = read_row_tests(cases or (), _optional_text(raw, fields.function_name), field=fields.tests,
                           function_name_field=fields.function_name)
    return PromptRow(index, user_content(prompt), "" if answer is None else str(answer), (), tests,
                     _optional_text(raw, fields.language), _verifiers_of(raw, fields.verifiers, verifier_names),
                     () if isinstance(prompt, str) else prompt)


def _value(raw: dict[str, Any], path: str) -> Any:
    """The row's value at `path`; None when it has none."""
    value = field_value(raw, path)
    return None if value is MISSING else value


def _optional_text(raw: dict[str, Any], name: str) -> str:
    value = _value(raw, name)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ValueError(f"field {name!r} must be a string, got {type(value).__name__}")
    return value.strip()


def _verifiers_of(raw: dict[str, Any], name: str, known: Collection[str] | None) -> tuple[str, ...]:
    value = _value(raw, name)
    if value is None:
        return ()
    if not isinstance(value, list | tuple) or not value or not all(isinstance(v, str) and v for v in value):
        raise ValueError(f"field {name!r} must be a non-empty list of verifier names, got {value!r}")
    names = tuple(dict.fromkeys(value))  # in order, without repeats
    unknown = [v for v in names if known is not None and v not in known]
    if unknown:
        raise ValueError(f"field {name!r} names {', '.join(map(repr, unknown))}, which the job's reward.verifiers "
                         f"do not list ({', '.join(known)})")
    return names


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

