"""`python -m everstep_tools.demo --quick` writes a directory the Auto classes load, and the SFT loop learns."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from everstep.model_manifest import MANIFEST_NAME, read_manifest, verify_manifest
from everstep_tools.demo.build import BuildConfig, MoEShape, moe_build_config
from everstep_tools.demo.sft import SFTConfig, train_supervised, warm_start_directory
from everstep_tools.demo.task import TaskConfig, generate_problems, solution_text


@pytest.mark.slow
def test_quick_build_writes_a_loadable_model_directory(tmp_path):
    out = tmp_path / "demo"
    done = subprocess.run([sys.executable, "-m", "everstep_tools.demo", "--out", str(out), "--quick",
                           "--max-ops", "6", "--batch-size", "12"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert {"greedy_accuracy", "sampled_accuracy", "sft_steps", "wall_seconds"} <= summary.keys()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "train.jsonl", "eval.jsonl", "warm_start.json"):
        assert (out / name).is_file(), name
    warm_start = json.loads((out / "warm_start.json").read_text())
    assert warm_start["sft_steps"] == summary["sft_steps"]
    assert summary["terse_sft_steps"] == 2  # the quick build keeps a (tiny) terse phase
    config = warm_start["config"]
    assert config["task"]["max_ops"] == 6
    assert config["sft"]["batch_size"] == config["terse_sft"]["batch_size"] == 12
    assert max(json.loads(line)["num_ops"] for line in (out / "train.jsonl").read_text().splitlines()) <= 6
    manifest = verify_manifest(out)  # written last: every other file is listed with its sha256
    assert set(manifest.files) == {p.name for p in out.iterdir()} - {MANIFEST_NAME}
    assert manifest.command == f"python -m everstep_tools.demo --out {out} --quick --max-ops 6 --batch-size 12"
    assert manifest.settings == config and manifest.environment["torch"] == torch.__version__

    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.model_type == "llama"
    assert model.config.vocab_size == len(tokenizer)
    assert model.config.eos_token_id == tokenizer.eos_token_id
    row = json.loads((out / "eval.jsonl").read_text().splitlines()[0])
    ids = tokenizer(row["prompt"], return_tensors="pt")
    generated = model.generate(**ids, max_new_tokens=5, do_sample=False)
    assert generated.shape[1] > ids.input_ids.shape[1]
    assert tokenizer.decode(ids.input_ids[0], skip_special_tokens=True) == row["prompt"]
    train_prompts = {json.loads(line)["prompt"] for line in (out / "train.jsonl").read_text().splitlines()}
    eval_prompts = {json.loads(line)["prompt"] for line in (out / "eval.jsonl").read_text().splitlines()}
    assert not train_prompts & eval_prompts


def test_the_shipped_demo_model_is_the_default_build():
    """`everstep demo --rebuild` runs the build with its defaults: they must be the shipped model's settings."""
    shipped = Path(__file__).resolve().parents[2] / "examples" / "demo-model"
    manifest = read_manifest(shipped)
    assert manifest is not None
    assert manifest.settings == asdict(BuildConfig())
    assert manifest.command == "python -m everstep_tools.demo --out examples/demo-model"
    assert json.loads((shipped / "warm_start.json").read_text())["config"] == manifest.settings


def test_bad_build_option_names_its_field_and_writes_nothing(tmp_path):
    out = tmp_path / "demo"
    done = subprocess.run([sys.executable, "-m", "everstep_tools.demo", "--out", str(out), "--max-ops", "27"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "max_ops" in done.stderr
    assert not out.exists()


def test_supervised_loss_falls_only_on_completion_tokens(tiny_model_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    # The shared tiny tokenizer knows numbers up to 39; the default task stays under 30.
    examples = [(p.prompt, solution_text(p)) for p in generate_problems(32, seed=0, config=TaskConfig(max_ops=2))]
    result = train_supervised(model, tokenizer, examples,
                              SFTConfig(max_steps=20, batch_size=8, learning_rate=1e-2, warmup_steps=2))
    assert result.steps == 20 and len(result.losses) == 20
    assert result.losses[-1] < 0.6 * result.losses[0]

    # The loss ignores the prompt: changing prompt logits' targets cannot change it.
    from everstep_tools.demo.sft import _collate, _encode
    batch = _collate(_encode(tokenizer, [("1 + 2 =", "1 + 2 = 3 \\boxed{ 3 }")]), tokenizer.pad_token_id)
    prompt_len = len(tokenizer("1 + 2 =").input_ids)
    assert (batch["labels"][0, :prompt_len] == -100).all()
    assert batch["labels"][0, -1].item() == tokenizer.eos_token_id
    with torch.no_grad():
        assert torch.isfinite(model(**batch).loss)
    # batched tokenization gives each pair the ids it gets alone
    for encoded, (prompt, completion) in zip(_encode(tokenizer, examples), examples, strict=True):
        alone = tokenizer(prompt).input_ids + tokenizer(completion, add_special_tokens=False).input_ids
        assert encoded.input_ids == alone + [tokenizer.eos_token_id]
        assert encoded.num_prompt_tokens == len(tokenizer(prompt).input_ids)


def test_warm_start_directory_saves_in_place(tiny_model_dir, tmp_path):
    out = tmp_path / "warm"
    result = warm_start_directory(tiny_model_dir, [("1 + 2 =", "1 + 2 = 3 \\boxed{ 3 }")] * 4,
                                  SFTConfig(max_steps=2, batch_size=2, warmup_steps=1), out_dir=out)
    assert result.steps == 2
    assert AutoModelForCausalLM.from_pretrained(out).config.vocab_size == len(AutoTokenizer.from_pretrained(out))


def test_sft_config_names_the_bad_field():
    with pytest.raises(ValueError, match="batch_size"):
        SFTConfig(batch_size=0)
    with pytest.raises(ValueError, match="max_seconds"):
        SFTConfig(max_seconds=0)


@pytest.mark.slow
def test_quick_moe_build_is_a_qwen3_moe_the_native_engine_runs(tmp_path):
    """`--architecture qwen3_moe` at a tiny size: the same task and recipe on a Qwen3-MoE (8 experts, top-2),
    saved in bfloat16, recorded in build.json, loaded by transformers and run by the native rollout engine."""
    from everstep_rollout.config import EngineConfig
    from everstep_rollout.engine import Engine
    from everstep_rollout.executor.models import LlamaExecutor
    from everstep_rollout.sequence import GenerationRequest, SamplingOptions

    out = tmp_path / "demo-moe"
    done = subprocess.run([sys.executable, "-m", "everstep_tools.demo", "--out", str(out), "--quick",
                           "--architecture", "qwen3_moe", "--max-ops", "6", "--moe-intermediate-size", "24"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    manifest = verify_manifest(out)
    assert manifest.command.endswith("--architecture qwen3_moe --max-ops 6 --moe-intermediate-size 24")
    shape = manifest.settings["model"]
    assert shape["architecture"] == "qwen3_moe" and shape["moe_intermediate_size"] == 24
    assert (shape["num_experts"], shape["num_experts_per_tok"], shape["dtype"]) == (8, 2, "bfloat16")
    assert manifest.settings["task"] == asdict(TaskConfig(max_ops=6))

    model = AutoModelForCausalLM.from_pretrained(out)
    config = model.config
    assert config.model_type == "qwen3_moe" and type(model).__name__ == "Qwen3MoeForCausalLM"
    assert (config.num_experts, config.num_experts_per_tok, config.norm_topk_prob) == (8, 2, True)
    assert config.mlp_only_layers == [] and config.moe_intermediate_size == 24
    assert config.tie_word_embeddings and config.dtype == torch.bfloat16
    from safetensors import safe_open
    with safe_open(out / "model.safetensors", "pt") as weights:
        assert {weights.get_slice(k).get_dtype() for k in weights.keys()} == {"BF16"}  # noqa: SIM118

    tokenizer = AutoTokenizer.from_pretrained(out)
    prompt = json.loads((out / "eval.jsonl").read_text().splitlines()[0])["prompt"]
    prompt_ids = tokenizer(prompt).input_ids
    engine = Engine(out, EngineConfig(max_running=2, seed=0))
    assert isinstance(engine.executor, LlamaExecutor) and engine.executor.model_type == "qwen3_moe"
    engine.add([GenerationRequest(id="a", prompt_ids=prompt_ids,
                                  sampling=SamplingOptions(temperature=0.0, max_new_tokens=8))])
    results = []
    while engine.has_work:
        results.extend(engine.step())
    [result] = results
    expected = model.float().generate(torch.tensor([prompt_ids]), max_new_tokens=len(result.output_ids),
                                      do_sample=False, eos_token_id=None)[0, len(prompt_ids):].tolist()
    assert result.output_ids == expected


def test_moe_shape_names_the_bad_field():
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        MoEShape(num_experts=2, num_experts_per_tok=3)
    with pytest.raises(ValueError, match="dtype"):
        MoEShape(dtype="float16")
    with pytest.raises(ValueError, match="moe_intermediate_size"):
        MoEShape(moe_intermediate_size=0)
    assert asdict(moe_build_config().model)["architecture"] == "qwen3_moe"
    assert "architecture" not in asdict(BuildConfig().model)  # the dense build's settings keep their keys


def test_moe_option_needs_the_moe_architecture(tmp_path):
    out = tmp_path / "demo"
    done = subprocess.run([sys.executable, "-m", "everstep_tools.demo", "--out", str(out), "--quick",
                           "--moe-intermediate-size", "24"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "moe_intermediate_size" in done.stderr
    assert not out.exists()
