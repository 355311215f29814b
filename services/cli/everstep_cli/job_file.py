"""Reads a job spec from YAML; relative paths are taken relative to the YAML file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

# (section, field) pairs that hold filesystem paths; None section means top level
_PATH_FIELDS = ((None, "model_path"), ("dataset", "train_path"), ("dataset", "eval_path"), ("checkpoint", "dir"))


def load_job_file(path: str | Path) -> dict[str, Any]:
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"job file {str(path)!r} does not exist")
    spec = yaml.safe_load(file.read_text())
    if not isinstance(spec, dict):
        raise ValueError(f"job file {str(path)!r} must hold a mapping, got {type(spec).__name__}")
    base = file.resolve().parent
    for section, name in _PATH_FIELDS:
        holder = spec if section is None else spec.get(section)
        if isinstance(holder, dict) and isinstance(holder.get(name), str):
            holder[name] = str((base / holder[name]).resolve())
    return spec
