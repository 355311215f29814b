"""What the controller does with a reward the reward service could not compute.

A `ScoreResult` with `error` set has one `RewardPart` per verifier, each failed part with an
`error_kind` (reward.proto's `RewardErrorKind`; docs/reward.md, "Errors"). No sample is ever trained
on such a reward; the kinds (by their lowercase names, `everstep.reward_error_kind`) decide what
happens instead:

- `row`: `invalid_spec` from a row's data (a missing answer, tests the verifier cannot run, a
  language the sandbox does not know). The sample's whole group is left out of training, counted
  and reported with its row; the job goes on.
  So is `function_error`: a user's reward function (`reward.functions`) raised, timed out, returned no number
  or imported what the reward service does not allow, on this row; the message is the exception's text.
- `job_spec`: the job's reward spec, which every row shares, is wrong: `unknown_verifier` (rows
  can name only the job's verifiers, checked at load) or `invalid_params` (only the job spec sets
  params; names and keys are checked at submission, values only here). The job fails with the cause:
  dropping every group instead would train nothing, quietly.
- `transient`: `timeout`, `sandbox_unavailable`, `sandbox_error`, `worker_crashed`. The scorer
  asks again a few times (`ScorerPool`), then the error fails the job with its cause.
- `fatal`: anything else (`model_unavailable`, `internal`, an error without a kind, such as the
  string `error_kind` of a reward service built before the enum). The job fails with the cause.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from google.protobuf.unknown_fields import UnknownFieldSet
from pydantic import BaseModel, BeforeValidator, PlainSerializer

from everstep.reward_error_kind import error_kind_from_label, error_kind_label
from everstep.v1 import reward_pb2

__all__ = ["ErrorClass", "PartError", "RewardFailed", "classify", "describe", "part_errors", "row_error"]

_ROW_KINDS = frozenset({reward_pb2.REWARD_ERROR_KIND_INVALID_SPEC, reward_pb2.REWARD_ERROR_KIND_FUNCTION_ERROR})
_JOB_SPEC_KINDS = frozenset({reward_pb2.REWARD_ERROR_KIND_UNKNOWN_VERIFIER,
                             reward_pb2.REWARD_ERROR_KIND_INVALID_PARAMS})
_TRANSIENT_KINDS = frozenset({reward_pb2.REWARD_ERROR_KIND_TIMEOUT, reward_pb2.REWARD_ERROR_KIND_SANDBOX_UNAVAILABLE,
                              reward_pb2.REWARD_ERROR_KIND_SANDBOX_ERROR, reward_pb2.REWARD_ERROR_KIND_WORKER_CRASHED})
_STRING_ERROR_KIND_FIELD = 5  # RewardPart's `string error_kind` before RewardErrorKind (reserved now)


class ErrorClass(StrEnum):
    ROW = "row"
    JOB_SPEC = "job_spec"
    TRANSIENT = "transient"
    FATAL = "fatal"


def _kind_from_label(value: object) -> object:
    return error_kind_from_label(value) if isinstance(value, str) else value


_StoredKind = Annotated[int, BeforeValidator(_kind_from_label), PlainSerializer(error_kind_label, return_type=str)]
"""A RewardErrorKind, stored (in the scored hash) by its label, as when RewardPart.error_kind was a string."""


class PartError(BaseModel):
    """One verifier's failure on one item, as the reward service reported it."""

    verifier: str
    kind: _StoredKind  # RewardPart.error_kind
    message: str

    @property
    def label(self) -> str:
        """The kind's lowercase name (invalid_spec): metric labels, reports and messages."""
        return error_kind_label(self.kind)


class RewardFailed(RuntimeError):
    """A reward that no retry will produce and that is no fault of one row: the job fails with it."""


def part_errors(result: reward_pb2.ScoreResult) -> list[PartError]:
    return [PartError(verifier=p.verifier, kind=p.error_kind, message=_message(p)) for p in result.parts if p.error]


def _message(part: reward_pb2.RewardPart) -> str:
    if part.error_kind == reward_pb2.REWARD_ERROR_KIND_UNSPECIFIED and any(
            f.field_number == _STRING_ERROR_KIND_FIELD for f in UnknownFieldSet(part)):
        return (f"{part.error} [a reward service built before reward.proto's RewardErrorKind sent its kind as "
                "a string (field 5); upgrade it]")
    return part.error


def classify(errors: list[PartError], error: str) -> ErrorClass | None:
    """None for a reward without error; else the class of its most serious part.

    A permanent cause outranks a transient one (asking again cannot fix a bad row), and a fault of
    the job or the service outranks a bad row (it is not the row's fault).
    """
    if not error and not errors:
        return None
    if not errors:  # an item-level error without parts (e.g. no verifiers): the controller built it wrong
        return ErrorClass.FATAL
    if any(e.kind in _JOB_SPEC_KINDS for e in errors):
        return ErrorClass.JOB_SPEC
    if any(e.kind not in _TRANSIENT_KINDS and e.kind not in _ROW_KINDS for e in errors):
        return ErrorClass.FATAL
    if row_error(errors) is not None:
        return ErrorClass.ROW
    return ErrorClass.TRANSIENT


def row_error(errors: list[PartError]) -> PartError | None:
    """The first part that failed for the row's data, if any."""
    return next((e for e in errors if e.kind in _ROW_KINDS), None)


def describe(sample_id: str, errors: list[PartError], error: str) -> str:
    """The message a failed job carries for this sample."""
    cause = "; ".join(f"{e.verifier}: {e.message} ({e.label})" for e in errors) or error
    if classify(errors, error) == ErrorClass.JOB_SPEC:
        return (f"the job's reward spec is wrong (fix reward.verifiers or reward.functions), e.g. for sample "
                f"{sample_id}: {cause}")
    return f"reward for sample {sample_id} failed: {cause}"
