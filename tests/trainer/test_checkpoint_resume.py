"""Checkpoints: a Hugging Face directory plus optimizer, RNG, step, version and data position; an
exact resume on one rank. For a dense model (Llama) and a mixture-of-experts one (Qwen3-MoE, whose expert
weights are 3-D parameters in memory and per-expert tensors on disk)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from distributed_check import check_batches

from everstep.settings.training import TrainerConfig
from everstep_trainer.model.checkpoint import CHECKPOINT_META_FILE
from everstep_trainer.step.trainer import PolicyTrainer

# Minibatches (the shuffle generator), a schedule (the step counter), weight decay and a KL
# reference (which must stay the initial model after a resume) all influence the next step.
CONFIG = TrainerConfig(learning_rate=1e-3, num_minibatches=2, warmup_steps=1, total_steps=6, weight_decay=0.01,
                       kl_coef=0.05, micro_batch_tokens=24)


def _weights(trainer: PolicyTrainer) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in trainer.full_state_dict().items()}


ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


@pytest.mark.parametrize("architecture", list(ARCHITECTURES))
def test_resume_continues_exactly_like_an_uninterrupted_run(tiny_model_dirs, tmp_path: Path,
                                                            architecture: str) -> None:
    tiny_model_dir = tiny_model_dirs(architecture)
    batches = check_batches(51, num_steps=3)
    straight = PolicyTrainer(tiny_model_dir, CONFIG)
    straight_stats = [straight.train_step(batch)[1] for batch in batches]

    first = PolicyTrainer(tiny_model_dir, CONFIG)
    first.train_step(batches[0])
    path = first.save_checkpoint(tmp_path / "step-1", data_position='{"prompt_cursor": 12}')
    del first
    torch.manual_seed(1234)  # the resume must restore the RNG streams, not rely on fresh seeding

    resumed, meta = PolicyTrainer.resume(path)
    assert (meta.train_step, meta.version, meta.data_position) == (1, 1, '{"prompt_cursor": 12}')
    assert resumed.version == 1 and resumed.num_train_steps == 1 and meta.config == CONFIG
    assert Path(meta.reference_model_path) == tiny_model_dir.absolute()
    resumed_stats = [resumed.train_step(batch)[1] for batch in batches[1:]]

    for a, b in zip(straight_stats[1:], resumed_stats, strict=True):
        assert (a.loss, a.grad_norm, a.learning_rate, a.mismatch_kl) == (b.loss, b.grad_norm, b.learning_rate,
                                                                         b.mismatch_kl)
    expected = _weights(straight)
    for name, tensor in _weights(resumed).items():
        assert torch.equal(tensor, expected[name]), name
    assert resumed.version == straight.version == 3

    # Loading the same directory as a plain model (fresh AdamW, fresh shuffle) does not continue the
    # run: what the checkpoint adds to the weights matters.
    plain = PolicyTrainer(path, CONFIG, version=1)
    plain.num_train_steps = 1
    for batch in batches[1:]:
        plain.train_step(batch)
    assert any(not torch.equal(t, expected[n]) for n, t in _weights(plain).items())


@pytest.mark.parametrize("architecture", list(ARCHITECTURES))
def test_checkpoint_is_a_hugging_face_directory_with_metadata(tiny_model_dirs, tmp_path: Path,
                                                              architecture: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tiny_model_dir = tiny_model_dirs(architecture)
    trainer = PolicyTrainer(tiny_model_dir, TrainerConfig(learning_rate=1e-3), version=7)
    trainer.train_step(check_batches(51, num_steps=1)[0])
    path = trainer.save_checkpoint(tmp_path / "ckpt")
    trainer.save_checkpoint(path, data_position="again")  # overwriting a checkpoint in place works

    model = AutoModelForCausalLM.from_pretrained(path)
    assert type(model).__name__ == ARCHITECTURES[architecture]
    assert AutoTokenizer.from_pretrained(path).convert_tokens_to_ids("+") == 4
    assert model.state_dict().keys() == trainer.model.state_dict().keys()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, trainer.model.state_dict()[name]), name
    if architecture == "qwen3_moe":  # on disk in the hub's layout, one tensor per expert, as engines load it
        from safetensors import safe_open

        with safe_open(path / "model.safetensors", "pt") as f:
            assert f.get_slice("model.layers.1.mlp.experts.7.gate_proj.weight").get_shape() == [64, 64]
            assert "model.layers.1.mlp.experts.gate_up_proj" not in set(f.keys())
    meta = json.loads((path / CHECKPOINT_META_FILE).read_text())
    assert meta["version"] == 8 and meta["train_step"] == 1 and meta["data_position"] == "again"
    assert meta["world_size"] == 1 and meta["config"]["learning_rate"] == 1e-3
    assert not list(tmp_path.glob(".ckpt.partial-*"))

    with pytest.raises(ValueError, match="path: .* is not an everstep checkpoint"):
        PolicyTrainer.resume(tiny_model_dir)
