"""Whether a dataset file has the fields the job's `dataset.*_field` settings name, before any row is read.

A Parquet file answers from its schema (struct columns by dotted path); a JSONL file from its rows: a
field is there when at least one row has it. Required: the prompt field, and the answer field or the tests
field (one of them at least: a math file has answers, a code file has tests). Any other field is optional
(rows may name their verifiers or language, or not), but a field the spec names other than by default must
be there: a name the user wrote that matches nothing is a mistake, never silently an empty column.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from everstep.rest.job_spec import DatasetSpec
from everstep_controller.data.dataset import dataset_file, dataset_format, dataset_paths
from everstep_controller.spec.field_paths import MISSING, field_value

__all__ = ["DatasetFieldError", "check_dataset_fields", "missing_field_paths"]

SETTINGS = ("prompt_field", "answer_field", "tests_field", "function_name_field", "language_field",
            "verifiers_field")
MAX_LISTED = 30  # fields listed in an error, of those the file has


class DatasetFieldError(ValueError):
    """A `dataset.<setting>` naming a field that a dataset file does not have."""

    def __init__(self, setting: str, message: str) -> None:
        super().__init__(message)
        self.setting = setting  # e.g. "answer_field"


def check_dataset_fields(spec: DatasetSpec) -> None:
    """DatasetFieldError for the first missing field, of dataset.train_path then dataset.eval_path.

    Every file of each (a list of files and glob patterns is expanded: `dataset_paths`) is checked.
    FileNotFoundError for a file that does not exist (DatasetPathError for a pattern matching none); each
    file's format is dataset.format's."""
    for setting in ("train_path", "eval_path"):
        paths = getattr(spec, setting)
        if paths is not None:
            for path in dataset_paths(paths, setting):
                _check_file(spec, path)


def _check_file(spec: DatasetSpec, path: str) -> None:
    names = {setting: getattr(spec, setting) for setting in SETTINGS}
    missing, present = missing_field_paths(path, set(names.values()), spec.format.value)
    # set by the user: other than the default (a spec read back from the job store has every field set)
    explicit = {setting for setting, name in names.items() if name != DatasetSpec.model_fields[setting].default}
    hint = _answer_hint(present)
    for setting, name in names.items():
        if name in missing and (setting == "prompt_field" or setting in explicit):
            raise DatasetFieldError(setting, f"dataset.{setting} names {name!r}, which no row of {path} has (it has "
                                    f"{_listing(present)})" + (f"; {hint}" if setting == "answer_field" else ""))
    if spec.answer_field in missing and spec.tests_field in missing:
        raise DatasetFieldError("answer_field", f"dataset.answer_field {spec.answer_field!r} and dataset.tests_field "
                                f"{spec.tests_field!r}: no row of {path} has either (it has {_listing(present)})"
                                + f"; {hint}")


def missing_field_paths(path: str, wanted: Iterable[str], file_format: str = "auto") -> tuple[set[str], list[str]]:
    """Of the `wanted` field paths, those the file lacks; and the field paths it has (nested ones dotted)."""
    wanted = set(wanted)
    file = dataset_file(path)
    if dataset_format(path, file_format) == "parquet":
        import pyarrow.parquet as pq  # only Parquet datasets need it

        schema = pq.read_schema(file)
        present = list(_schema_paths(schema.names, [schema.field(n).type for n in schema.names]))
    else:
        present = _jsonl_paths(file, wanted)
    have = set(present)
    return {w for w in wanted if w not in have}, present


def _schema_paths(names: list[str], types: list[Any], prefix: str = "") -> Iterator[str]:
    import pyarrow as pa

    for name, type_ in zip(names, types, strict=True):
        yield prefix + name
        if pa.types.is_struct(type_):
            yield from _schema_paths([type_.field(i).name for i in range(type_.num_fields)],
                                     [type_.field(i).type for i in range(type_.num_fields)], f"{prefix}{name}.")


def _jsonl_paths(file: Path, wanted: set[str]) -> list[str]:
    """Field paths found in the file's rows (up to the row where every one of `wanted` was seen)."""
    found: dict[str, None] = {}
    with file.open() as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # reported as a skipped row when the rows are read
            if not isinstance(row, dict):
                continue
            for key in _dict_paths(row):
                found.setdefault(key)
            for w in wanted:
                if w not in found and field_value(row, w) is not MISSING:
                    found[w] = None
            if wanted.issubset(found):
                break  # all there: the rest of the file cannot change the answer
    return list(found)


def _dict_paths(value: dict[str, Any], prefix: str = "") -> Iterator[str]:
    for key, item in value.items():
        yield prefix + key
        if isinstance(item, dict):
            yield from _dict_paths(item, f"{prefix}{key}.")


def _listing(present: list[str]) -> str:
    if not present:
        return "no fields"
    shown = ", ".join(present[:MAX_LISTED])
    return f"fields {shown}" + (f" and {len(present) - MAX_LISTED} more" if len(present) > MAX_LISTED else "")


def _answer_hint(present: list[str]) -> str:
    """Where the answer is in verl's and TRL's files when the file looks like one; else how fields are named."""
    if "reward_model.ground_truth" in present:
        return "a verl file: set answer_field: reward_model.ground_truth"
    if "solution" in present:
        return "a TRL file: set answer_field: solution"
    return "fields are column names or dotted paths into struct columns, e.g. reward_model.ground_truth"
