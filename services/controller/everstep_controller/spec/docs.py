"""Generates docs/job-spec.md from the JobSpec schema: `python -m everstep_controller.spec.docs > docs/job-spec.md`."""

from __future__ import annotations

import json
from typing import Any, get_args, get_origin

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from everstep.rest.job_spec import JobSpec


def _default(field: Any) -> str:
    if field.default is not PydanticUndefined:
        value = field.default
    elif field.default_factory is not None:
        value = field.default_factory()
    else:
        return "required"
    if isinstance(value, BaseModel):
        return "(section)"
    if isinstance(value, list):
        value = [v.model_dump(mode="json", exclude_defaults=True) if isinstance(v, BaseModel) else v for v in value]
    return f"`{json.dumps(value.value if hasattr(value, 'value') else value)}`"


def _rows(model: type[BaseModel], prefix: str) -> list[str]:
    rows: list[str] = []
    nested: list[tuple[str, type[BaseModel], str]] = []
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            nested.append((path, annotation, "section |"))
            continue
        optional = _optional_model(annotation)
        if optional is not None:  # an optional section, e.g. tracking.wandb: off unless given
            nested.append((path, optional, "optional section | `null`"))
            continue
        description = (field.description or "").replace("|", "\\|")
        type_name = getattr(annotation, "__name__", str(annotation)).replace("|", "\\|")
        rows.append(f"| `{path}` | {type_name} | {_default(field)} | {description} |")
        item = _list_item_model(annotation)
        if item is not None:  # the fields of each list entry, e.g. reward.verifiers[].weight
            rows.extend(_rows(item, f"{path}[]."))
    for path, sub, kind in nested:
        rows.append(f"| **`{path}`** | {kind} | {(sub.__doc__ or '').strip().partition(chr(10))[0]} |")
        rows.extend(_rows(sub, f"{path}."))
    return rows


def _optional_model(annotation: Any) -> type[BaseModel] | None:
    models = [a for a in get_args(annotation) if isinstance(a, type) and issubclass(a, BaseModel)]
    return models[0] if len(models) == 1 and type(None) in get_args(annotation) else None


def _list_item_model(annotation: Any) -> type[BaseModel] | None:
    if get_origin(annotation) is not list:
        return None
    (item,) = get_args(annotation)
    return item if isinstance(item, type) and issubclass(item, BaseModel) else None


def render() -> str:
    header = [
        "# Job spec",
        "",
        "Generated from `everstep.rest.job_spec.JobSpec` by `python -m everstep_controller.spec.docs`;",
        "do not edit by hand. A job is YAML for the CLI (`everstep submit job.yaml`; relative paths are",
        "taken relative to the YAML file) or JSON for `POST /v1/jobs`. Unknown fields are rejected (422",
        "naming the field).",
        "",
        "| field | type | default | description |",
        "|---|---|---|---|",
    ]
    return "\n".join(header + _rows(JobSpec, "")) + "\n"


if __name__ == "__main__":
    print(render(), end="")
