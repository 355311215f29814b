"""Checks of a job's input files at submission (POST /v1/jobs), and `check_job_input`: every submission check in
order, so that a mistake is a 422 naming the field.

From the files: the reward functions of `reward.functions` (each `path` read, unless the client sent its
`source`, then parsed, never run, for the function `name`; the source is shipped with the job, and a file that
does not exist at submission is a 422: the job could not get it later), the model's chat template against
`prompt.format` and `prompt.system` (and `tools`), the dataset's fields against `dataset.*_field`
(`dataset_columns`), and that a glob pattern of `dataset.train_path`/`eval_path` whose folder exists matches a
file. The checks of the spec itself (verifiers, tracking libraries, the model's limits and modules) are in
`spec.submission_checks`. A file that does not exist or cannot be read at submission is
not checked here: the job then fails when it loads its data, with the cause in its record (a file may be written
after the job is submitted). The job's load runs the same checks, so a job never trains on input these would refuse.
"""

from __future__ import annotations

from pathlib import Path

from everstep.rest.job_spec import JobSpec, PromptFormat, RewardFunctionSpec
from everstep.reward_functions import FunctionSourceError, SourceSyntaxError, check_function_source
from everstep_controller.data.chat_template import ChatTemplateError, read_chat_template
from everstep_controller.data.dataset import DatasetPathError, dataset_paths, pattern_folder
from everstep_controller.data.dataset_columns import DatasetFieldError, check_dataset_fields
from everstep_controller.data.prompt_rendering import resolve_prompt_format, tool_template
from everstep_controller.spec.submission_checks import (
    JobInputError,
    check_lengths,
    check_lora_targets_field,
    check_routing_replay_field,
    check_tracking,
    check_verifiers,
)

__all__ = ["check_job_input", "read_reward_functions"]

MAX_FUNCTION_SOURCE_BYTES = 256 * 1024
"""The most a job's reward-function files may hold together: their source travels with every reward item (64 items
to a Score call: 16 MiB at most, within the 64 MiB gRPC message limit)."""


def check_job_input(spec: JobSpec) -> JobSpec:
    """The spec with its reward functions' sources filled in; JobInputError for the first problem found in the
    spec's verifiers and functions and the files that can be read now."""
    spec = read_reward_functions(spec)
    check_verifiers(spec)
    check_tracking(spec)
    _check_prompt_format(spec)
    _check_tools(spec)
    check_lengths(spec)
    check_routing_replay_field(spec)
    check_lora_targets_field(spec)
    _check_dataset_fields(spec)
    return spec


def read_reward_functions(spec: JobSpec) -> JobSpec:
    """Each of `reward.functions` with its `source` (read from `path` when the client sent none) and checked:
    JobInputError naming `reward.functions[i].path` for a file that does not exist, cannot be read or does not
    parse, `.name` for one that lacks the function or whose signature follows neither convention."""
    if not spec.reward.functions:
        return spec
    functions = [_read_function(index, f) for index, f in enumerate(spec.reward.functions)]
    total = sum(len((f.source or "").encode()) for f in functions)
    if total > MAX_FUNCTION_SOURCE_BYTES:
        raise JobInputError(("reward", "functions"), f"reward.functions: the files hold {total} bytes together, more "
                                                     f"than {MAX_FUNCTION_SOURCE_BYTES} (their source travels with "
                                                     "every reward item)")
    return spec.model_copy(update={"reward": spec.reward.model_copy(update={"functions": functions})})


def _read_function(index: int, function: RewardFunctionSpec) -> RewardFunctionSpec:
    loc = ("reward", "functions", index)
    source = function.source
    if source is None:
        path = Path(function.path)
        try:
            if path.stat().st_size > MAX_FUNCTION_SOURCE_BYTES:
                raise JobInputError((*loc, "path"), f"reward.functions[{index}].path {function.path!r}: larger than "
                                                    f"{MAX_FUNCTION_SOURCE_BYTES} bytes")
            source = path.read_text()
        except FileNotFoundError:
            raise JobInputError((*loc, "path"), f"reward.functions[{index}].path {function.path!r} does not exist "
                                                "(where the controller runs; `everstep submit` sends the file "
                                                "from your machine)") from None
        except (OSError, UnicodeError) as e:
            raise JobInputError((*loc, "path"), f"reward.functions[{index}].path {function.path!r} cannot be "
                                                f"read: {e}") from None
    elif len(source.encode()) > MAX_FUNCTION_SOURCE_BYTES:
        raise JobInputError((*loc, "source"), f"reward.functions[{index}].source: larger than "
                                              f"{MAX_FUNCTION_SOURCE_BYTES} bytes")
    try:
        check_function_source(source, function.name, function.path)
    except FunctionSourceError as e:
        field = ("source" if function.source is not None else "path") if isinstance(e, SourceSyntaxError) else "name"
        raise JobInputError((*loc, field), f"reward.functions[{index}].{field}: {e}") from None
    return function.model_copy(update={"source": source})


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
