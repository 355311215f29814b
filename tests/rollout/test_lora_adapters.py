"""LoRA adapter updates on the engine (`AdapterMerger`): over many versions, each one is rebuilt from the kept
base, so the engine's weights equal a fresh merge bit for bit (no drift from subtracting old deltas) and its
log-probs equal peft's merged model; a module the next adapter leaves out returns to its base; malformed
updates are refused naming the tensor."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from everstep_rollout.config import EngineConfig
from everstep_rollout.engine.torch_engine import Engine
from everstep_rollout.sequence import GenerationRequest, SamplingOptions
from everstep_rollout.weights import AdapterMerger

RANK, ALPHA = 4, 8.0
MODULES = [f"model.layers.{i}.{m}" for i in range(2) for m in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")]


def _random_adapter(base: dict[str, torch.Tensor], seed: int, modules: list[str]) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for module in modules:
        out_features, in_features = base[f"{module}.weight"].shape
        tensors[f"{module}.lora_A"] = 0.3 * torch.randn(RANK, in_features, generator=generator)
        tensors[f"{module}.lora_B"] = 0.3 * torch.randn(out_features, RANK, generator=generator)
    return tensors


def _peft_merged(model_dir: Path, adapter: dict[str, torch.Tensor], modules: list[str]) -> torch.nn.Module:
    """peft's own merge of `adapter` into a fresh copy of the model."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    targets = sorted({m.rsplit(".", 1)[-1] for m in modules})
    peft_model = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=targets))
    state = {}
    for name, tensor in adapter.items():
        module, part = name.rsplit(".", 1)
        state[f"base_model.model.{module}.{part}.default.weight"] = tensor
    missing = {n for n in peft_model.state_dict() if ".lora_" in n} - set(state)
    for name in missing:  # modules this version leaves out: B = 0, no change
        state[name] = torch.zeros_like(peft_model.state_dict()[name])
    peft_model.load_state_dict(state, strict=False)
    return peft_model.merge_and_unload().eval()


def _engine_logprobs(engine: Engine, prompts: list[list[int]]) -> list[tuple[list[int], list[int], list[float]]]:
    engine.add([GenerationRequest(id=f"p{i}", prompt_ids=p, sampling=SamplingOptions(temperature=0.0,
                                                                                    max_new_tokens=6))
                for i, p in enumerate(prompts)])
    done = []
    while engine.has_work:
        done += engine.step()
    return [(list(r.prompt_ids), list(r.output_ids), list(r.output_logprobs)) for r in sorted(done, key=lambda r: r.id)]


@torch.inference_mode()
def _assert_matches(engine: Engine, reference: torch.nn.Module) -> None:
    for prompt, output, logprobs in _engine_logprobs(engine, [[1, 5, 4, 7, 6], [1, 20, 5, 30, 6]]):
        ids = torch.tensor([prompt + output])
        logits = reference(ids).logits[0, len(prompt) - 1 : -1]
        expected = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(output)[:, None]).squeeze(1)
        torch.testing.assert_close(torch.tensor(logprobs), expected, atol=2e-4, rtol=0)


def test_many_adapter_versions_each_equal_a_fresh_merge(tiny_model_dir: Path) -> None:
    base = load_file(str(tiny_model_dir / "model.safetensors"))
    engine = Engine(tiny_model_dir, EngineConfig(max_running=4))
    merger = AdapterMerger(tiny_model_dir)
    lora = {"rank": RANK, "alpha": ALPHA}
    base_logprobs = _engine_logprobs(engine, [[1, 5, 4, 7, 6]])[0][2]
    for version in range(1, 41):
        modules = MODULES if version % 7 else MODULES[:2]  # now and then a version adapts fewer modules
        adapter = _random_adapter(base, seed=version, modules=modules)
        engine.update_weights(merger.merged(adapter, **lora), version)
        for module in MODULES:
            weight = engine.weights.named[f"{module}.weight"]
            expected = base[f"{module}.weight"]
            if module in modules:  # one fresh merge, computed as the engine does: equal to the bit
                expected = torch.addmm(expected, adapter[f"{module}.lora_B"], adapter[f"{module}.lora_A"],
                                       alpha=ALPHA / RANK)
            assert torch.equal(weight, expected), (version, module)
        if version in (1, 7, 40):
            _assert_matches(engine, _peft_merged(tiny_model_dir, adapter, modules))
    assert _engine_logprobs(engine, [[1, 5, 4, 7, 6]])[0][2] != base_logprobs  # the adapters did change the model


def test_a_full_push_becomes_the_base_of_later_adapters(tiny_model_dir: Path) -> None:
    base = load_file(str(tiny_model_dir / "model.safetensors"))
    merger = AdapterMerger(tiny_model_dir)
    lora = {"rank": RANK, "alpha": ALPHA}
    adapter = _random_adapter(base, seed=1, modules=MODULES[:1])
    merger.merged(adapter, **lora)
    name = f"{MODULES[0]}.weight"
    new_base = base[name] + 1.0
    merger.full_update({name: new_base})
    merged = merger.merged(adapter, **lora)[name]
    a, b = adapter[f"{MODULES[0]}.lora_A"], adapter[f"{MODULES[0]}.lora_B"]
    torch.testing.assert_close(merged, new_base + 2.0 * b @ a)
    merger.full_update({f"{MODULES[1]}.weight": base[f"{MODULES[1]}.weight"]})
    with pytest.raises(ValueError, match="replaced by a full-weight push"):
        merger.merged(_random_adapter(base, seed=2, modules=MODULES[1:2]), **lora)


def test_malformed_adapter_updates_are_refused_naming_the_tensor(tiny_model_dir: Path) -> None:
    base = load_file(str(tiny_model_dir / "model.safetensors"))
    merger = AdapterMerger(tiny_model_dir)
    lora = {"rank": RANK, "alpha": ALPHA}
    adapter = _random_adapter(base, seed=1, modules=MODULES[:1])
    with pytest.raises(ValueError, match=r"q_proj\.lora_B: missing"):
        merger.merged({k: v for k, v in adapter.items() if k.endswith("lora_A")}, **lora)
    with pytest.raises(ValueError, match="do not have rank 8"):
        merger.merged(adapter, rank=8, alpha=ALPHA)
    with pytest.raises(ValueError, match="only '<module>.lora_A'"):
        merger.merged({**adapter, "model.norm.weight": base["model.norm.weight"]}, **lora)
    with pytest.raises(ValueError, match="base weights not in"):
        merger.merged({"model.layers.9.x.lora_A": torch.zeros(RANK, 3),
                       "model.layers.9.x.lora_B": torch.zeros(3, RANK)}, **lora)
