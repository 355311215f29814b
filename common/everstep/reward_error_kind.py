"""reward.proto's `RewardErrorKind` by name: the reward service sets the enum, the controller decides
by it, and both write a kind as its lowercase name without the prefix (REWARD_ERROR_KIND_INVALID_SPEC:
"invalid_spec"): the `kind` label of their Prometheus metrics, and the word in messages and reports.
The enum is the one list of kinds; no service spells one out again.
"""

from __future__ import annotations

from everstep.v1 import reward_pb2

__all__ = ["error_kind_from_label", "error_kind_label"]

_PREFIX = "REWARD_ERROR_KIND_"


def error_kind_label(kind: reward_pb2.RewardErrorKind) -> str:
    """The kind's lowercase name; "" for UNSPECIFIED (no kind); `kind_<n>` for a number this build has
    no name for (a newer sender)."""
    if kind == reward_pb2.REWARD_ERROR_KIND_UNSPECIFIED:
        return ""
    try:
        return reward_pb2.RewardErrorKind.Name(kind).removeprefix(_PREFIX).lower()
    except ValueError:
        return f"kind_{kind}"


def error_kind_from_label(label: str) -> reward_pb2.RewardErrorKind:
    """The inverse of `error_kind_label`; ValueError naming the label (and the known ones) for another."""
    if not label:
        return reward_pb2.REWARD_ERROR_KIND_UNSPECIFIED
    if label.startswith("kind_") and label[5:].isdigit():
        return int(label[5:])  # type: ignore[return-value]  # a number this build has no name for
    try:
        return reward_pb2.RewardErrorKind.Value(_PREFIX + label.upper())
    except ValueError:
        known = [error_kind_label(v) for v in reward_pb2.RewardErrorKind.values() if v]
        raise ValueError(f"error kind {label!r} is not a RewardErrorKind (known: {known})") from None
