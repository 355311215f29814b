"""benchmarks.rollout_throughput at a tiny size: both systems run and the last line is the JSON report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_tiny_run_reports_both_systems(tiny_model_dir: Path, tmp_path: Path) -> None:
    model_dir = tiny_model_dir
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{i} + {i + 1} ="}) + "\n" for i in range(10)))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    process = subprocess.run(
        [sys.executable, "-m", "benchmarks.rollout_throughput", "--model", str(model_dir), "--prompts", str(prompts),
         "--num-prompts", "6", "--max-new-tokens", "6", "--batch-size", "4", "--max-running", "4", "--repeats", "2"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=240,
    )
    assert process.returncode == 0, process.stderr[-4000:]
    lines = process.stdout.strip().splitlines()
    report = json.loads(lines[-1])
    assert report["ours_tokens_per_s"] > 0 and report["hf_tokens_per_s"] > 0
    assert report["ratio"] == pytest.approx(report["ours_tokens_per_s"] / report["hf_tokens_per_s"], rel=1e-3)
    runs = report["runs"]
    assert [r["system"] for r in runs] == ["hf", "ours", "hf", "ours"]
    # Each run generated at least one token per prompt and at most max_new_tokens each.
    assert all(6 <= r["num_tokens"] <= 36 and r["seconds"] > 0 for r in runs)
    # transformers computes every row of a static batch until its longest ends; our engine only running rows.
    assert all(r["num_row_steps"] >= r["num_tokens"] for r in runs if r["system"] == "hf")
    assert all(r["num_row_steps"] == r["num_tokens"] for r in runs if r["system"] == "ours")
    assert 0 < report["hf_useful_row_fraction"] <= 1
    assert report["num_prompts"] == 6 and report["executor"] == "LlamaExecutor" and report["mode"] == "full"
    assert any("tokens/s" in line for line in lines[:-1])


def test_quantized_engines_run_side_by_side(tiny_model_dir: Path, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{i} + {i + 1} ="}) + "\n" for i in range(4)))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    process = subprocess.run(
        [sys.executable, "-m", "benchmarks.rollout_throughput", "--model", str(tiny_model_dir), "--prompts",
         str(prompts), "--num-prompts", "4", "--max-new-tokens", "4", "--batch-size", "4", "--max-running", "4",
         "--repeats", "1", "--quantization", "none,int8"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=240,
    )
    assert process.returncode == 0, process.stderr[-4000:]
    report = json.loads(process.stdout.strip().splitlines()[-1])
    assert [(r["system"], r["quantization"]) for r in report["runs"]] == [("hf", "none"), ("ours", "none"),
                                                                          ("ours", "int8")]
    figures = report["quantization"]
    assert figures["none"]["speed_ratio"] == 1.0 and figures["int8"]["tokens_per_s"] > 0
    assert figures["int8"]["weight_bytes"] < 0.5 * figures["none"]["weight_bytes"]


def test_samples_per_prompt_and_prompt_sharing_side_by_side(tiny_model_dir: Path, tmp_path: Path) -> None:
    """G copies of each prompt on both sides; our engine once with prompt sharing and once without, in every repeat:
    the shared run prefills each prompt once, the unshared one every copy."""
    prompts = tmp_path / "prompts.jsonl"
    words = ["0 + 1 =", "2 + 3 = 5 and", "4 + 5 ="]
    prompts.write_text("".join(json.dumps({"prompt": w}) + "\n" for w in words))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    process = subprocess.run(
        [sys.executable, "-m", "benchmarks.rollout_throughput", "--model", str(tiny_model_dir), "--prompts",
         str(prompts), "--num-prompts", "8", "--samples-per-prompt", "3", "--max-new-tokens", "4", "--batch-size",
         "8", "--max-running", "8", "--repeats", "1", "--prompt-sharing", "on,off", "--num-threads", "1"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=240,
    )
    assert process.returncode == 0, process.stderr[-4000:]
    report = json.loads(process.stdout.strip().splitlines()[-1])
    assert (report["num_prompts"], report["samples_per_prompt"], report["num_distinct_prompts"]) == (8, 3, 3)
    assert [(r["system"], r["prompt_sharing"]) for r in report["runs"]] == [("hf", False), ("ours", True),
                                                                            ("ours", False)]
    figures = report["prompt_sharing"]
    assert figures["on"]["speed_ratio"] == 1.0 and figures["off"]["tokens_per_s"] > 0
    # 8 sequences: the three prompts 3, 3 and 2 times (the last group cut to make 8); all admitted in one step.
    from transformers import AutoTokenizer

    lengths = [len(AutoTokenizer.from_pretrained(tiny_model_dir)(w).input_ids) - 1 for w in words]
    assert figures["off"]["prefill_tokens"] == 3 * lengths[0] + 3 * lengths[1] + 2 * lengths[2]
    assert figures["off"]["prefill_tokens_shared"] == 0
    assert figures["on"]["prefill_tokens"] == sum(lengths)
    assert figures["on"]["prefill_tokens_shared"] == 2 * lengths[0] + 2 * lengths[1] + lengths[2]


def test_prompt_flags_are_checked() -> None:
    code = """
from benchmarks.rollout_throughput import parse_args, grouped
args = parse_args([])
print(args.samples_per_prompt, args.prompt_sharing)
print(parse_args(["--prompt-sharing", "off,on"]).prompt_sharing, grouped(["x", "y"], 3, 2))
"""
    process = subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                             capture_output=True, text=True, timeout=60)
    assert process.returncode == 0, process.stderr[-4000:]
    assert process.stdout.split("\n")[:2] == ["8 [True]", "[False, True] ['x', 'x', 'y']"]
    for bad, message in ((["--prompt-sharing", "yes"], "--prompt-sharing"), (["--samples-per-prompt", "0"],
                                                                           "--samples-per-prompt")):
        process = subprocess.run([sys.executable, "-m", "benchmarks.rollout_throughput", *bad], cwd=REPO,
                                 env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                                 timeout=60)
        assert process.returncode == 2 and message in process.stderr


def test_missing_model_says_how_to_build_it(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    process = subprocess.run(
        [sys.executable, "-m", "benchmarks.rollout_throughput", "--model", str(tmp_path / "none")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=60,
    )
    assert process.returncode == 2 and "everstep_tools.demo" in process.stderr


def test_quick_mode_runs_the_same_workload_once() -> None:
    code = """
from benchmarks.rollout_throughput import parse_args, workload_size
for argv, prompt_format in [([], "raw"), ([], "chat"), (["--quick"], "raw"), (["--quick"], "chat"),
                            (["--quick", "--repeats", "2", "--num-prompts", "8"], "chat")]:
    print(*workload_size(parse_args(argv), prompt_format))
"""
    process = subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                             capture_output=True, text=True, timeout=60)
    assert process.returncode == 0, process.stderr[-4000:]
    assert process.stdout.split("\n")[:5] == [
        "256 128 128 3", "128 128 128 3", "256 128 128 1", "128 128 128 1",
        "8 128 128 2",  # explicit settings win over the quick defaults
    ]


def test_quick_run_on_a_random_qwen3_dense_model(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The Qwen3 builder's model (one layer here), with another model's tokenizer, runs on the native executor."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    model_dir = tmp_path / "qwen3"
    build = subprocess.run(
        [sys.executable, "-m", "benchmarks.qwen3_dense_model", "--tokenizer", str(tiny_model_dir), "--out",
         str(model_dir), "--num-layers", "1"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=240,
    )
    assert build.returncode == 0, build.stderr[-4000:]
    config = json.loads((model_dir / "config.json").read_text())
    assert (config["model_type"], config["hidden_size"], config["head_dim"], config["num_key_value_heads"]) == (
        "qwen3", 512, 128, 4)
    assert config["vocab_size"] == json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{i} + {i + 1} ="}) + "\n" for i in range(5)))
    process = subprocess.run(
        [sys.executable, "-m", "benchmarks.rollout_throughput", "--model", str(model_dir), "--prompts", str(prompts),
         "--quick", "--num-prompts", "5", "--max-new-tokens", "4", "--batch-size", "4", "--max-running", "4",
         "--num-threads", "1"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=240,
    )
    assert process.returncode == 0, process.stderr[-4000:]
    report = json.loads(process.stdout.strip().splitlines()[-1])
    assert report["mode"] == "quick" and report["seconds"] > 0
    assert (report["num_prompts"], report["batch_size"], report["max_running"], report["repeats"]) == (5, 4, 4, 1)
    assert [r["system"] for r in report["runs"]] == ["hf", "ours"]
    assert report["executor"] == "LlamaExecutor" and report["num_threads"] == 1


def test_qwen3_builder_names_a_directory_without_a_tokenizer(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    process = subprocess.run(
        [sys.executable, "-m", "benchmarks.qwen3_dense_model", "--tokenizer", str(tmp_path), "--out",
         str(tmp_path / "out")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )
    assert process.returncode == 2 and "--tokenizer" in process.stderr and "tokenizer_config.json" in process.stderr
