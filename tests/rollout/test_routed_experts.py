"""Routing replay on the torch engine: the routed experts each sequence's positions took, first routes kept.

The tiny Qwen3-MoE (2 sparse layers, 8 experts, top-2) on the native executor; the reference is the router
top-k of transformers' own modeling code (a hook on every layer's `mlp.gate`) over a full forward pass.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch
from rollout_reference import hf_model
from test_native_architectures import PROMPTS, perturbed

from everstep.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
from everstep_rollout.config import EngineConfig
from everstep_rollout.engine import Engine
from everstep_rollout.proto_convert import request_from_proto, result_to_proto, sampling_from_proto
from everstep_rollout.routing import RouteBuffer, check_routed_experts
from everstep_rollout.sequence import FinishReason, GenerationRequest, SamplingOptions, SequenceResult

LAYERS, TOP_K = 2, 2
ROUTED = SamplingOptions(temperature=1.0, max_new_tokens=14, return_routed_experts=True)


def routes_of(r: SequenceResult | common_pb2.Sequence) -> np.ndarray:
    return np.frombuffer(r.routed_experts, dtype=np.uint8).reshape(-1, LAYERS, TOP_K)


class RouterReference:
    """transformers' router top-k of every position of a token sequence, [len, moe layers, top_k]."""

    def __init__(self, model_dir, state: dict[str, torch.Tensor] | None = None) -> None:
        self.model = hf_model(model_dir)
        if state is not None:
            self.model.load_state_dict(state)
        self._chosen: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.model.model.layers):
            layer.mlp.gate.register_forward_hook(lambda _m, _inp, out, i=i: self._chosen.__setitem__(i, out[2]))

    @torch.inference_mode()
    def __call__(self, tokens: list[int]) -> np.ndarray:
        self.model(torch.tensor([tokens]))
        return torch.stack([self._chosen[i] for i in range(LAYERS)], dim=1).numpy().astype(np.uint8)


def run(engine: Engine, requests: list[GenerationRequest]) -> dict[str, SequenceResult]:
    engine.add(requests)
    results: dict[str, SequenceResult] = {}
    while engine.has_work:
        for r in engine.step():
            results[r.id] = r
    return results


def requests(prompts: list[list[int]], sampling: SamplingOptions, prefix: str = "s") -> list[GenerationRequest]:
    return [GenerationRequest(id=f"{prefix}{i}", prompt_ids=p, sampling=sampling) for i, p in enumerate(prompts)]


def test_routes_equal_transformers_router_top_k_for_every_position(tiny_model_dirs):
    """Batched sequences of different prompt lengths, more than slots (they join while others decode): every
    position of prompt + output-but-last has transformers' routes; a sequence that does not ask gets none."""
    model_dir = tiny_model_dirs("qwen3_moe")
    engine = Engine(model_dir, EngineConfig(max_running=3, seed=5))
    plain = GenerationRequest(id="plain", prompt_ids=PROMPTS[0], sampling=SamplingOptions(max_new_tokens=5))
    results = run(engine, [*requests(PROMPTS, ROUTED), plain])
    assert results["plain"].routed_experts == b""
    reference = RouterReference(model_dir)
    used = set()
    for i, prompt in enumerate(PROMPTS):
        r = results[f"s{i}"]
        assert r.output_ids and r.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
        tokens = [*prompt, *r.output_ids]
        got = routes_of(r)
        assert got.shape == (len(tokens) - 1, LAYERS, TOP_K)
        np.testing.assert_array_equal(got, reference(tokens[:-1]))
        used.update(got.flatten().tolist())
    assert len(used) > 4


def test_carried_over_rollout_keeps_its_routes_and_records_the_rest_under_new_weights(tiny_model_dirs):
    """Drained mid-generation, new weights pushed, the partial sent again with its routes: its first segment's
    positions keep the routes they were sampled under byte for byte; later ones are the new weights' routes."""
    model_dir = tiny_model_dirs("qwen3_moe")
    engine = Engine(model_dir, EngineConfig(max_running=8, seed=3))
    sampling = SamplingOptions(temperature=1.0, max_new_tokens=24, return_routed_experts=True)
    engine.add(requests(PROMPTS, sampling))
    for _ in range(6):
        engine.step()  # a sequence that samples EOS meanwhile finishes; the others are drained
    partials = {p.id: p for p in engine.drain()}
    assert len(partials) >= 3
    old = RouterReference(model_dir)
    for p in partials.values():
        assert p.finish_reason == FinishReason.ABORTED and p.output_ids
        tokens = [*p.prompt_ids, *p.output_ids]
        np.testing.assert_array_equal(routes_of(p), old(tokens[:-1]))  # len(prompt) + len(output) - 1 positions

    new_state = perturbed(dict(old.model.state_dict()), seed=21)
    engine.update_weights(new_state, version=1)
    # Through the proto, as a controller carries a partial over.
    continued = [request_from_proto(result_to_proto(p), sampling, stream=0) for p in partials.values()]
    results = run(engine, continued)
    new = RouterReference(model_dir, new_state)
    changed = 0
    for pid, p in partials.items():
        r = results[pid]
        tokens = [*r.prompt_ids, *r.output_ids]
        assert r.output_ids[: len(p.output_ids)] == p.output_ids and len(r.output_ids) > len(p.output_ids)
        got = routes_of(r)
        assert got.shape == (len(tokens) - 1, LAYERS, TOP_K)
        first = len(p.prompt_ids) + len(p.output_ids) - 1
        assert r.routed_experts[: len(p.routed_experts)] == p.routed_experts  # byte for byte
        with_new_weights = new(tokens[:-1])
        np.testing.assert_array_equal(got[first:], with_new_weights[first:])
        changed += int((with_new_weights[:first] != got[:first]).any())
    assert changed  # the re-prefill under the new weights would have routed the first segment differently


def test_kv_recompute_after_a_weight_swap_keeps_the_first_routes(tiny_model_dirs):
    model_dir = tiny_model_dirs("qwen3_moe")
    engine = Engine(model_dir, EngineConfig(max_running=8, seed=4, recompute_kv_on_update=True))
    engine.add(requests(PROMPTS, SamplingOptions(temperature=1.0, max_new_tokens=20, return_routed_experts=True)))
    early = set()
    for _ in range(5):
        early.update(r.id for r in engine.step())
    old = RouterReference(model_dir)
    new_state = perturbed(dict(old.model.state_dict()), seed=22)
    engine.update_weights(new_state, version=1)
    results = run(engine, [])
    assert len(results) >= 3 and not early & set(results)
    new = RouterReference(model_dir, new_state)
    changed = 0
    for i, prompt in enumerate(PROMPTS):
        if f"s{i}" in early:
            continue
        r = results[f"s{i}"]
        tokens = [*prompt, *r.output_ids]
        got = routes_of(r)
        assert got.shape == (len(tokens) - 1, LAYERS, TOP_K)
        # Positions whose routes were computed before the swap: the prompt and the version-0 outputs but the last.
        first = len(prompt) + r.output_versions.count(0) - 1
        assert 0 < r.output_versions.count(0) < len(r.output_ids)
        np.testing.assert_array_equal(got[:first], old(tokens[:first]))
        with_new_weights = new(tokens[:-1])
        np.testing.assert_array_equal(got[first:], with_new_weights[first:])
        changed += int((with_new_weights[:first] != got[:first]).any())
    assert changed  # the recompute saw different routes for earlier positions, and did not record them


def test_chunked_prefill_gives_the_routes_of_a_one_shot_prefill(tiny_model_dirs):
    model_dir = tiny_model_dirs("qwen3_moe")
    greedy = SamplingOptions(temperature=0.0, max_new_tokens=10, return_routed_experts=True)
    one_shot = run(Engine(model_dir, EngineConfig(max_running=8)), requests(PROMPTS, greedy))
    # 12 padded tokens per prefill pass: the five prompts are prefilled over several forward passes.
    chunked_engine = Engine(model_dir, EngineConfig(max_running=8, prefill_max_tokens=12))
    passes = 0
    forward = chunked_engine.executor.forward

    def counting(batch):
        nonlocal passes
        passes += bool(batch.prefill_rows)
        return forward(batch)

    chunked_engine.executor.forward = counting
    chunked = run(chunked_engine, requests(PROMPTS, greedy))
    assert passes >= 3
    for sid, r in one_shot.items():
        assert chunked[sid].output_ids == r.output_ids
        assert chunked[sid].routed_experts == r.routed_experts
        assert len(routes_of(r)) == len(r.prompt_ids) + len(r.output_ids) - 1


def test_refusals_and_validation_name_the_field(tiny_model_dirs, tiny_model_dir):
    asks = SamplingOptions(max_new_tokens=4, return_routed_experts=True)
    dense = Engine(tiny_model_dirs("qwen3"), EngineConfig(max_running=2))
    with pytest.raises(ValueError, match="return_routed_experts refused: .*dense model"):
        dense.add(requests([[1, 5]], asks))
    assert run(dense, requests([[1, 5]], SamplingOptions(max_new_tokens=2)))["s0"].routed_experts == b""
    transformers = Engine(tiny_model_dir, EngineConfig(max_running=2, executor="transformers"))
    with pytest.raises(ValueError, match="return_routed_experts refused: the transformers executor"):
        transformers.add(requests([[1, 5]], asks))

    moe = Engine(tiny_model_dirs("qwen3_moe"), EngineConfig(max_running=2))
    prompt, output = [1, 5, 6], [7, 8]
    carried = dict(output_ids=output, output_logprobs=[-1.0, -1.0], output_versions=[0, 0], sampling=asks)
    with pytest.raises(ValueError, match="routed_experts has 7 bytes, not a multiple of the 4"):
        moe.add([GenerationRequest(id="x", prompt_ids=prompt, routed_experts=bytes(7), **carried)])
    with pytest.raises(ValueError, match="routed_experts covers 5 positions, more than the 4"):
        moe.add([GenerationRequest(id="x", prompt_ids=prompt, routed_experts=bytes(20), **carried)])
    assert not moe.has_work
    # Fewer positions than the sequence has (a partial drained before its first pass) is taken and completed.
    reference = RouterReference(tiny_model_dirs("qwen3_moe"))
    head = reference(prompt)[:2]
    r = run(moe, [GenerationRequest(id="x", prompt_ids=prompt, routed_experts=head.tobytes(), **carried)])["x"]
    tokens = [*prompt, *r.output_ids]
    got = routes_of(r)
    assert got.shape == (len(tokens) - 1, LAYERS, TOP_K)
    np.testing.assert_array_equal(got, reference(tokens[:-1]))


def test_route_buffer_keeps_first_routes_grows_and_refuses_gaps():
    buffer = RouteBuffer(2, 2, initial=bytes(range(8)), capacity=3)
    assert buffer.length == 2
    buffer.record(0, np.full((4, 2, 2), 9, dtype=np.uint8))  # positions 0-1 keep theirs, 2-3 are new
    assert buffer.to_bytes() == bytes(range(8)) + bytes([9]) * 8
    for position in range(4, 200):
        buffer.record(position, np.full((1, 2, 2), position % 256, dtype=np.uint8))
    assert buffer.length == 200 and buffer.array()[199].tolist() == [[199, 199], [199, 199]]
    with pytest.raises(RuntimeError, match="gap"):
        buffer.record(201, np.zeros((1, 2, 2), dtype=np.uint8))
    check_routed_experts("ok", bytes(12), num_layers=2, top_k=2, num_positions=3)


def test_proto_round_trip_carries_the_option_and_the_routes():
    params = common_pb2.SamplingParams(max_new_tokens=3, return_routed_experts=True)
    sampling = sampling_from_proto(params)
    assert sampling.return_routed_experts
    seq = common_pb2.Sequence(id="a", prompt_ids=[1, 2], output_ids=[3], output_logprobs=[-1.0], output_versions=[0],
                              routed_experts=bytes(range(8)))
    request = request_from_proto(seq, sampling, stream=0)
    assert request.routed_experts == bytes(range(8))
    result = SequenceResult(id="a", stream=0, prompt_ids=[1, 2], output_ids=[3], output_logprobs=[-1.0],
                            output_versions=[0], finish_reason=FinishReason.ABORTED, routed_experts=bytes(range(8)))
    assert result_to_proto(result).routed_experts == bytes(range(8))


def test_rollout_server_returns_routes_over_grpc_and_refuses_a_dense_model(service_process, tiny_model_dirs):
    moe = tiny_model_dirs("qwen3_moe")
    service = service_process("rollout", "--model", str(moe), "--max-running", "4")
    with grpc.insecure_channel(service.grpc_address) as channel:
        stub = rollout_pb2_grpc.RolloutStub(channel)
        sampling = common_pb2.SamplingParams(temperature=1.0, max_new_tokens=8, return_routed_experts=True)
        sequences = [common_pb2.Sequence(id=f"m{i}", prompt_ids=p) for i, p in enumerate(PROMPTS)]
        results = []
        for response in stub.Generate(iter([rollout_pb2.GenerateRequest(sequences=sequences, sampling=sampling)]),
                                      timeout=120):
            results.extend(response.sequences)
        assert sorted(r.id for r in results) == sorted(s.id for s in sequences)
        reference = RouterReference(moe)
        for r in results:
            tokens = [*r.prompt_ids, *r.output_ids]
            np.testing.assert_array_equal(routes_of(r), reference(tokens[:-1]))

        stub.Load(rollout_pb2.LoadModelRequest(model_path=str(tiny_model_dirs("qwen3"))))
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Generate(iter([rollout_pb2.GenerateRequest(sequences=sequences[:1], sampling=sampling)]),
                               timeout=60))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "return_routed_experts" in refused.value.details() and "dense" in refused.value.details()
