"""Routing replay on the sglang engine, against a stand-in for sglang's routed-experts API (after 0.5.3).

`RoutingSglangStandIn` plays sglang with `--enable-return-routed-experts` (its PR #12162 and the later
`routed_experts_start_len`): a `GenerateReqInput` with `return_routed_experts` and `routed_experts_start_len`,
answered, when the request ends (finished or aborted), with `meta_info["routed_experts"]` = base64 of
little-endian int32 [positions start..seqlen-2][every decoder layer][top_k], as sglang's
`_RoutedExpertsCapturerReal.get_routed_experts` and the tokenizer manager build it. Its "router" is a
deterministic function of the position's token, the position and the weight offset; a dense layer's rows hold
-1. The pinned sglang 0.5.3 (`GenerateReqInputStandIn`, no such field) is refused.
"""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from test_sglang_engine import GenerateReqInputStandIn, SglangStandIn, next_token, run

from everstep_rollout.config import EngineConfig
from everstep_rollout.engine.sglang_api import sglang_routes
from everstep_rollout.engine.sglang_engine import SglangEngine
from everstep_rollout.sequence import FinishReason, GenerationRequest, SamplingOptions

NUM_LAYERS, TOP_K, NUM_EXPERTS = 3, 2, 8
MOE_LAYERS = (1, 2)  # layer 0 is dense (mlp_only_layers)
PROMPTS = {"a": [1, 5, 6], "b": [1, 9], "c": [1, 20, 21, 22]}


def stand_in_route(token: int, position: int, layer: int, offset: int) -> list[int]:
    first = (token + 3 * position + 5 * layer + offset) % NUM_EXPERTS
    return [first, (first + 1 + layer) % NUM_EXPERTS]


def expected_routes(tokens: list[int], offsets: list[int]) -> np.ndarray:
    """Our layout for positions 0..len(offsets)-1, position p routed under weight offset offsets[p]."""
    return np.array([[stand_in_route(tokens[p], p, layer, offsets[p]) for layer in MOE_LAYERS]
                     for p in range(len(offsets))], dtype=np.uint8)


@dataclass(kw_only=True)
class RoutingGenerateReqInputStandIn(GenerateReqInputStandIn):
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0


class RoutingSglangStandIn(SglangStandIn):
    def __init__(self, *, routes_on_abort: bool = True) -> None:
        super().__init__()
        self.routes_on_abort = routes_on_abort
        self.start_lens: list[int] = []
        self.routes_by_position: dict[str, list[list[list[int]]]] = {}

    def _routes(self, rid: str, tokens: list[int], start: int) -> str:
        """sglang's capture: every decoder layer's top-k of positions start..len(tokens)-2, int32, base64."""
        rows = self.routes_by_position[rid]
        ids = np.array(rows[start : len(tokens) - 1], dtype="<i4")
        return base64.b64encode(ids.tobytes()).decode("ascii")

    async def _generate_request(self, obj: RoutingGenerateReqInputStandIn, request=None):
        assert isinstance(obj, RoutingGenerateReqInputStandIn) and obj.stream and obj.rid
        rid, tokens, max_new_tokens = obj.rid, list(obj.input_ids), obj.sampling_params["max_new_tokens"]
        assert 0 <= obj.routed_experts_start_len <= len(tokens)
        self.start_lens.append(obj.routed_experts_start_len)
        await asyncio.sleep(0)
        self.active.add(rid)
        # The prefill routes every input position but the last under the current weights.
        self.routes_by_position[rid] = [
            [[-1] * TOP_K if layer not in MOE_LAYERS else stand_in_route(tokens[p], p, layer, self.offset)
             for layer in range(NUM_LAYERS)] for p in range(len(tokens) - 1)]
        triples: list[tuple[float, int, None]] = []

        def chunk(finish, with_routes: bool):
            meta = {"id": rid, "finish_reason": finish, "completion_tokens": len(triples),
                    "output_token_logprobs": list(triples)}
            if with_routes and obj.return_routed_experts:
                meta["routed_experts"] = self._routes(rid, tokens, obj.routed_experts_start_len)
            return {"text": "", "meta_info": meta}

        try:
            while True:
                await asyncio.sleep(0.001)
                if rid in self.aborted:
                    yield chunk({"type": "abort", "message": "aborted"}, self.routes_on_abort)
                    return
                # Decoding routes the last input token, then samples the next one.
                p = len(tokens) - 1
                self.routes_by_position[rid].append(
                    [[-1] * TOP_K if layer not in MOE_LAYERS else stand_in_route(tokens[p], p, layer, self.offset)
                     for layer in range(NUM_LAYERS)])
                token = next_token(tokens, self.offset)
                tokens.append(token)
                triples.append((-0.01 * token, token, None))
                done = len(triples) == max_new_tokens
                yield chunk({"type": "length", "length": len(triples)} if done else None, done)
                if done:
                    return
        finally:
            self.active.discard(rid)


@pytest.fixture(scope="module")
def moe_dir(tiny_model_dirs, tmp_path_factory):
    """The tiny Qwen3-MoE's files with a config of 3 layers, the first dense (sglang reads only the config)."""
    out = tmp_path_factory.mktemp("sglang-moe")
    for f in tiny_model_dirs("qwen3_moe").iterdir():
        shutil.copy(f, out / f.name)
    config = json.loads((out / "config.json").read_text())
    config.update(num_hidden_layers=NUM_LAYERS, mlp_only_layers=[0], num_experts=NUM_EXPERTS,
                  num_experts_per_tok=TOP_K)
    (out / "config.json").write_text(json.dumps(config))
    return out


def make_engine(model_dir, stand_in=None, request_type=RoutingGenerateReqInputStandIn) -> SglangEngine:
    return SglangEngine(model_dir, EngineConfig(engine="sglang", max_running=4, max_queued=2),
                        sglang_engine=stand_in or RoutingSglangStandIn(), request_type=request_type)


def test_sglang_routes_become_uint8_of_the_moe_layers():
    rows = np.array([[[-1, -1], [3, 4], [5, 6]], [[-1, -1], [7, 0], [1, 2]]], dtype="<i4")  # [2, 3 layers, 2]
    want = rows[:, 1:].astype(np.uint8)
    convert = dict(positions=2, num_hidden_layers=3, moe_layers=(1, 2), top_k=2)
    as_base64 = base64.b64encode(rows.tobytes()).decode("ascii")
    for value in (as_base64, rows.tobytes(), torch.from_numpy(rows), rows[:, 1:].copy()):
        got = sglang_routes(value, **convert)
        assert got.dtype == np.uint8 and np.array_equal(got, want)
    with pytest.raises(ValueError, match="12 ids; 4 positions"):
        sglang_routes(as_base64, **{**convert, "positions": 4})
    with pytest.raises(ValueError, match="outside"):
        sglang_routes(np.full((2, 2, 2), 300), **convert)


def test_sglang_engine_returns_routes_and_keeps_the_first_across_carry_over_and_weight_swaps(moe_dir):
    stand_in = RoutingSglangStandIn()
    engine = make_engine(moe_dir, stand_in)
    assert engine.sglang_arguments()["enable_return_routed_experts"] is True
    try:
        sampling = SamplingOptions(temperature=1.0, max_new_tokens=30, return_routed_experts=True)
        engine.add(GenerationRequest(id=k, prompt_ids=p, sampling=sampling) for k, p in PROMPTS.items())
        engine.step()
        engine.step()
        partials = {p.id: p for p in engine.drain()}
        for p in partials.values():
            tokens = [*p.prompt_ids, *p.output_ids]
            routes = np.frombuffer(p.routed_experts, dtype=np.uint8).reshape(-1, len(MOE_LAYERS), TOP_K)
            np.testing.assert_array_equal(routes, expected_routes(tokens, [0] * (len(tokens) - 1)))

        engine.update_weights({"offset": torch.tensor([5])}, version=1)
        engine.add(GenerationRequest(id=p.id, prompt_ids=p.prompt_ids, output_ids=p.output_ids,
                                     output_logprobs=p.output_logprobs, output_versions=p.output_versions,
                                     routed_experts=p.routed_experts, sampling=sampling) for p in partials.values())
        engine.step()
        # Each continuation asked only for the positions beyond those it carried.
        assert stand_in.start_lens[-3:] == [len(p.prompt_ids) + len(p.output_ids) - 1 for p in partials.values()]
        # A swap mid-generation: sglang's requests are aborted and resubmitted, routes kept.
        engine.update_weights({"offset": torch.tensor([9])}, version=2)
        results = run(engine)
        for key, p in partials.items():
            r = results[key]
            assert r.finish_reason == FinishReason.LENGTH and len(r.output_ids) == 30
            assert r.routed_experts[: len(p.routed_experts)] == p.routed_experts
            tokens = [*r.prompt_ids, *r.output_ids]
            # Position p was routed when the token after it was sampled: under that token's weights.
            offsets = [0] * (len(r.prompt_ids) - 1) + [{0: 0, 1: 5, 2: 9}[v] for v in r.output_versions]
            routes = np.frombuffer(r.routed_experts, dtype=np.uint8).reshape(-1, len(MOE_LAYERS), TOP_K)
            np.testing.assert_array_equal(routes, expected_routes(tokens, offsets))
            assert set(r.output_versions) == {0, 1, 2}
    finally:
        engine.shutdown()


def test_sglang_abort_without_routes_gives_back_only_the_routed_tokens(moe_dir):
    engine = make_engine(moe_dir, RoutingSglangStandIn(routes_on_abort=False))
    try:
        sampling = SamplingOptions(temperature=1.0, max_new_tokens=30, return_routed_experts=True)
        engine.add([GenerationRequest(id="a", prompt_ids=PROMPTS["a"], sampling=sampling)])
        engine.step()
        engine.step()
        [partial] = engine.drain()
        assert partial.finish_reason == FinishReason.ABORTED and partial.output_ids == []
        assert partial.routed_experts == b""  # a prompt never routed has no routes yet
    finally:
        engine.shutdown()


def test_sglang_engine_refuses_routes_without_the_api_and_for_a_dense_model(moe_dir, tiny_model_dir):
    asks = SamplingOptions(max_new_tokens=4, return_routed_experts=True)
    pinned = make_engine(moe_dir, SglangStandIn(), request_type=GenerateReqInputStandIn)  # sglang 0.5.3
    try:
        assert "enable_return_routed_experts" not in pinned.sglang_arguments()
        with pytest.raises(ValueError, match="return_routed_experts refused: this sglang has no routed-experts"):
            pinned.add([GenerationRequest(id="x", prompt_ids=[1, 5], sampling=asks)])
    finally:
        pinned.shutdown()
    dense = make_engine(tiny_model_dir)
    try:
        assert "enable_return_routed_experts" not in dense.sglang_arguments()
        with pytest.raises(ValueError, match="return_routed_experts refused: .*dense model"):
            dense.add([GenerationRequest(id="x", prompt_ids=[1, 5], sampling=asks)])
    finally:
        dense.shutdown()
