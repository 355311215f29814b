"""RewardPart.error_kind is reward.proto's RewardErrorKind: the controller classifies by the enum, names a
kind by the enum's lowercase name, stores it by that name as before, and reads a part from a reward service
that still sends the old string field as an error without a kind (fatal), saying so."""

from __future__ import annotations

import pytest

from everstep.reward_error_kind import error_kind_from_label, error_kind_label
from everstep.v1 import reward_pb2
from everstep_controller.data.reward_errors import ErrorClass, PartError, classify, describe, part_errors
from everstep_controller.store.progress_store import ScoredSample

LABELS = ["unknown_verifier", "invalid_spec", "invalid_params", "timeout", "sandbox_unavailable", "sandbox_error",
          "worker_crashed", "model_unavailable", "internal", "function_error"]
"""The strings RewardPart.error_kind held: the Prometheus `kind` label values, kept (and function_error, added
with the enum's value 10)."""


def test_every_kind_is_named_as_the_string_was_and_back() -> None:
    kinds = [k for k in reward_pb2.RewardErrorKind.values() if k]
    assert [error_kind_label(k) for k in kinds] == LABELS
    assert [error_kind_from_label(label) for label in LABELS] == kinds
    assert error_kind_label(reward_pb2.REWARD_ERROR_KIND_UNSPECIFIED) == "" and error_kind_from_label("") == 0
    assert error_kind_from_label(error_kind_label(99)) == 99, "a newer sender's kind survives a round trip"
    with pytest.raises(ValueError, match="'invalid_sepc' is not a RewardErrorKind"):
        error_kind_from_label("invalid_sepc")


def _result(*kinds: int) -> reward_pb2.ScoreResult:
    parts = [reward_pb2.RewardPart(verifier=f"v{i}", error="failed", error_kind=k) for i, k in enumerate(kinds)]
    return reward_pb2.ScoreResult(id="s", parts=parts, error="failed")


@pytest.mark.parametrize(("kinds", "expected"), [
    ((reward_pb2.REWARD_ERROR_KIND_INVALID_SPEC,), ErrorClass.ROW),
    ((reward_pb2.REWARD_ERROR_KIND_INVALID_PARAMS,), ErrorClass.JOB_SPEC),
    ((reward_pb2.REWARD_ERROR_KIND_UNKNOWN_VERIFIER, reward_pb2.REWARD_ERROR_KIND_TIMEOUT), ErrorClass.JOB_SPEC),
    ((reward_pb2.REWARD_ERROR_KIND_SANDBOX_UNAVAILABLE, reward_pb2.REWARD_ERROR_KIND_WORKER_CRASHED),
     ErrorClass.TRANSIENT),
    ((reward_pb2.REWARD_ERROR_KIND_TIMEOUT, reward_pb2.REWARD_ERROR_KIND_INVALID_SPEC), ErrorClass.ROW),
    ((reward_pb2.REWARD_ERROR_KIND_FUNCTION_ERROR,), ErrorClass.ROW),
    ((reward_pb2.REWARD_ERROR_KIND_FUNCTION_ERROR, reward_pb2.REWARD_ERROR_KIND_INVALID_PARAMS), ErrorClass.JOB_SPEC),
    ((reward_pb2.REWARD_ERROR_KIND_MODEL_UNAVAILABLE,), ErrorClass.FATAL),
    ((reward_pb2.REWARD_ERROR_KIND_UNSPECIFIED,), ErrorClass.FATAL),
    ((42,), ErrorClass.FATAL),
])
def test_the_class_follows_the_enum(kinds: tuple[int, ...], expected: ErrorClass) -> None:
    result = _result(*kinds)
    assert classify(part_errors(result), result.error) == expected


def test_a_score_is_stored_with_kind_names_and_an_old_stored_score_reads() -> None:
    result = _result(reward_pb2.REWARD_ERROR_KIND_SANDBOX_ERROR)
    scored = ScoredSample(sequence=b"", reward=0.0, error=result.error, part_errors=part_errors(result))
    stored = scored.model_dump_json()
    assert '"kind":"sandbox_error"' in stored, "the scored hash keeps the names it held before the enum"
    assert ScoredSample.model_validate_json(stored) == scored
    old = ('{"sequence": "", "reward": 0.0, "parts": {}, "error": "x", '
           '"part_errors": [{"verifier": "math", "kind": "invalid_spec", "message": "no answer"}]}')
    assert ScoredSample.model_validate_json(old).part_errors == [
        PartError(verifier="math", kind=reward_pb2.REWARD_ERROR_KIND_INVALID_SPEC, message="no answer")]
    assert "(sandbox_error)" in describe("s", scored.part_errors, scored.error)


def test_a_part_from_a_reward_service_before_the_enum_is_fatal_and_says_why() -> None:
    # RewardPart as the old reward.proto encoded it: verifier "code" (1), error "boom" (4), error_kind "timeout" (5)
    old_part = b"\x0a\x04code" + b"\x22\x04boom" + b"\x2a\x07timeout"
    result = reward_pb2.ScoreResult(id="s", error="code: boom", parts=[reward_pb2.RewardPart.FromString(old_part)])
    errors = part_errors(result)
    assert classify(errors, result.error) == ErrorClass.FATAL, "never taken for transient, nor trained on"
    assert "built before reward.proto's RewardErrorKind" in errors[0].message and "boom" in errors[0].message
