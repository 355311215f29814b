"""LoRA in the trainer (peft): only the adapters train, checkpoints hold the adapters and their optimizer state and
resume exactly, packing equals padding, the pushed adapters rebuild peft's merged model, and targets that do
not exist (or name fused MoE experts) are refused naming the setting."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from distributed_check import (
    UPDATE_TOLERANCE,
    check_batches,
    check_config,
    max_weight_difference,
    relative_update_difference,
)
from safetensors.torch import load_file

from everstep.settings.training import LoraSettings
from everstep_trainer.model.checkpoint import TRAINER_STATE_FILE
from everstep_trainer.model.lora import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE
from everstep_trainer.step.trainer import PolicyTrainer

LORA = LoraSettings(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "down_proj"])


def _config(**overrides: object):
    return check_config(**{"lora": LORA, "learning_rate": 1e-2, **overrides})


def _adapters(trainer: PolicyTrainer) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in trainer.full_state_dict().items()}


def test_only_the_adapters_train_and_the_base_stays_frozen(tiny_model_dir: Path) -> None:
    trainer = PolicyTrainer(tiny_model_dir, _config())
    base_before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if not p.requires_grad}
    adapters_before = _adapters(trainer)
    assert set(adapters_before) and all(".lora_" in n for n in adapters_before)
    assert all(t.dtype == torch.float32 for t in adapters_before.values())
    assert len(adapters_before) == 2 * 2 * 3  # layers x (A, B) x targets
    assert trainer.num_trainable_parameters < trainer.num_parameters / 10
    optimized = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert optimized == {id(p) for p in trainer.model.parameters() if p.requires_grad}

    for batch in check_batches(51, num_steps=2):
        trainer.train_step(batch)
    for name, param in trainer.model.named_parameters():
        if not param.requires_grad:
            assert torch.equal(param, base_before[name]), name
    assert max_weight_difference(_adapters(trainer), adapters_before) > 1e-4


def test_packing_trains_as_padding_does(tiny_model_dirs) -> None:
    model_dir = tiny_model_dirs("qwen3")
    batches = check_batches(51, num_steps=2)
    padded, packed = (PolicyTrainer(model_dir, _config(packing=packing)) for packing in (False, True))
    initial = _adapters(padded)
    for batch in batches:
        a, b = padded.train_step(batch)[1], packed.train_step(batch)[1]
        assert b.loss == pytest.approx(a.loss, rel=1e-4, abs=1e-6)
    assert relative_update_difference(initial, _adapters(padded), _adapters(packed)) < UPDATE_TOLERANCE


def test_checkpoint_holds_the_adapters_and_resumes_exactly(tiny_model_dir: Path, tmp_path: Path) -> None:
    config = _config(kl_coef=0.05, weight_decay=0.01, warmup_steps=1, total_steps=5)
    batches = check_batches(51, num_steps=3)
    straight = PolicyTrainer(tiny_model_dir, config)
    straight_losses = [straight.train_step(b)[1].loss for b in batches]

    first = PolicyTrainer(tiny_model_dir, config)
    first.train_step(batches[0])
    path = first.save_checkpoint(tmp_path / "step-1", data_position="cursor")
    files = {p.name for p in path.iterdir()}
    assert {ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, TRAINER_STATE_FILE} <= files
    assert "model.safetensors" not in files and "tokenizer.json" in files
    saved = load_file(str(path / ADAPTER_WEIGHTS_FILE))
    assert len(saved) == 12 and all(".lora_" in n for n in saved)
    assert json.loads((path / ADAPTER_CONFIG_FILE).read_text())["base_model_name_or_path"] == str(tiny_model_dir)
    optimizer = torch.load(path / TRAINER_STATE_FILE, weights_only=True)["optimizer"]
    assert set(optimizer["state"]) == set(saved_names := {n.replace(".lora_A.weight", ".lora_A.default.weight")
                                                          .replace(".lora_B.weight", ".lora_B.default.weight")
                                                          for n in saved}), saved_names
    del first
    torch.manual_seed(99)

    resumed, meta = PolicyTrainer.resume(path)
    assert meta.base_model_path == str(tiny_model_dir.absolute()) and resumed.version == 1
    resumed_losses = [resumed.train_step(b)[1].loss for b in batches[1:]]
    assert resumed_losses == straight_losses[1:]
    assert max_weight_difference(_adapters(resumed), _adapters(straight)) == 0.0

    with pytest.raises(ValueError, match="config.lora"):
        PolicyTrainer.resume(path, config.model_copy(update={"lora": None}))


def test_pushed_adapters_rebuild_peft_merged_weights(tiny_model_dir: Path) -> None:
    trainer = PolicyTrainer(tiny_model_dir, _config())
    for batch in check_batches(51, num_steps=2):
        trainer.train_step(batch)
    pushed = trainer.weights_to_push()
    assert pushed.adapter is not None and (pushed.adapter.rank, pushed.adapter.alpha) == (4, 8.0)
    assert sorted(pushed.tensors)[0] == "model.layers.0.mlp.down_proj.lora_A"
    base = load_file(str(tiny_model_dir / "model.safetensors"))
    merged = trainer.model.merge_and_unload().state_dict()
    for module in {n.rsplit(".", 1)[0] for n in pushed.tensors}:
        a, b = pushed.tensors[f"{module}.lora_A"], pushed.tensors[f"{module}.lora_B"]
        assert a.shape[0] == b.shape[1] == 4
        rebuilt = base[f"{module}.weight"] + pushed.adapter.scale * b @ a
        assert torch.allclose(rebuilt, merged[f"{module}.weight"], atol=1e-6), module


def test_a_target_that_does_not_exist_is_refused_naming_it(tiny_model_dirs) -> None:
    with pytest.raises(ValueError, match=r"trainer\.lora\.target_modules: .*'gate_projj'"):
        PolicyTrainer(tiny_model_dirs("llama"), _config(lora=LoraSettings(target_modules=["gate_projj"])))
    with pytest.raises(ValueError, match=r"trainer\.lora\.target_modules: .*expert"):
        PolicyTrainer(tiny_model_dirs("qwen3_moe"), _config(lora=LoraSettings(target_modules=["gate_up_proj"])))


def test_moe_attention_adapters_train(tiny_model_dirs) -> None:
    trainer = PolicyTrainer(tiny_model_dirs("qwen3_moe"), _config(lora=LoraSettings(rank=2)))
    before = _adapters(trainer)
    trainer.train_step(check_batches(51, num_steps=1)[0])
    assert max_weight_difference(_adapters(trainer), before) > 1e-4
    assert all(".self_attn." in n for n in trainer.weights_to_push().tensors)


def test_the_kl_reference_of_a_lora_policy_is_its_base_with_the_adapters_off(tiny_model_dir: Path) -> None:
    """No second model: the reference log-probs are the base model's, which a separately loaded reference (the
    full fine-tuning path) gives too."""
    lora = PolicyTrainer(tiny_model_dir, _config(kl_coef=0.1))
    assert lora.reference is None
    batch = check_batches(51, num_steps=1)[0]
    lora.train_step(batch)  # adapters away from 0: the policy now differs from its base
    full = PolicyTrainer(tiny_model_dir, check_config(kl_coef=0.1))
    from everstep_trainer.batch.samples import pad_samples

    padded = pad_samples(batch, pad_token_id=lora.pad_token_id, device=lora.device)
    reference = lora._reference_logp(padded)
    torch.testing.assert_close(reference, full._reference_logp(padded), atol=1e-5, rtol=0)
    assert (lora._score(lora.model, padded) - reference).abs().max() > 1e-4


def test_dropout_acts_in_the_loss_passes_only(tiny_model_dir: Path) -> None:
    """lora.dropout drops adapter inputs in the forward/backward passes (the adapters then train differently), never
    in the log-prob pass (whose statistics stay those of the undropped model) nor after the step."""
    batch = check_batches(51, num_steps=1)[0]
    plain, dropped = (PolicyTrainer(tiny_model_dir, _config(lora=LORA.model_copy(update={"dropout": p})))
                      for p in (0.0, 0.5))
    a, b = plain.train_step(batch)[1], dropped.train_step(batch)[1]
    assert a.mismatch_kl == b.mismatch_kl  # theta_old's pass: no dropout
    assert max_weight_difference(_adapters(plain), _adapters(dropped)) > 1e-4
    assert not any(m.training for m in dropped.model.modules())  # back in eval mode after the step
