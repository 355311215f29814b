"""A dataset row's code tests, read into the two forms the reward contract knows (docs/reward.md).

- stdin/stdout: `{"stdin": ..., "expected_stdout": ...}` (or `input`/`output`), strings;
- function call: `{"arguments": [...] or {...}, "expected": <any JSON>}`, called on the row's
  function name; both are JSON-encoded here, as `FunctionCallTest` carries them.

Other keys of a case (a dataset's own metadata) are ignored. A row's cases are all of one form
(the reward service runs one program per sample). Anything else is a `ValueError` naming the
field and the case, so the loader can skip the row and say why.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["FunctionCallCase", "RowTests", "StdioCase", "read_row_tests"]

_STDIN_KEYS = ("stdin", "input")
_STDOUT_KEYS = ("expected_stdout", "output")
_FUNCTION_KEYS = ("arguments", "expected")


@dataclass(frozen=True)
class StdioCase:
    stdin: str
    expected_stdout: str


@dataclass(frozen=True)
class FunctionCallCase:
    arguments_json: str  # a JSON array of positional arguments, or an object of keyword arguments
    expected_json: str  # the JSON of the expected return value


@dataclass(frozen=True)
class RowTests:
    """A row's cases: stdin/stdout ones or function-call ones (with the function they call), never both."""

    stdio: tuple[StdioCase, ...] = ()
    function_calls: tuple[FunctionCallCase, ...] = ()
    function_name: str = ""

    def __bool__(self) -> bool:
        return bool(self.stdio or self.function_calls)


def read_row_tests(cases: Sequence[Any], function_name: str, *, field: str, function_name_field: str) -> RowTests:
    """The typed cases of one row; `field`/`function_name_field` name the row fields in errors."""
    stdio: list[StdioCase] = []
    calls: list[FunctionCallCase] = []
    for index, case in enumerate(cases):
        where = f"{field}[{index}]"
        if not isinstance(case, dict):
            raise ValueError(f"{where} must be an object, got {type(case).__name__}")
        if any(k in case for k in _STDIN_KEYS + _STDOUT_KEYS):
            if any(k in case for k in _FUNCTION_KEYS):
                raise ValueError(f"{where} mixes stdin/stdout keys with function-call keys (arguments, expected)")
            stdio.append(StdioCase(_text(case, _STDIN_KEYS, where), _text(case, _STDOUT_KEYS, where)))
        elif any(k in case for k in _FUNCTION_KEYS):
            calls.append(_function_call(case, where))
        else:
            raise ValueError(f"{where} has neither stdin/expected_stdout (or input/output) nor arguments/expected")
    if stdio and calls:
        raise ValueError(f"{field} mixes stdin/stdout and function-call cases; a row's cases are of one form")
    if calls and not function_name:
        raise ValueError(f"{field} are function-call cases but field {function_name_field!r} names no function")
    if stdio and function_name:
        raise ValueError(f"field {function_name_field!r} is set but {field} are stdin/stdout cases")
    return RowTests(tuple(stdio), tuple(calls), function_name)


def _text(case: dict[str, Any], keys: tuple[str, str], where: str) -> str:
    present = [k for k in keys if k in case]
    if len(present) != 1:
        raise ValueError(f"{where} needs exactly one of {keys[0]!r} and {keys[1]!r}, got {len(present)}")
    value = case[present[0]]
    if not isinstance(value, str):
        raise ValueError(f"{where}.{present[0]} must be a string, got {type(value).__name__}")
    return value


def _function_call(case: dict[str, Any], where: str) -> FunctionCallCase:
    for key in _FUNCTION_KEYS:
        if key not in case:
            raise ValueError(f"{where} has no {key!r} (function-call cases need arguments and expected)")
    arguments = case["arguments"]
    if not isinstance(arguments, list | dict):
        raise ValueError(f"{where}.arguments must be a list (or an object of keyword arguments), "
                         f"got {type(arguments).__name__}")
    try:
        return FunctionCallCase(json.dumps(arguments, allow_nan=False), json.dumps(case["expected"], allow_nan=False))
    except (TypeError, ValueError) as e:  # values JSON cannot hold: bytes from Parquet, NaN
        raise ValueError(f"{where} cannot be written as JSON: {e}") from None
