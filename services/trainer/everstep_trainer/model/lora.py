"""LoRA with peft: wrapping the policy, naming its adapters as the engines and peft's files do, and reading and
writing PEFT adapter directories.

Three spellings of one adapter tensor:

- in the trainer (peft's live module tree): `base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight`
- on the wire to the engines (`rollout.proto` LoraAdapter): `model.layers.0.self_attn.q_proj.lora_A`, the base
  module's Hugging Face name plus `lora_A` [rank, in] or `lora_B` [out, rank]
- in a PEFT adapter directory (`adapter_model.safetensors`, what `PeftModel.from_pretrained` loads):
  `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`

The base weights are frozen; the adapters are float32 whatever the base's dtype (peft's
`autocast_adapter_dtype`), so that the optimizer's updates to them are not rounded to bfloat16.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from everstep.settings.training import ALL_LINEAR, LoraSettings

__all__ = [
    "ADAPTER_CONFIG_FILE",
    "ADAPTER_WEIGHTS_FILE",
    "AdapterWeights",
    "adapter_base_model",
    "adapter_dropout",
    "adapter_weights",
    "apply_lora",
    "is_adapter_dir",
    "load_adapter_state",
    "save_adapter_dir",
    "trainable_state_dict",
]

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
_ADAPTER = "default"  # peft's name of the one adapter
_LIVE_PREFIX = "base_model.model."
_LORA_PARTS = ("lora_A", "lora_B")


@dataclass(frozen=True)
class AdapterWeights:
    """One version of the adapters, as the engines take them: `tensors` maps "<module>.lora_A" [rank, in] and
    "<module>.lora_B" [out, rank] (float32) to their values, <module> a Hugging Face module name of the base."""

    tensors: dict[str, Tensor]
    rank: int
    alpha: float

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def apply_lora(model: torch.nn.Module, settings: LoraSettings) -> torch.nn.Module:
    """`model` wrapped by peft with adapters on `settings.target_modules` (float32), every base weight frozen.

    ValueError naming trainer.lora.target_modules when a target matches no module, or names a mixture-of-experts
    expert projection (transformers keeps a model's experts as fused 3-D parameters, which peft's target_modules
    cannot wrap; the attention projections of an MoE model work)."""
    from peft import LoraConfig, get_peft_model

    targets: str | list[str] = ALL_LINEAR if settings.target_modules == [ALL_LINEAR] else list(settings.target_modules)
    if isinstance(targets, list):
        _check_targets(model, targets)
    config = LoraConfig(r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                        target_modules=targets, bias="none", task_type="CAUSAL_LM")
    try:
        peft_model = get_peft_model(model, config, autocast_adapter_dtype=True)
    except ValueError as e:
        raise ValueError(f"trainer.lora.target_modules: {e}") from None
    for name, param in peft_model.named_parameters():
        if param.requires_grad:
            param.data = param.data.float()  # peft autocasts float16/bfloat16 adapters; be sure of the rest
            assert ".lora_" in name, f"a trainable parameter that is no adapter: {name}"
    # peft leaves the modules it adds in training mode: dropout would act in every pass, the log-prob ones too.
    # The trainer runs in eval mode; `adapter_dropout` turns the adapters' dropout on in the loss passes only.
    peft_model.eval()
    return peft_model


def _check_targets(model: torch.nn.Module, targets: list[str]) -> None:
    modules = [name for name, _ in model.named_modules()]
    for target in targets:
        matches = [m for m in modules if m == target or m.endswith("." + target)]
        if not matches:
            experts = [n for n, p in model.named_parameters() if ".experts." in n and n.rsplit(".", 1)[-1] in
                       (target, target.rsplit(".", 1)[-1])]
            why = (f"{target!r} is a mixture-of-experts expert projection, which {type(model).__name__} holds as a "
                   f"fused parameter ({experts[0]}), not a module peft can wrap" if experts
                   else f"no module of {type(model).__name__} is named {target!r} or ends with '.{target}'")
            raise ValueError(f"trainer.lora.target_modules: {why}")
        linear = [m for m in matches if isinstance(model.get_submodule(m), torch.nn.Linear)]
        if not linear:
            kind = type(model.get_submodule(matches[0])).__name__
            raise ValueError(f"trainer.lora.target_modules: {target!r} matches {matches[0]} ({kind}), not a "
                             "linear layer")


def trainable_state_dict(model: torch.nn.Module) -> dict[str, Tensor]:
    """The adapters of an unsharded peft model, by their live names (no copy)."""
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    return {name: t for name, t in model.state_dict().items() if name in trainable}


def _module_and_part(live_name: str) -> tuple[str, str]:
    """('model.layers.0.self_attn.q_proj', 'lora_A') of a live (or saved) adapter parameter name."""
    name = live_name.removeprefix(_LIVE_PREFIX).removesuffix(".weight").removesuffix(f".{_ADAPTER}")
    module, _, part = name.rpartition(".")
    if part not in _LORA_PARTS or not module:
        raise ValueError(f"{live_name!r} is not a LoRA adapter weight")
    return module, part


def adapter_weights(state: Mapping[str, Tensor], settings: LoraSettings) -> AdapterWeights:
    """The adapters of a trainable state dict (live names) as the engines take them."""
    tensors = {}
    for name, tensor in state.items():
        module, part = _module_and_part(name)
        tensors[f"{module}.{part}"] = tensor.detach()
    return AdapterWeights(tensors=tensors, rank=settings.rank, alpha=settings.alpha)


def is_adapter_dir(path: str | Path) -> bool:
    return (Path(path) / ADAPTER_CONFIG_FILE).is_file()


def save_adapter_dir(model: torch.nn.Module, state: Mapping[str, Tensor], out_dir: str | Path, *,
                     base_model_path: str | Path) -> Path:
    """Write a PEFT adapter directory (adapter_config.json naming `base_model_path`, adapter_model.safetensors) of
    the adapters in `state` (live names, full tensors): `PeftModel.from_pretrained(base, out_dir)` loads it."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = model.peft_config[_ADAPTER]
    config.base_model_name_or_path = str(Path(base_model_path).absolute())
    config.save_pretrained(str(out_dir))
    saved = {}
    for name, tensor in state.items():
        module, part = _module_and_part(name)
        saved[f"{_LIVE_PREFIX}{module}.{part}.weight"] = tensor.detach().to("cpu", torch.float32).contiguous()
    save_file(saved, str(out_dir / ADAPTER_WEIGHTS_FILE), metadata={"format": "pt"})
    return out_dir


def load_adapter_state(path: str | Path) -> dict[str, Tensor]:
    """The adapters of a PEFT adapter directory, by the live names of a peft model with the default adapter."""
    from safetensors.torch import load_file

    saved = load_file(str(Path(path) / ADAPTER_WEIGHTS_FILE))
    state = {}
    for name, tensor in saved.items():
        module, part = _module_and_part(name)
        state[f"{_LIVE_PREFIX}{module}.{part}.{_ADAPTER}.weight"] = tensor
    return state


def adapter_base_model(path: str | Path) -> str:
    """The base model directory an adapter directory names."""
    return str(json.loads((Path(path) / ADAPTER_CONFIG_FILE).read_text())["base_model_name_or_path"])


class adapter_dropout:  # noqa: N801 - a context manager used like a function
    """Inside it the adapters' dropout is on (peft applies it in training mode only): the loss's forward passes.
    The trainer keeps its model in eval mode otherwise, so log-prob passes never drop anything."""

    def __init__(self, model: torch.nn.Module, settings: LoraSettings | None) -> None:
        self.modules = ([m for name, m in model.named_modules() if name.endswith(f"lora_dropout.{_ADAPTER}")]
                        if settings is not None and settings.dropout > 0 else [])

    def __enter__(self) -> None:
        for module in self.modules:
            module.train()

    def __exit__(self, *exc: object) -> None:
        for module in self.modules:
            module.eval()
