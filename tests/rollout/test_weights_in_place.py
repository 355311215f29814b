"""The engine side of the one-copy shm push: `update_weights(may_keep=True)` runs on the pushed memory itself.

The pushed memory here is one flat buffer holding the tensors one after another, as the trainer's segment does;
the engine must then generate as a Hugging Face model holding those weights, with its weights inside the buffer,
and leave the buffer (own memory again) at the next copying update.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from rollout_reference import hf_greedy, hf_model
from safetensors.torch import load_file
from test_engine import PROMPTS

from everstep_rollout.config import EngineConfig
from everstep_rollout.engine import Engine
from everstep_rollout.sequence import GenerationRequest, SamplingOptions

SAMPLING = SamplingOptions(temperature=0.0, max_new_tokens=12)


def perturbed(model_dir: Path, seed: int) -> dict[str, torch.Tensor]:
    """The model's weights plus noise, in the order of its state dict (q, k, v one after another)."""
    generator = torch.Generator().manual_seed(seed)
    weights = load_file(str(model_dir / "model.safetensors"))
    order = [n for n in hf_model(model_dir).state_dict() if n in weights]
    return {n: weights[n] + 0.05 * torch.randn(weights[n].shape, generator=generator) for n in order}


def flat(weights: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One uint8 buffer with the tensors at 64-byte aligned offsets, and the tensors as views into it."""
    sizes = [-(-t.nbytes // 64) * 64 for t in weights.values()]
    buffer = torch.zeros(sum(sizes), dtype=torch.uint8)
    views, offset = {}, 0
    for (name, t), size in zip(weights.items(), sizes, strict=True):
        view = buffer[offset : offset + t.nbytes].view(t.dtype).view(t.shape)
        view.copy_(t)
        views[name] = view
        offset += size
    return buffer, views


def inside(tensor: torch.Tensor, buffer: torch.Tensor) -> bool:
    return buffer.data_ptr() <= tensor.data_ptr() < buffer.data_ptr() + buffer.numel()


def greedy(engine: Engine, key: str) -> list[list[int]]:
    engine.add([GenerationRequest(id=f"{key}{i}", prompt_ids=p, sampling=SAMPLING) for i, p in enumerate(PROMPTS)])
    results = {}
    while engine.has_work:
        results.update({r.id: r for r in engine.step()})
    return [results[f"{key}{i}"].output_ids for i in range(len(PROMPTS))]


def expected(model_dir: Path, weights: dict[str, torch.Tensor]) -> list[list[int]]:
    model = hf_model(model_dir)
    model.load_state_dict(weights, strict=False)
    return [hf_greedy(model, p, SAMPLING.max_new_tokens) for p in PROMPTS]


@pytest.mark.parametrize("kind", ["native", "transformers"])
def test_the_engine_runs_on_pushed_memory_over_several_pushes_and_leaves_it_for_a_copy(kind, tiny_model_dir,
                                                                                       tiny_gpt2_dir):
    model_dir = tiny_model_dir if kind == "native" else tiny_gpt2_dir  # GPT-2: tied head, transformers executor
    engine = Engine(model_dir, EngineConfig(max_running=8))
    for version, seed in ((1, 11), (2, 12), (3, 13)):
        weights = perturbed(model_dir, seed)
        buffer, views = flat(weights)
        assert engine.update_weights(views, version=version, may_keep=True) == 0  # nothing copied
        assert engine.weights.kept_in_place
        assert all(inside(t, buffer) for t in engine.weights.named.values() if isinstance(t, torch.Tensor))
        assert greedy(engine, f"v{version}-") == expected(model_dir, weights)

    # It is the buffer the engine reads: scribbling on it changes what it computes.
    kept = buffer.clone()
    buffer.zero_()
    assert greedy(engine, "zeroed-") != expected(model_dir, weights)
    buffer.copy_(kept)

    # A copying update takes the weights back into the engine's own memory, even those it does not name.
    partial = {n: t for n, t in perturbed(model_dir, 14).items() if ".0." in n}
    assert engine.update_weights(partial, version=4) > 0
    assert not engine.weights.kept_in_place
    assert not any(inside(t, buffer) for t in engine.weights.named.values() if isinstance(t, torch.Tensor))
    buffer.zero_()
    assert greedy(engine, "copied-") == expected(model_dir, {**weights, **partial})


def test_what_does_not_lie_as_the_engine_holds_it_is_copied(tiny_model_dir):
    engine = Engine(tiny_model_dir, EngineConfig(max_running=8))
    weights = perturbed(tiny_model_dir, 21)
    total = sum(t.nbytes for t in weights.values())

    apart = dict(sorted(weights.items()))  # the file's order: q, k, v apart, so the fused qkv is copied
    buffer, views = flat(apart)
    copied = engine.update_weights(views, version=1, may_keep=True)
    assert 0 < copied < total
    qkv = engine.weights.layers[0].qkv
    assert not inside(qkv, buffer) and inside(engine.weights.named["model.norm.weight"], buffer)
    assert greedy(engine, "apart-") == expected(tiny_model_dir, weights)

    halves = {n: t.to(torch.bfloat16) for n, t in perturbed(tiny_model_dir, 22).items()}
    buffer, views = flat(halves)  # another dtype: nothing can be kept
    assert engine.update_weights(views, version=2, may_keep=True) == total // 2
    assert not engine.weights.kept_in_place
    buffer.zero_()
    assert greedy(engine, "bf16-") == expected(tiny_model_dir, {n: t.float() for n, t in halves.items()})


@pytest.mark.parametrize("kind", ["native", "transformers"])
def test_the_store_layout_is_what_a_scan_of_every_name_finds_and_outlives_pushes(kind, tiny_model_dir, tiny_gpt2_dir):
    """`rebind.StoreLayout` (worked out once per store, in one pass) places every named tensor in the held tensor
    whose memory it lies in, at its byte offset, as a scan of every name against every held tensor does; the store
    keeps it from push to push, and it still holds after the weights moved into pushed memory and back."""
    from everstep_rollout.executor import rebind

    model_dir = tiny_model_dir if kind == "native" else tiny_gpt2_dir
    engine = Engine(model_dir, EngineConfig(max_running=8))
    store = engine.weights
    layout = store._layout()

    def scan() -> dict[str, tuple[int, int]]:
        """name -> (index of the held tensor it lies in, byte offset within it), by brute force."""
        found = {}
        for index, entry in enumerate(layout.entries):
            h = entry.held
            if not isinstance(h, torch.Tensor):
                continue
            start = h.storage_offset() * h.element_size()
            for name, t in store.named.items():
                if (isinstance(t, torch.Tensor) and t.nbytes and t.untyped_storage().data_ptr() ==
                        h.untyped_storage().data_ptr()):
                    offset = t.storage_offset() * t.element_size()
                    if start <= offset and offset + t.nbytes <= start + h.nbytes:
                        found[name] = (index, offset - start)
        return found

    def placed() -> dict[str, tuple[int, int]]:
        return {name: (layout.names[name], offset) for entry in layout.entries for _, offset, names in entry.views
                for name in names}

    expected = scan()
    assert placed() == expected and len(expected) == len([t for t in store.named.values() if t.nbytes])
    for version, seed in ((1, 31), (2, 32)):
        _, views = flat(perturbed(model_dir, seed))
        assert engine.update_weights(views, version=version, may_keep=True) == 0
        assert store._layout() is layout and scan() == expected  # kept, and still true in pushed memory
    engine.update_weights(perturbed(model_dir, 33), version=3)  # back into memory of its own
    assert store._layout() is layout and scan() == expected
    assert isinstance(layout, rebind.StoreLayout)
