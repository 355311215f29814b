"""LoRA adapter updates: each pushed version rebuilt exactly from the base weights the engine keeps.

An adapter update (rollout.proto `LoraAdapter` on the last bucket) carries, for every adapted module M,
"M.lora_A" [rank, in] and "M.lora_B" [out, rank]. `AdapterMerger.merged` turns it into the full weights of
those modules, M.weight = W_base + (alpha / rank) * B @ A, computed in float32 from the kept W_base and rounded
once to the engine's dtype (or quantized by the engine, as any pushed weight is). It never subtracts the previous
version's delta, so nothing drifts over thousands of pushes: every version equals a freshly merged model.

Why merged, not separate low-rank matmuls beside W (`python -m benchmarks.weight_push --lora-rank R` measures
both, docs/lora.md gives the figures): a merge costs one [out, r] @ [r, in] product per module per push, while
unmerged adapters cost two extra small matmuls per module in every decode step of every sequence, and would need
their own path in each executor (native, transformers, sglang) and in quantized layers. Merging keeps every
engine's forward unchanged: the merged tensors go through `update_weights` like a full push's.

The base is read once from the model directory, for the modules adapters touch (float32, on the engine's
device), at the first adapter update; a full-weight push replaces the kept base of the names it carries (a later
adapter applies to those weights; one that touches a module a full push replaced before any adapter did is
refused, its base being no longer on disk). A module an earlier adapter touched but the current one does not is
reset to its base.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import torch

__all__ = ["AdapterMerger", "read_base_weights"]

_PARTS = ("lora_A", "lora_B")


def read_base_weights(model_dir: Path, names: set[str]) -> dict[str, torch.Tensor]:
    """The tensors `names` of a Hugging Face directory's safetensors files (ValueError naming a missing one)."""
    from safetensors import safe_open

    found: dict[str, torch.Tensor] = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in names & set(f.keys()):
                found[name] = f.get_tensor(name)
    missing = sorted(names - set(found))
    if missing:
        raise ValueError(f"lora: base weights not in {model_dir}'s safetensors: {missing[:5]}")
    return found


class AdapterMerger:
    """The base weights of the adapted modules, and the merge of each adapter version onto them."""

    def __init__(self, model_dir: str | Path, device: str | torch.device = "cpu", *,
                 read_base: Callable[[Path, set[str]], dict[str, torch.Tensor]] = read_base_weights) -> None:
        self.model_dir = Path(model_dir)
        self.device = torch.device(device)
        self._read_base = read_base
        self.base: dict[str, torch.Tensor] = {}
        """"M.weight" -> W_base (float32), for every module an adapter touched."""
        self._replaced: set[str] = set()
        """Names a full push set that no adapter had touched (their base is no longer the model directory's)."""
        self._adapted: set[str] = set()
        """"M.weight" of the modules the engine holds merged now."""
        self._merged: dict[str, torch.Tensor] = {}
        """One output buffer per module, reused by every version (no allocation and page faults per push): what
        `merged` returns is valid until the next call, which is how the engine uses it (copied in at once)."""

    def merged(self, tensors: Mapping[str, torch.Tensor], *, rank: int, alpha: float) -> dict[str, torch.Tensor]:
        """The full weights an adapter update (rollout.proto LoraAdapter's rank and alpha) sets: "M.weight" of
        every module it names, and of every module the previous adapter touched that this one does not (back to
        W_base); valid until the next call. ValueError naming the tensor on a malformed update (nothing kept).
        Takes plain numbers, not the proto, so that benchmarks/gpu_check runs it where there are no stubs."""
        if rank <= 0 or not alpha > 0:
            raise ValueError(f"lora: rank must be >= 1 and alpha > 0 (got rank {rank}, alpha {alpha})")
        pairs = self._pairs(tensors, rank)
        wanted = {f"{module}.weight" for module in pairs}
        self._ensure_base(wanted | self._adapted)
        scale = alpha / rank
        out: dict[str, torch.Tensor] = {}
        for module, (a, b) in pairs.items():
            base = self.base[f"{module}.weight"]
            if base.shape != (b.shape[0], a.shape[1]):
                raise ValueError(f"{module}.lora_B @ lora_A: shape {(b.shape[0], a.shape[1])} != the weight's "
                                 f"{tuple(base.shape)}")
            a32 = a.to(self.device, torch.float32)
            b32 = b.to(self.device, torch.float32)
            buffer = self._merged.get(module)
            if buffer is None:
                buffer = self._merged[module] = torch.empty_like(base)
            out[f"{module}.weight"] = torch.addmm(base, b32, a32, alpha=scale, out=buffer)
        for name in self._adapted - wanted:
            out[name] = self.base[name]
        self._adapted = wanted
        return out

    def full_update(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """A full-weight push: its tensors are the new base of the names they carry; nothing is adapted."""
        for name, tensor in tensors.items():
            if name in self.base:
                self.base[name] = tensor.detach().to(self.device, torch.float32, copy=True)
            else:
                self._replaced.add(name)
        self._adapted = set()

    def _ensure_base(self, names: set[str]) -> None:
        missing = names - set(self.base)
        if not missing:
            return
        replaced = sorted(missing & self._replaced)
        if replaced:
            raise ValueError(f"lora: {replaced[0]} was replaced by a full-weight push before any adapter touched "
                             "it, so its base is not the model directory's; reload the engine to adapt it")
        for name, tensor in self._read_base(self.model_dir, missing).items():
            self.base[name] = tensor.to(self.device, torch.float32)

    @staticmethod
    def _pairs(tensors: Mapping[str, torch.Tensor], rank: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        parts: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in tensors.items():
            module, _, part = name.rpartition(".")
            if part not in _PARTS or not module:
                raise ValueError(f"tensor {name!r}: an adapter update carries only '<module>.lora_A' and "
                                 "'<module>.lora_B' tensors")
            parts.setdefault(module, {})[part] = tensor
        pairs = {}
        for module, found in parts.items():
            if set(found) != set(_PARTS):
                raise ValueError(f"tensor {module}.{set(_PARTS).difference(found).pop()}: missing from the update")
            a, b = found["lora_A"], found["lora_B"]
            if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
                raise ValueError(f"{module}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not have rank "
                                 f"{rank} ([rank, in] and [out, rank])")
            pairs[module] = (a, b)
        if not pairs:
            raise ValueError("lora: an adapter update without tensors")
        return pairs
