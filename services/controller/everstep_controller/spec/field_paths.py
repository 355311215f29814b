"""Dataset fields named by dotted paths: `reward_model.ground_truth` is the `ground_truth` of the row's
`reward_model` object (a Parquet struct column, or a JSON object). A name that is itself a key of the row
is that key, dots and all; only otherwise is it split at the dots."""

from __future__ import annotations

from typing import Any, Final

__all__ = ["MISSING", "field_value"]


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


MISSING: Final = _Missing()  # the row has no such field (a field holding null is None)


def field_value(row: dict[str, Any], path: str) -> Any:
    """The value at `path` in `row`, or MISSING."""
    if path in row:
        return row[path]
    value: Any = row
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            return MISSING
        value = value[part]
    return value
