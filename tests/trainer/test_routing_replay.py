"""Mixture-of-experts routing replay (R3, `algorithm.routing_replay: rollout`) in the trainer: the engine's
recorded expert sets replace the trainer's own top-k in every forward, with the trainer's own gate weights at
them; padded and packed layouts; `routing_disagreement`; validation; FSDP2 on two ranks.

"Engine" routes are simulated with `routing.routed_experts` on the model itself (own routes) or on a copy
whose routers are perturbed (an engine whose routing disagrees with the trainer's)."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import torch
from distributed_check import (
    UPDATE_TOLERANCE,
    check_batches,
    check_config,
    relative_update_difference,
    train_on_one_rank,
    train_on_ranks,
)

from everstep.settings.training import TrainerConfig
from everstep.v1 import trainer_pb2, trainer_pb2_grpc
from everstep_trainer.batch.packing import PackedRows
from everstep_trainer.batch.samples import RouteSpec, TrainSample, pad_samples, validate_samples
from everstep_trainer.model.hf_model import compute_token_logprobs, load_causal_lm
from everstep_trainer.model.routing import (
    RouteCounts,
    moe_routers,
    replay_routes,
    route_spec,
    routed_experts,
    routing_disagreement,
)
from everstep_trainer.server import TrainerService
from everstep_trainer.step import trainer as trainer_module
from everstep_trainer.step.trainer import PolicyTrainer

NUM_LAYERS, NUM_EXPERTS, TOP_K = 2, 8, 2
SPEC = RouteSpec(num_layers=NUM_LAYERS, top_k=TOP_K, num_experts=NUM_EXPERTS)


@pytest.fixture(scope="module")
def moe_dir(tiny_model_dirs) -> Path:
    return tiny_model_dirs("qwen3_moe")


def _perturbed(model: torch.nn.Module, scale: float = 0.5, seed: int = 7) -> torch.nn.Module:
    """A copy of `model` whose routers are perturbed: an engine that routes some tokens otherwise."""
    other = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, router in moe_routers(other):
            noise = torch.randn(router.weight.shape, generator=generator)
            router.weight.add_(scale * router.weight.std() * noise)
    return other


@torch.no_grad()
def _with_routes(samples: Sequence[TrainSample], model: torch.nn.Module) -> list[TrainSample]:
    """The samples with `model`'s routes of every token but the last, as the engine records them."""
    routed = []
    for sample in samples:
        ids = torch.tensor([[*sample.prompt_ids, *sample.output_ids][:-1]])
        routes = routed_experts(model, ids, torch.ones_like(ids))
        assert routes.shape == (sample.num_tokens - 1, NUM_LAYERS, TOP_K)
        routed.append(dataclasses.replace(sample, routed_experts=routes.numpy().tobytes()))
    return routed


def _samples(seed: int = 3) -> list[TrainSample]:
    return [sample for batch in check_batches(51, num_steps=2, seed=seed) for sample in batch]


def _packed(batch) -> PackedRows:
    """The batch's rows packed two by two (0+1, 2+3, ...)."""
    lengths = batch.attention_mask.sum(dim=1).tolist()
    rows = [list(range(i, min(i + 2, len(lengths)))) for i in range(0, len(lengths), 2)]
    width = max(sum(lengths[i] for i in row) for row in rows)
    return PackedRows.build(batch.input_ids, batch.attention_mask, rows, width=width, pad_token_id=0)


def _logp(model: torch.nn.Module, batch, packed: PackedRows | None = None, *, replay: bool = True,
          counts: RouteCounts | None = None) -> torch.Tensor:
    flat = batch.flat_routes(packed)
    assert flat is not None
    with replay_routes(model, *flat, replay=replay, counts=counts):
        return compute_token_logprobs(model, batch.input_ids, batch.attention_mask, batch.output_mask,
                                      packed=packed)


# -- replay ------------------------------------------------------------------------------------------------


@torch.no_grad()
def test_replaying_the_models_own_routes_changes_nothing(moe_dir: Path) -> None:
    model = load_causal_lm(moe_dir)
    batch = pad_samples(_with_routes(_samples(), model), pad_token_id=0, routing=SPEC)
    plain = compute_token_logprobs(model, batch.input_ids, batch.attention_mask, batch.output_mask)
    counts = RouteCounts()
    replayed = _logp(model, batch, counts=counts)
    assert torch.allclose(replayed, plain, atol=1e-6, rtol=0)
    assert counts.sums()[:2] == (0.0, float(batch.route_mask.sum() * NUM_LAYERS))
    packed = _packed(batch)
    assert torch.allclose(_logp(model, batch, packed), plain, atol=1e-5, rtol=0)


def _forced_forward(gate: torch.nn.Module, experts: torch.Tensor, has_route: torch.Tensor):
    """An independent router forward forced to `experts` where `has_route`: one-hot selection of its softmax,
    renormalised (norm_topk_prob), its own top-k elsewhere."""
    def forward(hidden_states: torch.Tensor):
        hidden = hidden_states.reshape(-1, gate.weight.shape[1])
        logits = torch.nn.functional.linear(hidden, gate.weight)
        probs = torch.softmax(logits.float(), dim=-1)
        chosen = torch.where(has_route[:, None], experts.long(), torch.topk(probs, TOP_K, dim=-1).indices)
        picked = (torch.nn.functional.one_hot(chosen, NUM_EXPERTS).float() * probs[:, None, :]).sum(-1)
        return logits, (picked / picked.sum(-1, keepdim=True)).to(logits.dtype), chosen
    return forward


def test_replayed_routes_are_the_engines_sets_with_the_trainers_own_gate_weights(moe_dir: Path) -> None:
    model = load_causal_lm(moe_dir)  # B, the trainer
    engine = _perturbed(model)  # A, an engine that routes otherwise
    batch = pad_samples(_with_routes(_samples(), engine), pad_token_id=0, routing=SPEC)
    routes, has_route = batch.flat_routes()
    own = routed_experts(model, batch.input_ids, batch.attention_mask)  # B's own top-k at the real tokens
    real = batch.attention_mask.reshape(-1).bool()
    assert routing_disagreement(own[has_route[real]], routes[has_route]) > 0.1

    seen: dict[str, list] = {"experts": [], "gate_input": [], "own": []}
    handles = [model.model.layers[0].mlp.gate.register_forward_pre_hook(
        lambda _m, args: seen["gate_input"].append(args[0].detach()))]
    for layer in model.model.layers:
        handles.append(layer.mlp.experts.register_forward_pre_hook(
            lambda _m, args: seen["experts"].append((args[1].detach(), args[2].detach()))))
        # Registered before replay's hook, so it sees the router's own choice (given the replayed layers before).
        handles.append(layer.mlp.gate.register_forward_hook(
            lambda _m, _args, output: seen["own"].append(output[2].detach())))
    try:
        replayed = _logp(model, batch)
    finally:
        for handle in handles:
            handle.remove()
    # Every MoE layer got A's experts (in A's order) where there is a route, B's own top-k elsewhere.
    assert len(seen["experts"]) == NUM_LAYERS
    for layer, (indices, _) in enumerate(seen["experts"]):
        assert torch.equal(indices[has_route].long(), routes[has_route, layer].long()), layer
        assert torch.equal(indices[~has_route], seen["own"][layer][~has_route]), layer
    # Layer 0's gate weights, by hand: B's softmax over all experts at A's, renormalised (norm_topk_prob).
    gate = model.model.layers[0].mlp.gate
    assert gate.norm_topk_prob
    with torch.no_grad():
        probs = torch.softmax(seen["gate_input"][0].reshape(-1, 64) @ gate.weight.T, dim=-1)
        at = probs.gather(-1, seen["experts"][0][0].long())
        expected = at / at.sum(-1, keepdim=True)
    assert torch.allclose(seen["experts"][0][1], expected, atol=1e-6)
    assert not torch.allclose(replayed, compute_token_logprobs(model, batch.input_ids, batch.attention_mask,
                                                               batch.output_mask).detach(), atol=1e-4)

    # The same log-probs and router gradients as a forward whose routers are forced to A's routes.
    (-replayed[batch.output_mask].sum()).backward()
    replay_grads = [router.weight.grad.clone() for _, router in moe_routers(model)]
    assert all(float(g.abs().sum()) > 0 for g in replay_grads)  # the routers still learn
    model.zero_grad(set_to_none=True)
    for layer, (_, router) in enumerate(moe_routers(model)):
        router.forward = _forced_forward(router, routes[:, layer], has_route)
    try:
        forced = compute_token_logprobs(model, batch.input_ids, batch.attention_mask, batch.output_mask)
        (-forced[batch.output_mask].sum()).backward()
    finally:
        for _, router in moe_routers(model):
            del router.forward
    assert torch.allclose(replayed, forced, atol=1e-5, rtol=0)
    for replay_grad, (_, router) in zip(replay_grads, moe_routers(model), strict=True):
        assert torch.allclose(replay_grad, router.weight.grad, atol=1e-5, rtol=1e-4)


def test_padded_and_packed_layouts_replay_alike(moe_dir: Path) -> None:
    model = load_causal_lm(moe_dir)
    batch = pad_samples(_with_routes(_samples(), _perturbed(model)), pad_token_id=0, routing=SPEC)
    packed = _packed(batch)
    assert packed.input_ids.shape[0] < len(batch)
    results = []
    for layout in (None, packed):
        model.zero_grad(set_to_none=True)
        counts = RouteCounts()
        logp = _logp(model, batch, layout, counts=counts)
        (-logp[batch.output_mask].sum()).backward()
        results.append((logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, counts.sums()))
    (padded_logp, padded_grads, padded_counts), (packed_logp, packed_grads, packed_counts) = results
    assert torch.allclose(padded_logp, packed_logp, atol=1e-5, rtol=0)
    for name, grad in padded_grads.items():
        assert torch.allclose(grad, packed_grads[name], atol=1e-5, rtol=1e-4), name
    assert padded_counts == packed_counts and padded_counts[0] > 0


# -- the train step --------------------------------------------------------------------------------------


def _weights(trainer: PolicyTrainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def _trained(moe_dir: Path, config: TrainerConfig, samples: Sequence[TrainSample]):
    trainer = PolicyTrainer(moe_dir, config, device="cpu")
    _, stats = trainer.train_step(samples)
    return stats, _weights(trainer)


def test_a_train_step_with_own_routes_equals_one_without_replay(moe_dir: Path) -> None:
    # One minibatch: every forward runs at the weights the routes came from (after an optimizer step, the
    # trainer's own routing may move away from the recorded one, which replay then keeps).
    samples = check_batches(51, num_steps=1)[0]
    own = _with_routes(samples, load_causal_lm(moe_dir))
    off_stats, off_weights = _trained(moe_dir, check_config(num_minibatches=1), samples)
    on_stats, on_weights = _trained(moe_dir, check_config(num_minibatches=1, routing_replay="rollout"), own)
    assert on_stats.loss == pytest.approx(off_stats.loss, abs=1e-6)
    initial = _weights(PolicyTrainer(moe_dir, check_config(num_minibatches=1), device="cpu"))
    assert relative_update_difference(initial, off_weights, on_weights) < UPDATE_TOLERANCE
    assert (off_stats.routing_disagreement, on_stats.routing_disagreement) == (0.0, 0.0)


def test_a_positions_route_is_stale_when_an_older_version_sampled_the_token_after_it() -> None:
    """Prompt positions: the version of the first output token (the prefill sampled it); output position p: the
    version of the token at p + 1; the last position has no route; -1 (unknown) counts as fresh."""
    samples = [TrainSample(prompt_ids=[1, 5, 6], output_ids=[7, 8, 9, 10], rollout_logprobs=[-1.0] * 4,
                           advantage=1.0, output_versions=[1, 1, 2, 2]),
               TrainSample(prompt_ids=[1, 5], output_ids=[7, 8], rollout_logprobs=[-1.0] * 2, advantage=-1.0,
                           output_versions=[2, 2])]
    batch = pad_samples(samples, pad_token_id=0)
    stale = batch.flat_stale_routes(2).reshape(len(samples), -1)
    assert stale.tolist() == [[True, True, True, True, False, False, False],
                              [False, False, False, False, False, False, False]]
    assert not batch.flat_stale_routes(1).any() and batch.flat_stale_routes(3)[:6].all()
    packed = PackedRows.build(batch.input_ids, batch.attention_mask, [[0, 1]], width=11, pad_token_id=0)
    assert batch.flat_stale_routes(2, packed).tolist() == [True] * 4 + [False] * 7


def test_routing_disagreement_is_split_into_fresh_and_stale_positions(moe_dir: Path) -> None:
    """The trainer at version 2: samples of version 2 bring its own routes (no disagreement), samples of version 1
    (carried over) a perturbed engine's; every stale position is of the latter, so fresh is 0 and stale > 0."""
    model = load_causal_lm(moe_dir)
    samples = check_batches(51, num_steps=1)[0]
    fresh = [dataclasses.replace(s, output_versions=[2] * len(s.output_ids)) for s in samples[:2]]
    stale = [dataclasses.replace(s, output_versions=[1] * len(s.output_ids)) for s in samples[2:]]
    trainer = PolicyTrainer(moe_dir, check_config(num_minibatches=1, routing_replay="rollout"), device="cpu",
                            version=2)
    _, stats = trainer.train_step([*_with_routes(fresh, model), *_with_routes(stale, _perturbed(model))])
    assert stats.routing_disagreement_fresh == 0.0
    assert 0.0 < stats.routing_disagreement < stats.routing_disagreement_stale < 1.0


def test_replay_in_every_forward_of_the_step_and_the_reference(moe_dir: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    samples = _with_routes(check_batches(51, num_steps=1)[0], _perturbed(load_causal_lm(moe_dir)))
    config = check_config(kl_coef=0.05, ppo_epochs=2, routing_replay="rollout")
    calls: list[tuple[torch.nn.Module, bool, bool]] = []
    original = trainer_module.replay_routes

    def spy(model, routes, has_route, *, replay, counts=None):
        calls.append((model, replay, counts is not None))
        return original(model, routes, has_route, replay=replay, counts=counts)

    monkeypatch.setattr(trainer_module, "replay_routes", spy)
    trainer = PolicyTrainer(moe_dir, config, device="cpu")
    _, stats = trainer.train_step(samples)
    assert all(replay for _, replay, _ in calls)
    policy_calls = [c for c in calls if c[0] is trainer.model]
    reference_calls = [c for c in calls if c[0] is trainer.reference]
    assert reference_calls and len(policy_calls) + len(reference_calls) == len(calls)
    assert sum(counted for _, _, counted in calls) == len(reference_calls)  # the old log-prob pass counts
    assert len(policy_calls) > 2 * len(reference_calls)  # the forward/backward passes of both epochs replay
    assert 0.0 < stats.routing_disagreement < 1.0


def test_packed_and_padded_train_steps_with_replay_agree(moe_dir: Path) -> None:
    samples = _with_routes(check_batches(51, num_steps=1)[0], _perturbed(load_causal_lm(moe_dir)))
    padded_stats, padded_weights = _trained(moe_dir, check_config(routing_replay="rollout"), samples)
    packed_stats, packed_weights = _trained(moe_dir, check_config(routing_replay="rollout", packing=True), samples)
    assert packed_stats.loss == pytest.approx(padded_stats.loss, rel=1e-5, abs=1e-7)
    assert packed_stats.routing_disagreement == padded_stats.routing_disagreement > 0
    initial = _weights(PolicyTrainer(moe_dir, check_config(), device="cpu"))
    assert relative_update_difference(initial, padded_weights, packed_weights) < UPDATE_TOLERANCE
    off_stats, _ = _trained(moe_dir, check_config(), samples)  # routes given, replay off: only counted
    assert off_stats.routing_disagreement > 0 and off_stats.loss != pytest.approx(padded_stats.loss, abs=1e-7)


# -- validation --------------------------------------------------------------------------------------------


def test_validation_names_routed_experts() -> None:
    sample = TrainSample(prompt_ids=[1, 2, 3], output_ids=[4, 5], rollout_logprobs=[-1.0, -1.0], advantage=1.0)
    good = dataclasses.replace(sample, routed_experts=bytes(4 * NUM_LAYERS * TOP_K))  # 3 + 2 - 1 positions
    validate_samples([good, sample], routing=SPEC)  # replay off: a sample may carry no routes
    validate_samples([good, sample], routing=None)  # a dense model: routes are not looked at
    required = dataclasses.replace(SPEC, required=True)
    with pytest.raises(ValueError, match=r"samples\[1\]\.routed_experts: missing"):
        validate_samples([good, sample], routing=required)
    short = dataclasses.replace(sample, routed_experts=bytes(5 * NUM_LAYERS * TOP_K))
    with pytest.raises(ValueError, match=r"samples\[1\]\.routed_experts: 20 bytes, expected 16: 4 positions"):
        validate_samples([good, short], routing=required)
    out_of_range = dataclasses.replace(good, routed_experts=bytes([0] * 15 + [NUM_EXPERTS]))
    with pytest.raises(ValueError, match=r"samples\[0\]\.routed_experts: expert id 8 is out of range"):
        validate_samples([out_of_range], routing=SPEC)


def test_a_dense_model_with_replay_is_refused(tiny_model_dir: Path) -> None:
    assert route_spec(load_causal_lm(tiny_model_dir)) is None
    with pytest.raises(ValueError, match="config.routing_replay: 'rollout' needs a mixture-of-experts model"):
        PolicyTrainer(tiny_model_dir, TrainerConfig(routing_replay="rollout"), device="cpu")


# -- over gRPC ---------------------------------------------------------------------------------------------


def _proto(sample: TrainSample) -> trainer_pb2.TrainSample:
    return trainer_pb2.TrainSample(prompt_ids=sample.prompt_ids, output_ids=sample.output_ids,
                                   rollout_logprobs=sample.rollout_logprobs, advantage=sample.advantage,
                                   routed_experts=sample.routed_experts)


@pytest.fixture
def trainer_stub():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    service = TrainerService()
    trainer_pb2_grpc.add_TrainerServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield trainer_pb2_grpc.TrainerStub(channel)
    finally:
        server.stop(grace=None)
        service.close()


def test_train_step_over_grpc_reports_routing_disagreement_and_names_bad_routes(
        trainer_stub, moe_dir: Path, tiny_model_dir: Path) -> None:
    replay = trainer_pb2.TrainerConfig(learning_rate=1e-3, micro_batch_tokens=64,
                                       routing_replay=trainer_pb2.ROUTING_REPLAY_ROLLOUT)
    with pytest.raises(grpc.RpcError) as failure:
        trainer_stub.Load(trainer_pb2.TrainerLoadRequest(model_path=str(tiny_model_dir), config=replay), timeout=120)
    assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "config.routing_replay" in failure.value.details()

    model = load_causal_lm(moe_dir)
    samples = check_batches(51, num_steps=1)[0]
    own, perturbed = _with_routes(samples, model), _with_routes(samples, _perturbed(model))
    disagreement = {}
    for name, routed in (("own", own), ("perturbed", perturbed)):
        trainer_stub.Load(trainer_pb2.TrainerLoadRequest(model_path=str(moe_dir), config=replay), timeout=120)
        step = trainer_stub.TrainStep(trainer_pb2.TrainStepRequest(samples=[_proto(s) for s in routed]), timeout=120)
        assert step.version == 1
        disagreement[name] = step.stats.routing_disagreement
    assert disagreement["own"] == 0.0
    assert 0.0 < disagreement["perturbed"] < 1.0

    bad = [dataclasses.replace(own[0], routed_experts=own[0].routed_experts[:-1]), own[1],
           dataclasses.replace(own[2], routed_experts=b"")]
    for index in (0, 2):
        batch = [*own[:index], bad[index], *own[index + 1:]]
        with pytest.raises(grpc.RpcError) as failure:
            trainer_stub.TrainStep(trainer_pb2.TrainStepRequest(samples=[_proto(s) for s in batch]), timeout=120)
        assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"samples[{index}].routed_experts" in failure.value.details()


# -- FSDP2 -------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("extra", [{"ppo_epochs": 2}, {"packing": True}, {"kl_coef": 0.05}])
def test_two_ranks_with_replay_equal_one_rank(moe_dir: Path, extra: dict) -> None:
    engine = _perturbed(load_causal_lm(moe_dir))
    batches = [_with_routes(batch, engine) for batch in check_batches(51, num_steps=2)]
    config = check_config(routing_replay="rollout", **extra)
    one = train_on_one_rank(moe_dir, config, batches)
    two = train_on_ranks(moe_dir, config, batches, world_size=2)
    assert two.losses == pytest.approx(one.losses, rel=1e-5, abs=1e-7)
    assert two.grad_norms == pytest.approx(one.grad_norms, rel=1e-5)
    assert two.routing_disagreements == pytest.approx(one.routing_disagreements, abs=1e-12)
    assert one.routing_disagreements[0] > 0
    initial = train_on_one_rank(moe_dir, config, [])
    if "kl_coef" not in extra:
        # (With the KL reference, an expert that only masked tokens reach gets a gradient of float noise alone
        # (~1e-11: the policy equals the reference at first), which AdamW's first step turns into +-lr either
        # way: a whole expert, 3.5e-3 of the update measured; the replay itself is compared by the losses and
        # gradient norms above.)
        assert relative_update_difference(initial.weights, one.weights, two.weights) < UPDATE_TOLERANCE
    off = train_on_one_rank(moe_dir, check_config(**extra), batches)
    # replay did change the training, by far more than the bound above allows
    assert relative_update_difference(initial.weights, one.weights, off.weights) > 10 * UPDATE_TOLERANCE
