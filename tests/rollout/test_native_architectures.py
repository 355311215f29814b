"""The native executor on Llama 3.1 rope scaling, Qwen3 and Qwen3-MoE, against transformers' own modeling code.

Every model is a tiny random one built by transformers (`tiny_model_dirs`); the references are full float32
Hugging Face forward passes without a cache (`rollout_reference`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from rollout_reference import hf_greedy, hf_logprobs, hf_model
from safetensors.torch import load_file, save_file
from test_quantization import reference_fake_quant

from everstep_rollout.config import EngineConfig
from everstep_rollout.engine import Engine
from everstep_rollout.executor import ExecutorOptions, ForwardBatch, build_executor
from everstep_rollout.executor.models import ARCHITECTURES as ARCHITECTURE_CLASSES
from everstep_rollout.executor.models import LlamaExecutor, spec_from_config
from everstep_rollout.executor.transformers_executor import TransformersExecutor
from everstep_rollout.model_files import read_config
from everstep_rollout.sequence import FinishReason, GenerationRequest, SamplingOptions, SequenceResult

ARCHITECTURES = ["llama3", "qwen3", "qwen3_moe"]
# Different lengths, more prompts than slots: sequences join the batch while others decode.
PROMPTS = [[1, 5, 12, 4, 13, 6], [1, 20], [1, 30, 31, 32, 33, 34, 35, 36, 37, 7, 8], [1, 9, 10], [1, 40, 41, 42]]
FLOAT32_ATOL = 1e-4  # measured: at most ~5e-7 on these models


def run(engine: Engine, prompts: list[list[int]], sampling: SamplingOptions, prefix: str = "s") -> list[SequenceResult]:
    engine.add([GenerationRequest(id=f"{prefix}{i}", prompt_ids=p, sampling=sampling) for i, p in enumerate(prompts)])
    results: dict[str, SequenceResult] = {}
    while engine.has_work:
        for r in engine.step():
            results[r.id] = r
    return [results[f"{prefix}{i}"] for i in range(len(prompts))]


def assert_logprobs_equal_hf(results: list[SequenceResult], model, prompts, temperature: float) -> None:
    for prompt, r in zip(prompts, results, strict=True):
        assert r.output_ids and r.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
        # Teacher forcing: one forward of prompt + continuation, every continuation token's log-prob.
        assert r.output_logprobs == pytest.approx(hf_logprobs(model, prompt, r.output_ids, temperature),
                                                  abs=FLOAT32_ATOL)


def perturbed(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=generator) for k, v in state.items()}


def native_executor(model_dir: Path, num_slots: int = 4, **kw) -> LlamaExecutor:
    executor = build_executor(model_dir, read_config(model_dir), "native", ExecutorOptions(
        num_slots=num_slots, max_seq_len=64, dtype=torch.float32, device=torch.device("cpu"), **kw))
    assert isinstance(executor, LlamaExecutor)
    return executor


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_native_logprobs_and_greedy_match_transformers(arch, temperature, tiny_model_dirs):
    model_dir = tiny_model_dirs(arch)
    engine = Engine(model_dir, EngineConfig(max_running=3, seed=5))  # auto picks native
    assert isinstance(engine.executor, LlamaExecutor) and engine.executor.model_type == read_config(
        model_dir)["model_type"]
    sampling = SamplingOptions(temperature=temperature, top_k=20 if temperature else 0, max_new_tokens=20)
    results = run(engine, PROMPTS, sampling)
    model = hf_model(model_dir)
    assert_logprobs_equal_hf(results, model, PROMPTS, temperature)
    if temperature == 0:
        for prompt, r in zip(PROMPTS, results, strict=True):
            assert r.output_ids == hf_greedy(model, prompt, len(r.output_ids))


def test_llama3_rope_scaling_is_used(tiny_model_dirs, tmp_path):
    """The llama3 tiny model's scaling changes its outputs (original_max_position_embeddings 64 < the 512
    positions): a native executor ignoring it would compute the default-RoPE model."""
    model_dir = tiny_model_dirs("llama3")
    spec = spec_from_config(read_config(model_dir))
    assert spec.rope_llama3 is not None and spec.rope_llama3.factor == 8.0
    plain = tmp_path / "default-rope"
    shutil.copytree(model_dir, plain)
    config = read_config(plain)
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": config["rope_parameters"]["rope_theta"]}
    (plain / "config.json").write_text(json.dumps(config))
    sampling = SamplingOptions(temperature=1.0, max_new_tokens=12, seed=1)
    scaled = run(Engine(model_dir, EngineConfig(max_running=4)), PROMPTS, sampling)
    unscaled = run(Engine(plain, EngineConfig(max_running=4)), PROMPTS, sampling)
    assert [r.output_logprobs for r in scaled] != [r.output_logprobs for r in unscaled]


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_weight_push_in_place_matches_transformers_with_the_new_weights(arch, tiny_model_dirs):
    model_dir = tiny_model_dirs(arch)
    new_model = hf_model(model_dir)
    # What a trainer pushes: its state dict's names (transformers 5 fuses a layer's experts into 3-D tensors).
    new_state = perturbed(dict(new_model.state_dict()), seed=11)
    new_model.load_state_dict(new_state)
    engine = Engine(model_dir, EngineConfig(max_running=3, version=0))
    storage = {name: engine.weights.named[name].data_ptr() for name in new_state}
    sampling = SamplingOptions(temperature=0.0, max_new_tokens=16)
    engine.add([GenerationRequest(id="inflight", prompt_ids=PROMPTS[0], sampling=sampling)])
    for _ in range(3):
        engine.step()
    engine.update_weights(new_state, version=1)
    assert {name: engine.weights.named[name].data_ptr() for name in new_state} == storage  # copied in place
    results = run(engine, PROMPTS[1:], sampling, prefix="new")
    assert_logprobs_equal_hf(results, new_model, PROMPTS[1:], 0.0)
    for prompt, r in zip(PROMPTS[1:], results, strict=True):
        assert r.output_ids == hf_greedy(new_model, prompt, len(r.output_ids))
        assert r.output_versions == [1] * len(r.output_ids)


def test_moe_push_under_per_expert_names_equals_the_fused_one(tiny_model_dirs):
    """Checkpoint spelling (`mlp.experts.E.gate_proj.weight`, ...) and state-dict spelling
    (`mlp.experts.gate_up_proj` [E, 2I, H]) land in the same storage."""
    model_dir = tiny_model_dirs("qwen3_moe")
    model = hf_model(model_dir)
    fused = perturbed(dict(model.state_dict()), seed=4)
    per_expert = {}
    for name, t in fused.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix = name.removesuffix("gate_up_proj")
            for e, w in enumerate(t):
                gate, up = w.chunk(2)
                per_expert[f"{prefix}{e}.gate_proj.weight"], per_expert[f"{prefix}{e}.up_proj.weight"] = gate, up
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name.removesuffix("down_proj")
            for e, w in enumerate(t):
                per_expert[f"{prefix}{e}.down_proj.weight"] = w
        else:
            per_expert[name] = t
    a, b = native_executor(model_dir), native_executor(model_dir)
    a.weights.copy_in(fused, require_all=True)
    b.weights.copy_in(per_expert, require_all=True)
    for name in fused:
        assert torch.equal(a.weights.named[name], b.weights.named[name]), name
    with pytest.raises(ValueError, match="missing parameters"):
        a.weights.copy_in({k: v for k, v in per_expert.items() if ".experts.3.up_proj" not in k}, require_all=True)


def _full_prompt_routing(executor: LlamaExecutor, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Each prompt prefilled (all but its last token) and decoded (the last) in one forward pass, as the engine
    does; the recorded experts of each prompt's tokens [len, moe layers, top_k]."""
    batch = ForwardBatch(decode_tokens=[p[-1] for p in prompts], decode_positions=[len(p) - 1 for p in prompts],
                         prefill_rows=[p[:-1] for p in prompts], prefill_slots=list(range(len(prompts))))
    executor.forward(batch)
    routing = executor.expert_routing
    assert routing is not None and routing.expert_ids.dtype == torch.uint8
    assert routing.expert_ids.shape[0] == sum(map(len, prompts))
    return [torch.cat((routing.prefill(j), routing.decode()[j : j + 1])) for j in range(len(prompts))]


@torch.inference_mode()
def test_moe_routing_is_recorded_and_equals_transformers_router_top_k(tiny_model_dirs):
    model_dir = tiny_model_dirs("qwen3_moe")
    executor = native_executor(model_dir, num_slots=len(PROMPTS))
    spec = executor.spec
    assert spec.moe is not None and spec.moe.layers == (0, 1) and spec.moe.top_k == 2
    batched = _full_prompt_routing(executor, PROMPTS)
    model = hf_model(model_dir)
    chosen: dict[int, torch.Tensor] = {}
    for i, layer in enumerate(model.model.layers):
        layer.mlp.gate.register_forward_hook(lambda _m, _inp, out, i=i: chosen.__setitem__(i, out[2]))
    used = set()
    for prompt, got in zip(PROMPTS, batched, strict=True):
        alone = _full_prompt_routing(native_executor(model_dir, num_slots=1), [prompt])[0]
        assert torch.equal(got, alone)  # a row's routing does not depend on what it is batched with
        model(torch.tensor([prompt]))
        want = torch.stack([chosen[m] for m in spec.moe.layers], dim=1)  # [len, moe layers, top_k]
        assert torch.equal(got.long(), want)
        used.update(want.flatten().tolist())
    assert len(used) > 4  # the test routes to many experts, not one

    # Decode steps record their token's experts too (and a dense model records none).
    executor.forward(ForwardBatch(decode_tokens=[7] * len(PROMPTS), decode_positions=[len(p) for p in PROMPTS]))
    assert executor.expert_routing is not None and executor.expert_routing.decode().shape == (len(PROMPTS), 2, 2)
    dense = native_executor(tiny_model_dirs("qwen3"))
    dense.forward(ForwardBatch(decode_tokens=[5], decode_positions=[0]))
    assert dense.expert_routing is None


def test_moe_dense_layers_of_mlp_only_layers_and_sparse_step(tiny_model_dirs, tmp_path):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    base = tiny_model_dirs("qwen3_moe")
    out = tmp_path / "mixed"
    shutil.copytree(base, out)
    config = Qwen3MoeConfig.from_pretrained(base)
    config.num_hidden_layers, config.mlp_only_layers, config.decoder_sparse_step = 4, [1], 1  # sparse: 0, 2, 3
    torch.manual_seed(6)
    Qwen3MoeForCausalLM(config).save_pretrained(out)
    spec = spec_from_config(read_config(out))
    assert spec.moe is not None and spec.moe.layers == (0, 2, 3)
    engine = Engine(out, EngineConfig(max_running=3))
    assert isinstance(engine.executor, LlamaExecutor)
    results = run(engine, PROMPTS, SamplingOptions(temperature=1.0, max_new_tokens=12, seed=2))
    assert_logprobs_equal_hf(results, hf_model(out), PROMPTS, 1.0)


@pytest.mark.parametrize("quantization", ["int8", "int8-tensor", "fp8", "int4"])
def test_quantized_moe_is_the_model_with_rounded_expert_weights(quantization, tiny_model_dirs, tmp_path):
    model_dir = tiny_model_dirs("qwen3_moe")
    weights = load_file(str(model_dir / "model.safetensors"))  # per-expert names: each expert rounded alone
    # transformers fuses the per-expert checkpoint tensors on load.
    rounded_dir = tmp_path / "rounded"
    shutil.copytree(model_dir, rounded_dir)
    save_file({k: v.contiguous() for k, v in reference_fake_quant(weights, quantization).items()},
              str(rounded_dir / "model.safetensors"))
    engine = Engine(model_dir, EngineConfig(max_running=3, quantization=quantization))
    full = Engine(model_dir, EngineConfig(max_running=3))
    assert engine.weights.num_bytes < 0.5 * full.weights.num_bytes
    results = run(engine, PROMPTS, SamplingOptions(temperature=1.0, max_new_tokens=16, seed=3))
    assert_logprobs_equal_hf(results, hf_model(rounded_dir), PROMPTS, 1.0)
    # A real difference from the full-precision model.
    unrounded = [hf_logprobs(hf_model(model_dir), p, r.output_ids, 1.0) for p, r in zip(PROMPTS, results, strict=True)]
    assert max(abs(a - b) for r, u in zip(results, unrounded, strict=True)
               for a, b in zip(r.output_logprobs, u, strict=True)) > 1e-4


def test_quantized_moe_weight_push_is_requantized(tiny_model_dirs, tmp_path):
    model_dir = tiny_model_dirs("qwen3_moe")
    new_fused = perturbed(dict(hf_model(model_dir).state_dict()), seed=8)
    pushed = Engine(model_dir, EngineConfig(max_running=3, quantization="int8-tensor"))
    sampling = SamplingOptions(temperature=1.0, max_new_tokens=16, seed=4)
    before = run(pushed, PROMPTS, sampling, prefix="a")
    pushed.update_weights(new_fused, version=1)  # fused expert tensors, full precision, as a trainer sends them
    after = run(pushed, PROMPTS, sampling, prefix="b")
    # A fresh load of the same weights from a checkpoint (per-expert names) quantizes them identically.
    fresh_dir = tmp_path / "new"
    shutil.copytree(model_dir, fresh_dir)
    model = hf_model(model_dir)
    model.load_state_dict(new_fused)
    model.save_pretrained(fresh_dir)
    assert any(".experts.0.gate_proj.weight" in k for k in load_file(str(fresh_dir / "model.safetensors")))
    fresh = run(Engine(fresh_dir, EngineConfig(max_running=3, quantization="int8-tensor", version=1)), PROMPTS,
                sampling, prefix="b")
    for got, want, old in zip(after, fresh, before, strict=True):
        assert got.output_ids == want.output_ids
        assert got.output_logprobs == pytest.approx(want.output_logprobs, abs=1e-6)
        assert got.output_logprobs != old.output_logprobs


@pytest.mark.parametrize(("patch", "message"), [
    ({"shared_expert_intermediate_size": 32}, "shared experts"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}}, "rope type 'dynamic'"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"use_sliding_window": True, "sliding_window": 8}, "sliding-window"),
])
def test_native_refuses_what_it_does_not_cover_naming_it(patch, message, tiny_model_dirs):
    config = {**read_config(tiny_model_dirs("qwen3_moe")), **patch}
    with pytest.raises(NotImplementedError, match=message):
        spec_from_config(config)


def test_each_registered_architecture_reads_its_config_and_an_unknown_one_is_refused_naming_both(tiny_model_dirs):
    assert set(ARCHITECTURE_CLASSES) == {"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                                         "Qwen3MoeForCausalLM"}
    config = read_config(tiny_model_dirs("qwen3_moe"))
    assert config["architectures"] == ["Qwen3MoeForCausalLM"]
    spec = spec_from_config(config)
    assert spec.qk_norm and spec.moe is not None and spec.tie_word_embeddings == config["tie_word_embeddings"]
    for asked in (["MistralForCausalLM"], ["GPT2LMHeadModel", "MistralForCausalLM"]):
        known = "LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM"
        with pytest.raises(ValueError, match=rf"architecture '{asked[0]}'.* not one the native executor runs; it runs "
                                             rf"{known}$"):
            spec_from_config({**config, "architectures": asked})
    unnamed = {k: v for k, v in config.items() if k != "architectures"}  # a hand-written config: its model_type
    assert spec_from_config(unnamed) == spec
    with pytest.raises(ValueError, match="has no `architectures`, and model_type 'gpt2'"):
        spec_from_config({**unnamed, "model_type": "gpt2"})
    # the first registered one of several is taken
    assert spec_from_config({**config, "architectures": ["Foo", "Qwen3MoeForCausalLM"]}) == spec


def test_auto_falls_back_to_transformers_for_other_rope_types(tiny_model_dirs, tmp_path):
    model_dir = tmp_path / "linear-rope"
    shutil.copytree(tiny_model_dirs("qwen3"), model_dir)
    config = read_config(model_dir)
    config["rope_parameters"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    (model_dir / "config.json").write_text(json.dumps(config))
    engine = Engine(model_dir, EngineConfig(max_running=2))
    assert isinstance(engine.executor, TransformersExecutor) and engine.executor_name == "transformers"
    with pytest.raises(NotImplementedError, match="rope type 'linear'"):
        Engine(model_dir, EngineConfig(executor="native"))
