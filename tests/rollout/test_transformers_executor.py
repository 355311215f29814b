"""The torch engine on models our native executor does not know (GPT-2, GPT-NeoX): transformers' modeling
code over our per-slot KV cache, checked against full Hugging Face forward passes of the same weights."""

from __future__ import annotations

import pytest
import torch
from rollout_reference import assert_matches_hf, hf_greedy, hf_model
from safetensors.torch import load_file
from test_engine import PROMPTS, requests, run

from everstep_rollout.config import EngineConfig
from everstep_rollout.engine import Engine
from everstep_rollout.executor.transformers_executor import TransformersExecutor
from everstep_rollout.sequence import GenerationRequest, SamplingOptions


@pytest.fixture(params=["gpt2", "neox"])
def foreign_model_dir(request, tiny_gpt2_dir, tiny_neox_dir):
    return {"gpt2": tiny_gpt2_dir, "neox": tiny_neox_dir}[request.param]


def test_logprobs_and_greedy_tokens_match_hf_forward(foreign_model_dir):
    model = hf_model(foreign_model_dir)
    for temperature in (0.0, 0.8):
        # Fewer slots than prompts: sequences join the running batch while others decode.
        engine = Engine(foreign_model_dir, EngineConfig(max_running=3, seed=4))
        assert isinstance(engine.executor, TransformersExecutor)
        engine.add(requests(SamplingOptions(temperature=temperature, top_p=0.9 if temperature else 1.0,
                                            max_new_tokens=20)))
        assert_matches_hf(run(engine), model, PROMPTS, temperature)


def test_drained_continued_and_updated_in_place(tiny_gpt2_dir):
    sampling = SamplingOptions(temperature=0.0, max_new_tokens=16)
    reference = Engine(tiny_gpt2_dir, EngineConfig(max_running=8))
    reference.add(requests(sampling))
    expected = run(reference)

    engine = Engine(tiny_gpt2_dir, EngineConfig(max_running=8))
    engine.add(requests(sampling))
    for _ in range(5):
        engine.step()
    partials = engine.drain()
    assert {len(p.output_ids) for p in partials} == {5}
    engine.add(GenerationRequest(id=p.id, prompt_ids=p.prompt_ids, output_ids=p.output_ids,
                                 output_logprobs=p.output_logprobs, output_versions=p.output_versions,
                                 sampling=sampling) for p in partials)
    continued = run(engine)
    for key, want in expected.items():
        assert continued[key].output_ids == want.output_ids
        assert continued[key].output_logprobs == pytest.approx(want.output_logprobs, abs=1e-5)

    # In-place update mid-generation (the lm_head is tied: either name reaches the same storage).
    generator = torch.Generator().manual_seed(5)
    new_weights = {k: v + 0.05 * torch.randn(v.shape, generator=generator)
                   for k, v in load_file(str(tiny_gpt2_dir / "model.safetensors")).items()}
    new_model = hf_model(tiny_gpt2_dir)
    new_model.load_state_dict(new_weights, strict=False)
    storage = engine.weights.named["transformer.h.0.attn.c_attn.weight"].data_ptr()
    engine.add([GenerationRequest(id="inflight", prompt_ids=PROMPTS[0], sampling=sampling)])
    for _ in range(3):
        engine.step()
    engine.update_weights(new_weights, version=1)
    assert engine.weights.named["transformer.h.0.attn.c_attn.weight"].data_ptr() == storage
    inflight = run(engine)["inflight"]
    assert inflight.output_versions == [0] * 3 + [1] * (len(inflight.output_ids) - 3)
    head = inflight.output_ids[:3]
    assert inflight.output_ids[3:] == hf_greedy(new_model, PROMPTS[0] + head, len(inflight.output_ids) - 3)
    with pytest.raises(ValueError, match="unknown parameter names"):
        engine.update_weights({"transformer.h.9.nothing": torch.zeros(1)}, version=2)


def test_transformers_executor_on_llama_equals_native(tiny_model_dir):
    sampling = SamplingOptions(temperature=0.0, max_new_tokens=12)
    results = []
    for executor in ("native", "transformers"):
        engine = Engine(tiny_model_dir, EngineConfig(max_running=4, executor=executor))
        engine.add(requests(sampling))
        results.append(run(engine))
    for key, native in results[0].items():
        assert results[1][key].output_ids == native.output_ids
        assert results[1][key].output_logprobs == pytest.approx(native.output_logprobs, abs=1e-4)


def test_gpt2_s_position_limit_is_read_from_n_positions_and_never_exceeded(tiny_gpt2_dir) -> None:
    """GPT-2 states its limit as n_positions (256 here): the default takes it, a longer request is refused."""
    engine = Engine(tiny_gpt2_dir, EngineConfig(max_running=2))
    assert (engine.max_seq_len, engine.position_limit, engine.executor_name) == (256, 256, "transformers")
    with pytest.raises(ValueError, match=r"max_seq_len \(257\) exceeds the model's max_position_embeddings \(256\)"):
        Engine(tiny_gpt2_dir, EngineConfig(max_running=2, max_seq_len=257))
