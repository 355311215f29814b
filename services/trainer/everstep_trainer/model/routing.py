"""Which experts a mixture-of-experts model routes each token to, and how much two routings disagree.

The groundwork of routing diagnostics and routing replay: `routed_experts` runs a transformers MoE model
(Qwen3-MoE and every model whose MoE block has a `gate` router returning `(logits, weights, indices)`, the
transformers 5 layout) on a batch and records, through forward hooks on the routers, the top-k expert ids
each router chose for each token. `routing_disagreement` compares two such records: the fraction of
(token, layer) pairs whose top-k expert SETS differ (the order within the top-k does not count).

Both are pure: nothing in the model is changed; the hooks are removed before `routed_experts` returns.

Routing replay (R3, `TrainerConfig.routing_replay` rollout): `replay_routes` is a context manager that, for the
forwards run inside it, makes every router return the engine's recorded top-k expert SET of each token (in the
engine's order) with gate weights computed by the router itself at those experts: its softmax over all
experts, gathered at them, renormalised over them when the router's `norm_topk_prob` is set (what Qwen3-MoE's
router does with its own top-k). The weights stay a function of the router's logits, so the router still
gets gradients. Positions without a recorded route keep the router's own choice. It can also count, per
(token, layer), how often the router's own top-k set differs from the recorded one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor

from everstep_trainer.batch.samples import RouteSpec
from everstep_trainer.model.hf_model import forward_kwargs

__all__ = ["RouteCounts", "check_replay_supported", "moe_routers", "replay_routes", "route_spec", "routed_experts",
           "routing_disagreement"]

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


# -- routing replay ----------------------------------------------------------------------------------------


def route_spec(model: torch.nn.Module, *, required: bool = False) -> RouteSpec | None:
    """The layout of `model`'s routes (MoE layers, top_k, experts), or None for a dense model. ValueError for
    routers that cannot be recorded as uint8 or that select different numbers of experts."""
    routers = moe_routers(model)
    if not routers:
        return None
    for name, router in routers:
        if router.num_experts > MAX_EXPERTS:
            raise ValueError(f"model: router {name} has {router.num_experts} experts; routes are uint8 "
                             f"(at most {MAX_EXPERTS})")
    shapes = {(router.top_k, router.num_experts) for _, router in routers}
    if len(shapes) != 1:
        raise ValueError(f"model: its routers differ in (top_k, num_experts): {sorted(shapes)}")
    ((top_k, num_experts),) = shapes
    return RouteSpec(num_layers=len(routers), top_k=top_k, num_experts=num_experts, required=required)


def _replayed_weights(router: torch.nn.Module, logits: Tensor, experts: Tensor) -> Tensor:
    """The gate weights of `experts` [tokens, top_k] (long): softmax of the router logits over all experts in
    float32, at those experts, renormalised over them with the router's `norm_topk_prob`."""
    weights = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, experts)
    if getattr(router, "norm_topk_prob", False):
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights


def _router_output(output: object, name: str) -> tuple[Tensor, Tensor, Tensor]:
    if not (isinstance(output, tuple) and len(output) == 3 and all(isinstance(t, Tensor) for t in output)):
        raise ValueError(f"model: router {name} does not return (logits, weights, indices); routing replay needs "
                         "a transformers 5 top-k router")
    return output


@torch.no_grad()
def check_replay_supported(model: torch.nn.Module) -> None:
    """ValueError naming `config.routing_replay` unless every router of `model` (unsharded: call it before
    FSDP) returns, for its own top-k, the gate weights `replay_routes` computes: replay would otherwise
    change the model's function even where the routes agree (a router with a bias or a sigmoid, say)."""
    routers = moe_routers(model)
    if not routers:
        raise ValueError(f"config.routing_replay: 'rollout' needs a mixture-of-experts model; "
                         f"{type(model).__name__} (model_type {getattr(model.config, 'model_type', '?')!r}) has no "
                         "MoE router")
    generator = torch.Generator().manual_seed(0)
    for name, router in routers:
        weight = router.weight
        hidden = torch.randn((16, weight.shape[1]), generator=generator).to(weight.device, weight.dtype)
        logits, weights, indices = _router_output(router(hidden), name)
        expected = _replayed_weights(router, logits, indices.long()).to(weights.dtype)
        if not torch.allclose(weights, expected, atol=1e-5, rtol=1e-4):
            raise ValueError(f"config.routing_replay: router {name} ({type(router).__name__}) computes its gate "
                             "weights otherwise than softmax at the top-k (renormalised with norm_topk_prob); "
                             "routing replay does not support it")


@dataclass
class RouteCounts:
    """(token, MoE layer) pairs with a recorded route, and those whose own top-k set differed from it; of them,
    those at stale positions (`stale`: the [N] mask of the forward being counted, in the routes' order)."""

    differing: list[Tensor] = field(default_factory=list)
    total: list[Tensor] = field(default_factory=list)
    differing_stale: list[Tensor] = field(default_factory=list)
    total_stale: list[Tensor] = field(default_factory=list)
    stale: Tensor | None = None
    multiplicity: Tensor | None = None
    """[N] how many of the batch's tokens each position stands for (shared prompts: the samples sharing it);
    None: one each."""

    def sums(self) -> tuple[float, float, float, float]:
        """(differing, total, differing at stale positions, total at stale positions) as floats (one sync)."""
        if not self.total:
            return 0.0, 0.0, 0.0, 0.0
        parts = (self.differing, self.total, self.differing_stale, self.total_stale)
        values = torch.stack([torch.stack(p).sum() if p else self.total[0] * 0 for p in parts]).tolist()
        return tuple(float(v) for v in values)  # type: ignore[return-value]


@contextlib.contextmanager
def replay_routes(model: torch.nn.Module, routes: Tensor, has_route: Tensor, *, replay: bool = True,
                  counts: RouteCounts | None = None) -> Iterator[None]:
    """For forwards of `model` inside the block: `routes` [N, layers, top_k] (expert ids) and `has_route` [N]
    (bool) are in the order the routers see the tokens: the input's [B, L] (or packed [R, W]) positions,
    row-major. With `replay`, each router returns, where `has_route`, the recorded experts and the gate
    weights of `_replayed_weights` at them (its own top-k elsewhere). `counts`: add the (token, layer) pairs
    with a route and those whose own top-k set differs from the recorded one (before replay replaces it).
    Forward hooks on the routers (plain submodules of the FSDP units, so it works under FSDP2), removed on exit."""
    routers = moe_routers(model)
    if routes.dim() != 3 or routes.shape[1] != len(routers) or has_route.shape != routes.shape[:1]:
        raise ValueError(f"routes: expected [tokens, {len(routers)}, top_k] with a [tokens] mask, got "
                         f"{tuple(routes.shape)} and {tuple(has_route.shape)}")

    def hook_for(layer: int, name: str):
        def hook(router: torch.nn.Module, _inputs: object, output: object) -> object:
            logits, weights, indices = _router_output(output, name)
            if indices.shape[0] != routes.shape[0] or indices.shape[1] != routes.shape[2]:
                raise ValueError(f"routes: router {name} routed {tuple(indices.shape)} tokens x experts, the "
                                 f"recorded routes are {tuple(routes.shape[:1])} x {routes.shape[2]}")
            recorded = routes[:, layer].to(device=indices.device, dtype=torch.long)
            mask = has_route.to(indices.device)
            if counts is not None:
                with torch.no_grad():
                    differs = (indices.long().sort(dim=-1).values != recorded.sort(dim=-1).values).any(dim=-1)
                    weight = (torch.ones_like(mask, dtype=torch.long) if counts.multiplicity is None
                              else counts.multiplicity.to(indices.device))
                    counts.differing.append(((differs & mask) * weight).sum())
                    counts.total.append((mask * weight).sum())
                    if counts.stale is not None:
                        stale = mask & counts.stale.to(indices.device)
                        counts.differing_stale.append(((differs & stale) * weight).sum())
                        counts.total_stale.append((stale * weight).sum())
            if not replay:
                return None
            experts = torch.where(mask[:, None], recorded, indices.long())
            replayed = _replayed_weights(router, logits, experts).to(weights.dtype)
            return logits, replayed, experts.to(indices.dtype)
        return hook

    handles = [router.register_forward_hook(hook_for(layer, name)) for layer, (name, router) in enumerate(routers)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
