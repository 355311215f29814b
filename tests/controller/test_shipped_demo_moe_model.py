"""The MoE demo model shipped in examples/demo-moe-model: its build.json matches its files, it is a Qwen3-MoE
(8 experts, top-2) that transformers loads and the native rollout engine runs, and examples/demo-moe.yaml
runs on it; `everstep demo --rebuild` rebuilds a spec's model with the options its build.json records."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from everstep.model_manifest import MANIFEST_NAME, verify_manifest, write_manifest
from everstep_cli.demo import REBUILD_DIR, rebuild_options
from everstep_cli.job_file import load_job_file
from everstep_tools.demo.build import MoEShape

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SHIPPED = EXAMPLES / "demo-moe-model"
MODEL_FILES = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
               "tokenizer_config.json", "train.jsonl", "eval.jsonl", "warm_start.json"}


def test_the_recorded_sha256s_match_the_shipped_files() -> None:
    manifest = verify_manifest(SHIPPED)
    assert set(manifest.files) == MODEL_FILES
    assert {p.name for p in SHIPPED.iterdir()} == MODEL_FILES | {MANIFEST_NAME}
    assert manifest.command.startswith(
        "python -m everstep_tools.demo --architecture qwen3_moe --out examples/demo-moe-model")
    assert {"python", "torch", "transformers", "torch_num_threads"} <= manifest.environment.keys()
    shape = manifest.settings["model"]
    assert MoEShape(**shape).architecture == "qwen3_moe"
    assert (shape["num_experts"], shape["num_experts_per_tok"]) == (8, 2)
    assert json.loads((SHIPPED / "warm_start.json").read_text())["config"] == manifest.settings
    assert (SHIPPED / "model.safetensors").stat().st_size < 5_000_000


def test_the_moe_demo_spec_runs_on_the_shipped_model_and_its_data() -> None:
    spec = load_job_file(EXAMPLES / "demo-moe.yaml")
    assert Path(spec["model_path"]) == SHIPPED
    assert Path(spec["dataset"]["train_path"]) == SHIPPED / "train.jsonl"
    assert Path(spec["dataset"]["eval_path"]) == SHIPPED / "eval.jsonl"
    assert spec["evaluation"]["every"] > 0 and spec["steps"] % spec["evaluation"]["every"] == 0


def test_transformers_loads_a_qwen3_moe_and_the_native_engine_runs_it_alike() -> None:
    from everstep_rollout.config import EngineConfig
    from everstep_rollout.engine import Engine
    from everstep_rollout.executor.models import LlamaExecutor
    from everstep_rollout.sequence import GenerationRequest, SamplingOptions

    model = AutoModelForCausalLM.from_pretrained(SHIPPED, dtype=torch.float32)
    config = model.config
    assert type(model).__name__ == "Qwen3MoeForCausalLM" and config.model_type == "qwen3_moe"
    assert (config.num_experts, config.num_experts_per_tok, config.norm_topk_prob) == (8, 2, True)
    assert config.mlp_only_layers == [] and config.decoder_sparse_step == 1  # every layer sparse
    assert 2_000_000 < sum(p.numel() for p in model.parameters()) < 5_000_000

    tokenizer = AutoTokenizer.from_pretrained(SHIPPED)
    rows = [json.loads(line) for line in (SHIPPED / "eval.jsonl").read_text().splitlines()[:3]]
    prompts = [tokenizer(row["prompt"]).input_ids for row in rows]
    engine = Engine(SHIPPED, EngineConfig(max_running=3, seed=0))  # auto picks native
    assert isinstance(engine.executor, LlamaExecutor) and engine.executor.model_type == "qwen3_moe"
    engine.add([GenerationRequest(id=str(i), prompt_ids=p, sampling=SamplingOptions(temperature=0.0,
                                                                                     max_new_tokens=40))
                for i, p in enumerate(prompts)])
    results = {}
    while engine.has_work:
        for result in engine.step():
            results[result.id] = result
    for i, prompt in enumerate(prompts):
        output = results[str(i)].output_ids
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False,
                                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        assert output == expected[0, len(prompt):len(prompt) + len(output)].tolist()
        assert "\\boxed" in tokenizer.decode(output)  # the warm start answers in the task's format


def test_rebuild_takes_the_recorded_build_options(tmp_path: Path) -> None:
    assert rebuild_options(SHIPPED)[:2] == ["--architecture", "qwen3_moe"]
    assert "--out" not in rebuild_options(SHIPPED)
    assert rebuild_options(EXAMPLES / "demo-model") == []  # the build's defaults
    assert REBUILD_DIR.with_name(SHIPPED.name) == Path("outputs/demo-moe-model")
    other = tmp_path / "other"
    other.mkdir()
    write_manifest(other, command="python train.py --out x --architecture llama", settings={}, environment={})
    assert rebuild_options(other) == []  # not the demo build's command
    assert rebuild_options(tmp_path) == []  # no build.json
