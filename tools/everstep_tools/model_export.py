"""`python -m everstep_tools.model_export CHECKPOINT --out DIR [--merge]`: a trainer checkpoint as a directory
that transformers or peft load as it is (`everstep model export JOB` resolves the job's checkpoint and runs this).

- a full fine-tuning checkpoint: its Hugging Face files (config, weights, tokenizer, generation config), without
  the trainer's state; `--merge` changes nothing (there is no adapter).
- a LoRA checkpoint: the PEFT adapter directory (`adapter_config.json` naming the base model,
  `adapter_model.safetensors`, the tokenizer), which `PeftModel.from_pretrained(base, DIR)` loads; with `--merge`,
  the base with the adapters merged in (W = W_base + alpha/rank * B @ A), a plain Hugging Face directory that
  `AutoModelForCausalLM.from_pretrained(DIR)` loads.
"""

from __future__ import annotations

import argparse
import logging
import shutil
from pathlib import Path

from everstep_trainer.model.checkpoint import CHECKPOINT_META_FILE, TRAINER_STATE_FILE

__all__ = ["export_checkpoint"]

log = logging.getLogger(__name__)

_TRAINER_FILES = (CHECKPOINT_META_FILE, TRAINER_STATE_FILE)


def export_checkpoint(checkpoint: str | Path, out: str | Path, *, merge: bool = False) -> Path:
    """Write the checkpoint's model to `out` (new or empty); ValueError naming the argument at fault."""
    import torch

    from everstep_trainer.model.hf_model import copy_tokenizer_files
    from everstep_trainer.model.lora import adapter_base_model, is_adapter_dir

    checkpoint, out = Path(checkpoint), Path(out)
    if not checkpoint.is_dir():
        raise ValueError(f"checkpoint: {checkpoint} is not a directory")
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"out: {out} is not empty")
    adapters = is_adapter_dir(checkpoint)
    if not adapters and not (checkpoint / "config.json").is_file():
        raise ValueError(f"checkpoint: {checkpoint} holds neither a Hugging Face model nor a PEFT adapter")
    out.mkdir(parents=True, exist_ok=True)
    if not adapters or not merge:
        if merge:
            log.warning("--merge: %s holds full weights, not adapters; exported as they are", checkpoint)
        for path in sorted(checkpoint.iterdir()):
            if path.is_file() and path.name not in _TRAINER_FILES:
                shutil.copy2(path, out / path.name)
        return out

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base_dir = Path(adapter_base_model(checkpoint))
    if not (base_dir / "config.json").is_file():
        raise ValueError(f"checkpoint: its base model {base_dir} (adapter_config.json) is not a Hugging Face "
                         "directory here; export without --merge, or make the base available at that path")
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, checkpoint).merge_and_unload()
    merged.save_pretrained(out)
    copy_tokenizer_files(checkpoint, out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m everstep_tools.model_export", description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", help="a directory the trainer's SaveCheckpoint wrote")
    parser.add_argument("--out", required=True, help="folder to write (new or empty)")
    parser.add_argument("--merge", action="store_true",
                        help="LoRA: merge the adapters into the base (a plain Hugging Face directory)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        out = export_checkpoint(args.checkpoint, args.out, merge=args.merge)
    except ValueError as e:
        raise SystemExit(f"everstep model export: {e}") from None
    print(out)


if __name__ == "__main__":
    main()
