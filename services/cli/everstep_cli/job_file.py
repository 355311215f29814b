"""Reads a job spec from YAML, with `--set a.b=c` overrides; relative paths are taken relative to the YAML
file (those given by an override, relative to the current directory). The files of `reward.functions` are read
here, on the user's machine, and their source sent with the spec, so that a remote controller needs no copy."""

from __future__ import annotations

import copy
import types
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from everstep.rest.job_spec import JobSpec

# (section, field) pairs that hold filesystem paths (or lists of paths and glob patterns); None: top level, a
# dotted section: a nested one
_PATH_FIELDS = ((None, "model_path"), ("dataset", "train_path"), ("dataset", "eval_path"), ("checkpoint", "dir"),
                ("tracking.tensorboard", "log_dir"))


class SpecOverrideError(ValueError):
    """A `--set` that names no field of the job spec, or whose value the field refuses."""


def load_job_file(path: str | Path, overrides: list[str] | None = None) -> dict[str, Any]:
    """The job spec in the YAML file at `path`, with `overrides` ("a.b=c": dotted field path, value read as
    YAML: a scalar, or a flow list or mapping) applied in order. With overrides, the result is validated as
    the REST body is: SpecOverrideError naming the field, before anything is submitted."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"job file {str(path)!r} does not exist")
    spec = yaml.safe_load(file.read_text())
    if not isinstance(spec, dict):
        raise ValueError(f"job file {str(path)!r} must hold a mapping, got {type(spec).__name__}")
    _resolve_paths(spec, file.resolve().parent)
    _resolve_function_paths(spec, file.resolve().parent)
    if overrides:
        spec = apply_overrides(spec, overrides)
        validate_spec(spec)
    _read_function_sources(spec)
    return spec


def _functions(spec: dict[str, Any]) -> list[dict[str, Any]]:
    reward = spec.get("reward")
    functions = reward.get("functions") if isinstance(reward, dict) else None
    return [f for f in functions if isinstance(f, dict)] if isinstance(functions, list) else []


def _resolve_function_paths(spec: dict[str, Any], base: Path) -> None:
    for function in _functions(spec):
        if isinstance(function.get("path"), str):
            function["path"] = _resolved(base, function["path"])


def _read_function_sources(spec: dict[str, Any]) -> None:
    """Sends each reward function's file as its `source` (one already given is kept). A file that is not here is
    left to the controller, which reads `path` where it runs or answers 422 naming it."""
    for function in _functions(spec):
        path = function.get("path")
        if function.get("source") is None and isinstance(path, str) and Path(path).is_file():
            function["source"] = Path(path).read_text()


def _resolve_paths(spec: dict[str, Any], base: Path, only: tuple[str | None, str] | None = None) -> None:
    for section, name in _PATH_FIELDS:
        if only is not None and (section, name) != only:
            continue
        holder: Any = spec
        for part in section.split(".") if section else ():
            holder = holder.get(part) if isinstance(holder, dict) else None
        if not isinstance(holder, dict):
            continue
        value = holder.get(name)
        if isinstance(value, str):
            holder[name] = _resolved(base, value)
        elif isinstance(value, list):
            holder[name] = [_resolved(base, v) if isinstance(v, str) else v for v in value]


def _resolved(base: Path, value: str) -> str:
    return str((base / value).resolve()) if value else value


def apply_overrides(spec: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """A copy of `spec` with each "a.b=c" set, in order: the value (read as YAML) replaces the field's,
    missing sections are made; a path field's relative value is taken relative to the current directory.
    SpecOverrideError for one without '=', or naming a field the job spec does not have (never added
    silently): the message names the field and the fields its section has."""
    result = copy.deepcopy(spec)
    for override in overrides:
        key, sep, raw = override.partition("=")
        key = key.strip()
        if not sep or not key:
            raise SpecOverrideError(f"--set {override!r}: expected FIELD=VALUE, e.g. trainer.learning_rate=3e-4")
        parts = key.split(".")
        _check_field_path(parts)
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as e:
            raise SpecOverrideError(f"--set {key}: the value {raw!r} is not YAML: {e}") from None
        holder = result
        for depth, part in enumerate(parts[:-1]):
            if not isinstance(holder.get(part), dict):
                if holder.get(part) is not None:
                    raise SpecOverrideError(f"--set {key}: {'.'.join(parts[:depth + 1])} is not a mapping in the "
                                            "job file")
                holder[part] = {}
            holder = holder[part]
        holder[parts[-1]] = value
        _resolve_paths(result, Path.cwd(), only=(".".join(parts[:-1]) or None, parts[-1]))
    return result


def _check_field_path(parts: list[str]) -> None:
    """SpecOverrideError unless `parts` is a field path of JobSpec (a key under a free-form mapping such as
    reward.verifiers[].params is any key; a list field is set whole)."""
    model: Any = JobSpec
    for depth, part in enumerate(parts):
        here = ".".join(parts[: depth + 1])
        if model is _ANY:
            continue
        if model is None:
            raise SpecOverrideError(f"--set {'.'.join(parts)}: {'.'.join(parts[:depth])} has no fields "
                                    f"(it is set whole: --set {'.'.join(parts[:depth])}=VALUE)")
        fields = model.model_fields
        if part not in fields:
            raise SpecOverrideError(f"--set {'.'.join(parts)}: the job spec has no field {here!r} "
                                    f"({_parent(parts, depth)} has {', '.join(fields)})")
        model = _inner_model(fields[part].annotation)


_ANY = object()  # a free-form mapping: any key


def _inner_model(annotation: Any) -> Any:
    """The model whose fields a path may continue into; _ANY for a mapping; None for a value set whole."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    origin = typing.get_origin(annotation)
    if origin is dict:
        return _ANY
    if origin in (typing.Union, types.UnionType):
        models = [a for a in typing.get_args(annotation) if isinstance(a, type) and issubclass(a, BaseModel)]
        return models[0] if len(models) == 1 else None
    return None


def _parent(parts: list[str], depth: int) -> str:
    return "the job spec" if depth == 0 else ".".join(parts[:depth])


def validate_spec(spec: dict[str, Any]) -> JobSpec:
    """The spec as the REST body is checked (pydantic's JobSpec): SpecOverrideError naming each field at fault."""
    try:
        return JobSpec.model_validate(spec)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(str(p) for p in err['loc']) or 'spec'}: {err['msg']}"
                             f" (got {err['input']!r})" if "input" in err and not isinstance(err["input"], dict)
                             else f"{'.'.join(str(p) for p in err['loc']) or 'spec'}: {err['msg']}"
                             for err in e.errors())
        raise SpecOverrideError(f"the job spec is invalid: {problems}") from None
