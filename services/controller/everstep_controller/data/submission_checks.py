"""Checks of a job's input files at submission (POST /v1/jobs), so that a mistake is a 422 naming the field.

What can be told before the job runs: the libraries of the `tracking` backends it names (installed here), the
verifiers of `reward.verifiers` and their `params` keys against the reward service's (the shared table
`everstep.verifiers.VERIFIER_PARAMS`; the values are the reward service's to check, at the first score), and
from the files: the model's chat template against `prompt.format`
and `prompt.system`, the model's position limit against `sampling.max_new_tokens` and its experts against
`algorithm.routing_replay` (`model_limits`), its modules against `trainer.lora.target_modules`
(`model_modules`), and the
dataset's fields against `dataset.*_field` (`dataset_columns`), and that a glob pattern of
`dataset.train_path`/`eval_path` whose folder exists matches a file. A file that does
not exist or cannot be read at submission is not checked here: the job then fails when it loads its data,
with the cause in its record (a file may be written after the job is submitted). The job's load runs the
same checks, so a job never trains on input these would refuse.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from everstep.rest.job_spec import JobSpec, PromptFormat
from everstep.verifiers import VERIFIER_PARAMS
from everstep_controller.data.chat_template import ChatTemplateError, read_chat_template
from everstep_controller.data.dataset import DatasetPathError, dataset_paths, pattern_folder
from everstep_controller.data.dataset_columns import DatasetFieldError, check_dataset_fields
from everstep_controller.data.prompt_rendering import resolve_prompt_format, tool_template
from everstep_controller.spec.model_limits import check_routing_replay, max_prompt_tokens
from everstep_controller.spec.model_modules import check_lora_targets
from everstep_controller.spec.tracking_libraries import MissingTrackingLibrary, check_tracking_libraries

__all__ = ["JobInputError", "check_job_input", "check_verifiers"]


class JobInputError(ValueError):
    """Input a job cannot run with; `loc` is the spec field at fault, e.g. ("dataset", "answer_field")."""

    def __init__(self, loc: tuple[str | int, ...], message: str) -> None:
        super().__init__(message)
        self.loc = loc

    def detail(self) -> dict[str, Any]:
        """As FastAPI reports a validation error of the request body."""
        return {"type": "value_error", "loc": ["body", *self.loc], "msg": str(self)}


def check_job_input(spec: JobSpec) -> None:
    """JobInputError for the first problem found in the spec's verifiers and the files that can be read now."""
    check_verifiers(spec)
    _check_tracking(spec)
    _check_prompt_format(spec)
    _check_tools(spec)
    _check_lengths(spec)
    _check_routing_replay(spec)
    _check_lora_targets(spec)
    _check_dataset_fields(spec)


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


def _check_tracking(spec: JobSpec) -> None:
    try:
        check_tracking_libraries(spec.tracking)
    except MissingTrackingLibrary as e:
        raise JobInputError(("tracking", e.field), str(e)) from None


def _check_lengths(spec: JobSpec) -> None:
    try:
        max_prompt_tokens(spec)
    except ValueError as e:
        raise JobInputError(("sampling", "max_new_tokens"), str(e)) from None


def _check_routing_replay(spec: JobSpec) -> None:
    try:
        check_routing_replay(spec)
    except ValueError as e:
        raise JobInputError(("algorithm", "routing_replay"), str(e)) from None


def _check_lora_targets(spec: JobSpec) -> None:
    try:
        check_lora_targets(spec.model_path, spec.trainer.lora)
    except ValueError as e:
        raise JobInputError(("trainer", "lora", "target_modules"), str(e)) from None


def _check_prompt_format(spec: JobSpec) -> None:
    if spec.prompt.format == PromptFormat.raw or not _is_dir(spec.model_path):
        return
    try:
        template = read_chat_template(spec.model_path)
    except ChatTemplateError as e:
        raise JobInputError(("model_path",), f"model_path {spec.model_path!r}: {e}") from None
    except (OSError, ValueError):
        return  # unreadable now: the job's load reports it
    try:
        resolve_prompt_format(spec.prompt, template, spec.model_path)
    except ValueError as e:
        field = "format" if spec.prompt.format == PromptFormat.chat else "system"
        raise JobInputError(("prompt", field), str(e)) from None


def _check_tools(spec: JobSpec) -> None:
    if spec.tools is None or not _is_dir(spec.model_path):
        return
    field = ("tools", "chat_template") if spec.tools.chat_template is not None else ("tools",)
    try:
        tool_template(spec.model_path, spec.tools)
    except ChatTemplateError as e:
        raise JobInputError(field, f"{'.'.join(field)}: {e}") from None
    except (OSError, UnicodeError):
        return  # unreadable now: the job's load reports it
    except ValueError as e:
        raise JobInputError(field, str(e)) from None


def _check_dataset_fields(spec: JobSpec) -> None:
    d = spec.dataset
    files: list[str] = []
    for setting in ("train_path", "eval_path"):
        paths = getattr(d, setting)
        if paths is None:
            continue
        try:
            files += dataset_paths(paths, setting)
        except DatasetPathError as e:
            pattern = _entry(paths, e.loc)
            if _is_dir(str(pattern_folder(pattern))):
                raise JobInputError(e.loc, str(e)) from None
            return  # a folder that does not exist yet: the job's load reports it
    if not all(_is_file(p) for p in files):
        return
    try:
        check_dataset_fields(d)
    except DatasetFieldError as e:
        raise JobInputError(("dataset", e.setting), str(e)) from None
    except (OSError, ValueError):
        return  # unreadable now (or not Parquet after all): the job's load reports it


def _entry(paths: str | list[str], loc: tuple[str | int, ...]) -> str:
    return paths if isinstance(paths, str) else paths[int(loc[-1])]


def _is_dir(path: str) -> bool:
    try:
        return Path(path).is_dir()
    except (OSError, ValueError):
        return False


def _is_file(path: str) -> bool:
    try:
        return Path(path).is_file()
    except (OSError, ValueError):
        return False
