"""Pointing an executor's weight storage at other memory, in place: the engine side of the one-copy shm push.

An executor holds its weights as a few allocations (`held`: fused qkv, gate_up, ... of the native executor; one
per parameter in the transformers one) and the Hugging Face names as views into them (`named`). To run on a
pushed version without copying it, every held tensor and every view of it is re-pointed (`Tensor.set_`) at the
pushed bytes, which must then lie exactly as the held tensor does: same dtype and device, and the views of one
held tensor (q, k, v of a fused qkv) one after another, covering it. `adoption_plan` checks that for every held
tensor before anything changes; a held tensor that cannot (a pushed dtype that differs, q, k, v apart) is copied
into by the caller instead, in memory of its own, and the plan says why.
`private_plan` is the way back: every held tensor into memory of its own (before an update that copies in, so
that a copy never writes into, and a partial update never leaves views on, memory the trainer may rewrite).

The tensor objects stay the same (the executor's layers, its `named` dict and anything else holding them see the
new memory at once); only what they point at changes, between two forward passes.

Which named views lie in which held tensor, at what byte offset, is a fact of the store that no rebind changes (a
rebind moves a held tensor and its views together): `StoreLayout` works it out once per store, in one pass over the
names, so that planning an update only looks up the names it brings (it was a scan of every name for every held
tensor, on every push: tens of milliseconds an update for a model of a few hundred tensors).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

__all__ = ["Adoption", "HeldViews", "Rebind", "StoreLayout", "adopt", "adoption_plan", "apply", "private_plan"]


@dataclass(frozen=True)
class Rebind:
    """Point `held` (and its `views`, at their byte offsets within it) at `storage`, from byte `base`."""

    held: torch.Tensor
    views: tuple[tuple[torch.Tensor, int], ...]
    storage: torch.UntypedStorage
    base: int


def _byte_offset(t: torch.Tensor) -> int:
    return t.storage_offset() * t.element_size()


@dataclass(frozen=True)
class HeldViews:
    """One held item of a store and the named tensors that lie inside it: (view, byte offset within it, its names)
    each; the held tensor itself among them when it is named."""

    held: object
    views: tuple[tuple[torch.Tensor, int, tuple[str, ...]], ...]


class StoreLayout:
    """Every held item of a store with the named views inside it, worked out once (held and named must not change
    afterwards: the stores build both at load). `names`: name -> the index of the held item it lies in."""

    def __init__(self, held: Sequence[object], named: Mapping[str, object]) -> None:
        by_storage: dict[int, dict[int, tuple[torch.Tensor, list[str]]]] = {}
        for name, view in named.items():
            if isinstance(view, torch.Tensor) and view.nbytes:
                entry = by_storage.setdefault(view.untyped_storage().data_ptr(), {}).setdefault(id(view), (view, []))
                entry[1].append(name)
        self.entries: list[HeldViews] = []
        self.names: dict[str, int] = {}
        for h in held:
            views: list[tuple[torch.Tensor, int, tuple[str, ...]]] = []
            if isinstance(h, torch.Tensor):
                start, end = _byte_offset(h), _byte_offset(h) + h.nbytes
                for view, names in by_storage.get(h.untyped_storage().data_ptr(), {}).values():
                    offset = _byte_offset(view)
                    if start <= offset and offset + view.nbytes <= end:
                        views.append((view, offset - start, tuple(names)))
                        self.names.update(dict.fromkeys(names, len(self.entries)))
            self.entries.append(HeldViews(h, tuple(views)))
        self._identity = (id(named), len(named), len(held))

    def matches(self, held: Sequence[object], named: Mapping[str, object]) -> bool:
        """Still the layout of this store (the same named dict, nothing added or removed)."""
        return self._identity == (id(named), len(named), len(held))


@dataclass(frozen=True)
class Adoption:
    """Which held tensors can run on the pushed memory (`rebinds`), the names those cover (`kept`), and why the
    first of the others cannot (None: every held tensor the update touches can)."""

    rebinds: list[Rebind]
    kept: set[str]
    reason: str | None


def _plan_one(entry: HeldViews, incoming: Mapping[str, torch.Tensor]) -> Rebind | str | None:
    """The held item re-pointed at the incoming memory; why not (a sentence); None: the update does not touch it."""
    h = entry.held
    if not isinstance(h, torch.Tensor):
        return f"{type(h).__name__} weights (quantized) are not plain tensors"
    first_name = entry.views[0][2][0] if entry.views else "?"
    storage: torch.UntypedStorage | None = None
    base = 0
    spans = []
    for view, offset, names in entry.views:
        t = next((incoming[n] for n in names if n in incoming), None)
        if t is None:
            continue
        if t.dtype != h.dtype or t.device != h.device or tuple(t.shape) != tuple(view.shape):
            return f"{names[0]}: {t.dtype} on {t.device}, the engine holds {h.dtype} on {h.device}"
        if not (t.is_contiguous() and view.is_contiguous() and h.is_contiguous()):
            return f"{names[0]}: not contiguous"
        t_base = _byte_offset(t) - offset
        if storage is None:
            storage, base = t.untyped_storage(), t_base
        elif t.untyped_storage().data_ptr() != storage.data_ptr() or t_base != base:
            return f"{names[0]}: not right after the other parts of its fused weight in the pushed memory"
        spans.append((offset, offset + view.nbytes))
    if storage is None:
        return None
    if base < 0 or base % h.element_size() or base + h.nbytes > storage.nbytes():
        return f"{first_name}: its fused weight would reach outside the pushed memory"
    reached = 0
    for lo, hi in sorted(spans):
        if lo > reached:
            break
        reached = max(reached, hi)
    if reached < h.nbytes:
        return f"{first_name}: the update covers only part of its fused weight"
    return Rebind(h, tuple((v, off) for v, off, _ in entry.views if v is not h), storage, base)


def adoption_plan(layout: StoreLayout, incoming: Mapping[str, torch.Tensor]) -> Adoption:
    """For each held tensor the update touches: run it on the `incoming` tensors' memory if it lies there as the
    held tensor does (then all its names are `kept`), else say why (the caller copies those names in). The
    names must have been checked (known, right shapes). Looks only at the held items the incoming names lie in."""
    rebinds: list[Rebind] = []
    kept: set[str] = set()
    reason: str | None = None
    touched = sorted({layout.names[n] for n in incoming if n in layout.names})
    for index in touched:
        entry = layout.entries[index]
        plan = _plan_one(entry, incoming)
        if isinstance(plan, Rebind):
            rebinds.append(plan)
            kept.update(n for _, _, names in entry.views for n in names if n in incoming)
        elif plan is not None and reason is None:
            reason = plan
    return Adoption(rebinds, kept, reason)


def private_plan(layout: StoreLayout, ids: set[int]) -> list[Rebind]:
    """Every held tensor whose id is in `ids` (and its views) into a copy of its own."""
    plans = []
    for entry in layout.entries:
        h = entry.held
        if not isinstance(h, torch.Tensor) or id(h) not in ids:
            continue
        own = h.clone(memory_format=torch.contiguous_format)
        plans.append(Rebind(h, tuple((v, off) for v, off, _ in entry.views if v is not h), own.untyped_storage(), 0))
    return plans


def apply(plans: Sequence[Rebind]) -> None:
    """Carry out a plan (under no_grad: the tensors may be parameters)."""
    with torch.no_grad():
        for plan in plans:
            h = plan.held
            for view, offset in plan.views:
                size = view.element_size()
                view.set_(plan.storage, (plan.base + offset) // size, view.shape, view.stride())
            h.set_(plan.storage, plan.base // h.element_size(), h.shape, h.stride())


def adopt(layout: StoreLayout, incoming: Mapping[str, torch.Tensor],
          adopted: set[int]) -> tuple[set[int], set[str], str | None]:
    """Run every held tensor it can on the `incoming` memory; a held tensor that ran on earlier pushed memory
    (`adopted`: ids) and cannot run on this update's goes back into memory of its own first. Returns the ids
    now adopted, the names kept (the caller copies the others in) and why some were not (None: all were)."""
    adoption = adoption_plan(layout, incoming)
    now = {id(r.held) for r in adoption.rebinds}
    apply(private_plan(layout, adopted - now))
    apply(adoption.rebinds)
    return now, adoption.kept, adoption.reason
