"""`everstep model import` on a real GGUF file: a plain HF directory whose logits equal the GGUF model's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

EVERSTEP = str(Path(sys.executable).parent / "everstep")


def test_imported_directory_is_complete_and_computes_the_gguf_models_logits(gguf_path: Path, smollm2_dir: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    names = {p.name for p in smollm2_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= names
    tokenizer_config = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    assert "<|im_start|>assistant" in tokenizer_config["chat_template"]
    generation = json.loads((smollm2_dir / "generation_config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    im_end, end_of_text = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert set(generation["eos_token_id"]) == {im_end, end_of_text}  # every EOS id

    gguf = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                dtype=torch.float32).eval()
    imported = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    assert sum(p.numel() for p in imported.parameters()) == 134_515_008
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(imported(ids).logits, gguf(ids).logits, rtol=0, atol=1e-5)


def test_cli_refuses_a_non_empty_out_folder_and_a_file_that_is_not_gguf(tmp_path: Path, smollm2_dir: Path):
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    refused = subprocess.run([EVERSTEP, "model", "import", str(smollm2_dir), "--out", str(busy)],
                             capture_output=True, text=True, timeout=300)
    assert refused.returncode != 0 and "not empty" in refused.stderr
    assert (busy / "keep.txt").read_text() == "mine"
    not_gguf = subprocess.run([EVERSTEP, "model", "import", str(smollm2_dir / "config.json"), "--out",
                               str(tmp_path / "new")], capture_output=True, text=True, timeout=300)
    assert not_gguf.returncode != 0 and "not a .gguf file" in not_gguf.stderr


def test_a_transformers_directory_imports_to_bfloat16(tmp_path: Path, smollm2_dir: Path):
    out = tmp_path / "bf16"
    done = subprocess.run([EVERSTEP, "model", "import", str(smollm2_dir), "--out", str(out), "--dtype", "bfloat16"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["num_parameters"] == 134_515_008 and report["chat_template"] is True
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}  # noqa: SIM118
    assert (out / "model.safetensors").stat().st_size < 0.55 * (smollm2_dir / "model.safetensors").stat().st_size
