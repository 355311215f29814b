"""Reading a Hugging Face model directory's config files (config.json, generation_config.json)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path


def read_config(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text())


def read_eos_token_ids(model_dir: Path, model_config: Mapping) -> frozenset[int]:
    """EOS ids of config.json and generation_config.json together (either may hold an int or a list)."""
    ids: set[int] = set()
    sources = [model_config]
    generation_config = model_dir / "generation_config.json"
    if generation_config.exists():
        sources.append(json.loads(generation_config.read_text()))
    for source in sources:
        eos = source.get("eos_token_id")
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list):
            ids.update(int(e) for e in eos)
    return frozenset(ids)
