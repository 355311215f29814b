"""The module names of a job's model, read without torch from its weight files, and the check of
`trainer.lora.target_modules` against them.

A Hugging Face directory names its tensors in `model.safetensors.index.json` (sharded) or in each
`*.safetensors` file's header (an 8-byte little-endian length, then JSON keyed by tensor name); a module
with a weight matrix is a tensor name less its `.weight`. peft matches a target by name or dotted suffix
("q_proj" is every "...q_proj"), and so does this check.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from everstep.settings.training import ALL_LINEAR, LoraSettings

__all__ = ["check_lora_targets", "weight_module_names"]

_INDEX_FILE = "model.safetensors.index.json"
_MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit


def weight_module_names(model_path: str | Path) -> list[str] | None:
    """The modules holding a 2-D-or-more `.weight` tensor (safetensors index or headers); None when the directory
    has no safetensors files that can be read here."""
    model_dir = Path(model_path)
    names: list[str] = []
    try:
        index = model_dir / _INDEX_FILE
        if index.is_file():
            names = list(json.loads(index.read_text())["weight_map"])
        else:
            files = sorted(model_dir.glob("*.safetensors"))
            if not files:
                return None
            for path in files:
                with path.open("rb") as f:
                    (length,) = struct.unpack("<Q", f.read(8))
                    if length > _MAX_HEADER_BYTES:
                        return None
                    header = json.loads(f.read(length))
                names += [n for n, entry in header.items()
                          if n != "__metadata__" and len(entry.get("shape", ())) >= 2]
    except (OSError, ValueError, KeyError, struct.error):
        return None
    return sorted({n.removesuffix(".weight") for n in names if n.endswith(".weight")})


def check_lora_targets(model_path: str, lora: LoraSettings | None) -> None:
    """ValueError naming trainer.lora.target_modules and the target that matches no module of the model, or that
    matches only mixture-of-experts expert projections (the trainer cannot wrap those: transformers holds them
    fused); nothing to check without lora, for 'all-linear', or when the weights cannot be read here."""
    if lora is None or lora.target_modules == [ALL_LINEAR]:
        return
    modules = weight_module_names(model_path)
    if modules is None:
        return
    for target in lora.target_modules:
        matches = [m for m in modules if m == target or m.endswith("." + target)]
        if not matches:
            examples = sorted({m.rsplit(".", 1)[-1] for m in modules if ".layers." in m})[:12]
            raise ValueError(f"trainer.lora.target_modules: the model at {model_path} has no module {target!r} "
                             f"(its layers' modules: {', '.join(examples)})")
        if all(".experts." in m for m in matches):
            raise ValueError(f"trainer.lora.target_modules: {target!r} names mixture-of-experts expert projections "
                             f"({matches[0]}, ...); LoRA on experts is not supported (transformers holds them as "
                             "fused parameters that peft cannot wrap as modules): target the attention projections")
