"""common.proto's `ToolErrorKind` by name: the rollout engine sets it on each call of a trajectory; metrics, the REST
history and the CLI write it as its lowercase name without the prefix ("none" for a call that ran as asked)."""

from __future__ import annotations

from everstep.v1 import common_pb2

__all__ = ["TOOL_ERROR_KIND_NAMES", "tool_error_kind_name"]

_PREFIX = "TOOL_ERROR_KIND_"


def tool_error_kind_name(kind: int) -> str:
    if kind == common_pb2.TOOL_ERROR_KIND_UNSPECIFIED:
        return "none"
    try:
        return common_pb2.ToolErrorKind.Name(kind).removeprefix(_PREFIX).lower()
    except ValueError:
        return f"kind_{kind}"


TOOL_ERROR_KIND_NAMES = tuple(tool_error_kind_name(v) for v in common_pb2.ToolErrorKind.values())
