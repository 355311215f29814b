"""Which experts a mixture-of-experts model routes each token to, and how much two routings disagree.

The groundwork of routing diagnostics and routing replay: `routed_experts` runs a transformers MoE model
(Qwen3-MoE and every model whose MoE block has a `gate` router returning `(logits, weights, indices)`, the
transformers 5 layout) on a batch and records, through forward hooks on the routers, the top-k expert ids
each router chose for each token. `routing_disagreement` compares two such records: the fraction of
(token, layer) pairs whose top-k expert SETS differ (the order within the top-k does not count).

Both are pure: nothing in the model is changed; the hooks are removed before `routed_experts` returns.
"""

from __future__ import annotations

import torch
from torch import Tensor

from everstep_trainer.hf_model import forward_kwargs

__all__ = ["moe_routers", "routed_experts", "routing_disagreement"]

# Expert ids are stored as uint8: a model with more experts than this cannot be recorded.
MAX_EXPERTS = 256


def _is_router(module: torch.nn.Module) -> bool:
    """A transformers 5 top-k router: `top_k`, `num_experts` and a [num_experts, hidden] weight."""
    weight = getattr(module, "weight", None)
    return (isinstance(getattr(module, "top_k", None), int) and isinstance(getattr(module, "num_experts", None), int)
            and isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.shape[0] == module.num_experts)


def moe_routers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of every MoE router of `model`, in layer order (e.g. `model.layers.3.mlp.gate`).
    Empty for a dense model."""
    return [(name, module) for name, module in model.named_modules() if _is_router(module)]


def _indices_of(output: object, top_k: int, name: str) -> Tensor:
    """The [tokens, top_k] integer tensor among a router's outputs."""
    candidates = output if isinstance(output, tuple | list) else (output,)
    for value in candidates:
        if isinstance(value, Tensor) and not value.is_floating_point() and value.dim() == 2 \
                and value.shape[-1] == top_k:
            return value
    raise ValueError(f"model: router {name} returned no [tokens, {top_k}] tensor of expert ids; "
                     "routed_experts reads transformers 5 routers, which return (logits, weights, indices)")


@torch.no_grad()
def routed_experts(model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor | None = None, *,
                   position_ids: Tensor | None = None) -> Tensor:
    """The top-k expert ids each MoE layer's router selects for each token: uint8 [tokens, layers, top_k].

    input_ids: [B, L]. Tokens are the positions where `attention_mask` is 1, in row-major order (every
    position when it is None: a packed batch, which passes its `position_ids` instead). Layers are the
    model's MoE layers in order (`moe_routers`); the top-k ids are in the router's order (by descending
    weight). One forward without gradient; ValueError for a model without routers or with more than
    256 experts. On a model sharded over several ranks (FSDP2) the forward is a collective: call it on
    every rank.
    """
    routers = moe_routers(model)
    if not routers:
        raise ValueError(f"model: {type(model).__name__} has no mixture-of-experts router to record")
    for name, router in routers:
        if router.num_experts > MAX_EXPERTS:
            raise ValueError(f"model: router {name} has {router.num_experts} experts; ids are recorded as uint8 "
                             f"(at most {MAX_EXPERTS})")
    top_ks = {router.top_k for _, router in routers}
    if len(top_ks) != 1:
        raise ValueError(f"model: its routers select different numbers of experts ({sorted(top_ks)})")
    recorded: list[Tensor | None] = [None] * len(routers)

    def hook_for(layer: int, name: str, top_k: int):
        def hook(_module: torch.nn.Module, _inputs: object, output: object) -> None:
            if recorded[layer] is not None:
                raise RuntimeError(f"router {name} ran twice in one forward")
            recorded[layer] = _indices_of(output, top_k, name).reshape(-1, top_k)
        return hook

    handles = [router.register_forward_hook(hook_for(layer, name, router.top_k))
               for layer, (name, router) in enumerate(routers)]
    try:
        kwargs = forward_kwargs(model)
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask
        if position_ids is not None:
            kwargs["position_ids"] = position_ids
        model(input_ids=input_ids, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    missing = [name for (name, _), ids in zip(routers, recorded, strict=True) if ids is None]
    if missing:
        raise RuntimeError(f"routers did not run in the forward: {missing}")
    experts = torch.stack([ids for ids in recorded if ids is not None], dim=1)  # [B * L, layers, top_k]
    if attention_mask is not None:
        experts = experts[attention_mask.reshape(-1).bool()]
    return experts.to(torch.uint8)


def routing_disagreement(a: Tensor, b: Tensor) -> float:
    """Fraction of (token, layer) pairs whose top-k expert sets differ between two `routed_experts`
    tensors [tokens, layers, top_k] of the same tokens (order within the top-k ignored). 0.0 for no tokens."""
    if a.shape != b.shape or a.dim() != 3:
        raise ValueError(f"a, b: must both be [tokens, layers, top_k], got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.shape[0] == 0 or a.shape[1] == 0:
        return 0.0
    same = torch.sort(a.long(), dim=-1).values == torch.sort(b.long(), dim=-1).values
    return float((~same.all(dim=-1)).float().mean())
