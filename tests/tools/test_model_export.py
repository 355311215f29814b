"""`everstep model export` (`everstep_tools.model_export`) of a full fine-tuning checkpoint: the model's files without
the trainer's state; a non-empty --out and a folder that is no checkpoint are refused naming the argument. (LoRA
checkpoints: tests/e2e/test_lora_job.py exports and loads them with peft and transformers.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from everstep.settings.training import TrainerConfig
from everstep_tools.model_export import export_checkpoint
from everstep_trainer.batch.samples import TrainSample
from everstep_trainer.step.trainer import PolicyTrainer


def test_export_of_a_full_checkpoint_is_its_hugging_face_files(tiny_model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    trainer = PolicyTrainer(tiny_model_dir, TrainerConfig(learning_rate=1e-2))
    trainer.train_step([TrainSample([1, 4, 7], [5, 6, 9], [-2.0, -1.5, -3.0], 1.0),
                        TrainSample([1, 8], [10, 11], [-1.0, -2.5], -1.0)])
    checkpoint = trainer.save_checkpoint(tmp_path / "step-1")
    out = export_checkpoint(checkpoint, tmp_path / "out", merge=True)  # nothing to merge: exported as it is
    assert {p.name for p in out.iterdir()} == {p.name for p in checkpoint.iterdir()} - {
        "trainer_state.pt", "everstep_checkpoint.json"}
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    trained = trainer.full_state_dict()
    assert exported.keys() == trained.keys()
    assert max(float((exported[n] - trained[n]).abs().max()) for n in trained) == 0.0
    with pytest.raises(ValueError, match="^out: .* is not empty"):
        export_checkpoint(checkpoint, out)
    not_a_checkpoint = tmp_path / "empty"
    not_a_checkpoint.mkdir()
    with pytest.raises(ValueError, match="^checkpoint: .* neither"):
        export_checkpoint(not_a_checkpoint, tmp_path / "other")
