"""Weight-only quantization of the torch engine: what it computes, and that a weight push is quantized too."""

from __future__ import annotations

import shutil

import pytest
import torch
from rollout_reference import hf_logprobs, hf_model
from safetensors.torch import load_file, save_file

from everstep_rollout.config import EngineConfig
from everstep_rollout.engine import Engine
from everstep_rollout.sequence import GenerationRequest, SamplingOptions, SequenceResult

PROMPTS = [[1, 5, 12, 4, 13, 6], [1, 20, 21], [1, 30, 31, 32, 33]]
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def generate(engine: Engine, temperature: float = 1.0, max_new_tokens: int = 24) -> list[SequenceResult]:
    sampling = SamplingOptions(temperature=temperature, max_new_tokens=max_new_tokens, seed=7)
    engine.add([GenerationRequest(id=f"s{i}", prompt_ids=p, sampling=sampling) for i, p in enumerate(PROMPTS)])
    results: dict[str, SequenceResult] = {}
    while engine.has_work:
        results.update((r.id, r) for r in engine.step())
    return [results[f"s{i}"] for i in range(len(PROMPTS))]


def reference_fake_quant(weights: dict[str, torch.Tensor], quantization: str) -> dict[str, torch.Tensor]:
    """The documented rounding, written independently: w ~ round(w / s) * s, s = amax / qmax per row or tensor."""
    out = dict(weights)
    for name, w in weights.items():
        if not any(f".{p}.weight" in name for p in PROJECTIONS):
            continue
        if quantization == "int4":  # groups of 32 consecutive inputs of a row
            groups = w.reshape(w.shape[0], -1, 32)
            scale = groups.abs().amax(dim=2, keepdim=True) / 7.0
            out[name] = (torch.round(groups / scale).clamp(-7, 7) * scale).reshape(w.shape)
            continue
        amax = w.abs().max() if quantization == "int8-tensor" else w.abs().amax(dim=1, keepdim=True)
        if quantization == "fp8":
            scale = amax / 448.0
            out[name] = (w / scale).to(torch.float8_e4m3fn).float() * scale
        else:
            scale = amax / 127.0
            out[name] = torch.round(w / scale).clamp(-127, 127) * scale
    return out


def model_dir_with(weights: dict[str, torch.Tensor], like, out):
    shutil.copytree(like, out)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"))
    return out


@pytest.mark.parametrize("quantization", ["int8", "int8-tensor", "fp8", "int4"])
def test_quantized_logprobs_are_those_of_the_rounded_weights(quantization, tiny_model_dir, tmp_path):
    weights = load_file(str(tiny_model_dir / "model.safetensors"))
    full = hf_model(tiny_model_dir)
    rounded = hf_model(tiny_model_dir)
    rounded.load_state_dict(reference_fake_quant(weights, quantization))
    engine = Engine(tiny_model_dir, EngineConfig(max_running=4, quantization=quantization))
    assert engine.config.quantization == quantization
    diffs = []
    for prompt, r in zip(PROMPTS, generate(engine), strict=True):
        want = hf_logprobs(rounded, prompt, r.output_ids, 1.0)
        assert r.output_logprobs == pytest.approx(want, abs=1e-4)
        diffs += [abs(a - b) for a, b in zip(r.output_logprobs, hf_logprobs(full, prompt, r.output_ids, 1.0),
                                             strict=True)]
    # A real mismatch against float32, but a bounded one.
    assert 1e-4 < max(diffs) < (3.0 if quantization == "int4" else 1.0)
    assert engine.weights.num_bytes < 0.5 * Engine(tiny_model_dir, EngineConfig(max_running=4)).weights.num_bytes


def test_a_weight_push_is_quantized_on_receipt(tiny_model_dir, tmp_path):
    generator = torch.Generator().manual_seed(3)
    old = load_file(str(tiny_model_dir / "model.safetensors"))
    new = {k: v + 0.05 * torch.randn(v.shape, generator=generator) for k, v in old.items()}
    pushed = Engine(tiny_model_dir, EngineConfig(max_running=4, quantization="int8"))
    before = generate(pushed)
    pushed.update_weights(new, version=1)  # full precision, as the trainer sends them
    after = generate(pushed)
    fresh = Engine(model_dir_with(new, tiny_model_dir, tmp_path / "new"), EngineConfig(
        max_running=4, quantization="int8", version=1))
    for got, want, old_result in zip(after, generate(fresh), before, strict=True):
        assert got.output_ids == want.output_ids
        assert got.output_logprobs == pytest.approx(want.output_logprobs, abs=1e-6)
        assert got.output_versions == [1] * len(got.output_ids)
        assert got.output_logprobs != old_result.output_logprobs


def test_bad_quantization_is_refused_naming_the_field(tiny_model_dir, tiny_gpt2_dir):
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(quantization="int3")
    with pytest.raises(ValueError, match="quantization.*native executor"):
        Engine(tiny_gpt2_dir, EngineConfig(quantization="int8"))
    with pytest.raises(ValueError, match="quantization.*native executor"):
        Engine(tiny_model_dir, EngineConfig(quantization="fp8", executor="transformers"))


def test_int8_kernel_and_dequantized_matmul_agree() -> None:
    """bfloat16 with few rows takes torch's int8 kernel where it runs, more rows dequantize: same numbers."""
    from everstep.settings.quantization import Quantization
    from everstep_rollout.executor.quantization import QuantizedMatrix

    generator = torch.Generator().manual_seed(0)
    matrix = QuantizedMatrix(48, 64, quantization=Quantization.int8, dtype=torch.bfloat16, device=torch.device("cpu"))
    matrix.set_rows(0, torch.randn(48, 64, generator=generator))
    x = torch.randn(20, 64, generator=generator).to(torch.bfloat16)
    reference = x.float() @ (matrix.data.float() * matrix.scales.float()[:, None]).t()
    few, many = matrix.linear(x[:4]), matrix.linear(x)
    assert torch.allclose(few.float(), reference[:4], atol=0.1, rtol=0.02)
    assert torch.allclose(many.float(), reference, atol=0.1, rtol=0.02)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_quantized_engine_on_cuda_computes_what_the_cpu_one_does(quantization, tiny_model_dir):
    """fp8 weights stored as float8_e4m3fn on the GPU, int8 as int8: the same rounded weights as on CPU."""
    cpu = Engine(tiny_model_dir, EngineConfig(max_running=4, quantization=quantization))
    gpu = Engine(tiny_model_dir, EngineConfig(max_running=4, quantization=quantization, device="cuda"))
    for want, got in zip(generate(cpu, temperature=0.0), generate(gpu, temperature=0.0), strict=True):
        assert got.output_ids == want.output_ids
        assert got.output_logprobs == pytest.approx(want.output_logprobs, abs=1e-3)


@pytest.mark.parametrize("cols", [64, 45])
def test_int4_packs_two_values_a_byte_with_a_scale_per_group_of_32_inputs(cols: int) -> None:
    """An odd width and a last group shorter than 32 round like the others; two values are stored a byte."""
    from everstep.settings.quantization import Quantization
    from everstep_rollout.executor.quantization import QuantizedMatrix

    generator = torch.Generator().manual_seed(1)
    w = torch.randn(6, cols, generator=generator)
    w[2] = 0.0  # an all-zero row dequantizes to exact zeros
    matrix = QuantizedMatrix(10, cols, quantization=Quantization.int4, dtype=torch.float32, device=torch.device("cpu"))
    matrix.set_rows(3, w)
    assert matrix.data.dtype == torch.uint8 and matrix.data.shape == (10, (cols + 1) // 2)
    assert matrix.scales.shape == (10, -(-cols // 32))
    want = torch.empty_like(w)
    for first in range(0, cols, 32):
        group = w[:, first:first + 32]
        scale = (group.abs().amax(dim=1, keepdim=True) / 7.0).clamp(min=1e-12)
        want[:, first:first + 32] = torch.round(group / scale).clamp(-7, 7) * scale
    got = matrix.dequantized()[3:9]
    assert torch.allclose(got, want, atol=1e-6, rtol=0)
    assert torch.equal(got[2], torch.zeros(cols))
    assert 0 < float((got - w).abs().max()) <= float(w.abs().max()) / 14 + 1e-6  # half a step of the coarsest group
    x = torch.randn(5, cols, generator=generator)
    assert torch.allclose(matrix.linear(x)[:, 3:9], x @ want.t(), atol=1e-4)
