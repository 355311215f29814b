"""The checks of a job spec at submission (POST /v1/jobs) that need no dataset: each problem a `JobInputError`
naming the field, which the API answers with a 422.

The libraries of the `tracking` backends it names (installed here); the verifiers of `reward.verifiers` and their
`params` keys against the reward service's (the shared table `everstep.verifiers.VERIFIER_PARAMS`; the values are
the reward service's to check, at the first score); the model's position limit against `sampling.max_new_tokens`
and its experts against `algorithm.routing_replay` (`model_limits`); its modules against
`trainer.lora.target_modules` (`model_modules`). The checks of the input files (chat template, dataset fields)
are in `data.file_checks`, whose `check_job_input` runs every check in order.
"""

from __future__ import annotations

from typing import Any

from everstep.rest.job_spec import JobSpec
from everstep.verifiers import VERIFIER_PARAMS
from everstep_controller.spec.model_limits import check_routing_replay, max_prompt_tokens
from everstep_controller.spec.model_modules import check_lora_targets
from everstep_controller.spec.tracking_libraries import MissingTrackingLibrary, check_tracking_libraries

__all__ = ["JobInputError", "check_lengths", "check_lora_targets_field", "check_routing_replay_field",
           "check_tracking", "check_verifiers"]


class JobInputError(ValueError):
    """Input a job cannot run with; `loc` is the spec field at fault, e.g. ("dataset", "answer_field")."""

    def __init__(self, loc: tuple[str | int, ...], message: str) -> None:
        super().__init__(message)
        self.loc = loc

    def detail(self) -> dict[str, Any]:
        """As FastAPI reports a validation error of the request body."""
        return {"type": "value_error", "loc": ["body", *self.loc], "msg": str(self)}


def check_verifiers(spec: JobSpec) -> None:
    """JobInputError naming a verifier the reward service does not have, or a `params` key it does not read."""
    known = sorted(VERIFIER_PARAMS)
    for index, verifier in enumerate(spec.reward.verifiers):
        loc = ("reward", "verifiers", index)
        options = VERIFIER_PARAMS.get(verifier.name)
        if options is None:
            raise JobInputError((*loc, "name"), f"unknown verifier {verifier.name!r} (known: {', '.join(known)})")
        unknown = sorted(set(verifier.params) - options)
        if unknown:
            raise JobInputError((*loc, "params", unknown[0]), f"params.{unknown[0]}: unknown option of the "
                                f"{verifier.name} verifier (known: {', '.join(sorted(options)) or 'none'})")


def check_tracking(spec: JobSpec) -> None:
    try:
        check_tracking_libraries(spec.tracking)
    except MissingTrackingLibrary as e:
        raise JobInputError(("tracking", e.field), str(e)) from None


def check_lengths(spec: JobSpec) -> None:
    try:
        max_prompt_tokens(spec)
    except ValueError as e:
        field = ("evaluation", "sampling", "max_new_tokens") if str(e).startswith("evaluation.") else (
            "sampling", "max_new_tokens")
        raise JobInputError(field, str(e)) from None


def check_routing_replay_field(spec: JobSpec) -> None:
    try:
        check_routing_replay(spec)
    except ValueError as e:
        raise JobInputError(("algorithm", "routing_replay"), str(e)) from None


def check_lora_targets_field(spec: JobSpec) -> None:
    try:
        check_lora_targets(spec.model_path, spec.trainer.lora)
    except ValueError as e:
        raise JobInputError(("trainer", "lora", "target_modules"), str(e)) from None
