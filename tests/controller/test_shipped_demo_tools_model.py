"""The tools demo model shipped in examples/demo-tools-model: its build.json matches its files, its tokenizer and
chat template express tool calls as Qwen2.5's do, and examples/demo-tools.yaml is a valid job on it that passes
the submission checks (the template shows tools and writes Hermes calls); `everstep demo --rebuild` rebuilds it
with its own builder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from everstep.model_manifest import MANIFEST_NAME, verify_manifest
from everstep.rest.job_spec import JobSpec
from everstep.settings.tools import PYTHON_TOOL
from everstep.tools.calls import ParsedCall
from everstep_cli.demo import rebuild_module, rebuild_options
from everstep_cli.job_file import load_job_file
from everstep_controller.data.file_checks import check_job_input

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SHIPPED = EXAMPLES / "demo-tools-model"
MODEL_FILES = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
               "tokenizer_config.json", "chat_template.jinja", "train.jsonl", "eval.jsonl", "warm_start.json"}


def test_the_recorded_sha256s_match_the_shipped_files() -> None:
    manifest = verify_manifest(SHIPPED)
    assert set(manifest.files) == MODEL_FILES
    assert {p.name for p in SHIPPED.iterdir()} == MODEL_FILES | {MANIFEST_NAME}
    assert manifest.command.startswith("python -m everstep_tools.demo.tools --out examples/demo-tools-model")
    assert {"python", "torch", "transformers", "torch_num_threads"} <= manifest.environment.keys()
    warm_start = json.loads((SHIPPED / "warm_start.json").read_text())
    assert warm_start["config"] == manifest.settings
    # a minority of first turns call the tool: RL has a tool-use rate to raise
    assert 0 < warm_start["first_turn_tool_call_rate"] < 0.5
    assert (SHIPPED / "model.safetensors").stat().st_size < 5_000_000


def test_the_tokenizer_writes_tool_calls_and_replies_as_qwen25_does() -> None:
    tokenizer = AutoTokenizer.from_pretrained(SHIPPED)
    assert tokenizer.eos_token == "<|im_end|>"
    for tag in ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<|im_start|>"):
        assert len(tokenizer(tag, add_special_tokens=False).input_ids) == 1, tag
    call = ParsedCall("python", {"code": "print(347 * 61)"})
    messages = [{"role": "user", "content": "What is 347 * 61?"},
                {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
                    "name": call.name, "arguments": call.arguments}}]},
                {"role": "tool", "name": "python", "content": "21167\n"}]
    text = tokenizer.apply_chat_template(messages, tools=[PYTHON_TOOL.model_dump()], add_generation_prompt=True,
                                         tokenize=False)
    assert '"name": "python"' in text.split("<|im_end|>")[0]  # the tool is shown in the system turn
    assert f'<tool_call>\n{{"name": "python", "arguments": {call.arguments_json}}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\n21167\n\n</tool_response><|im_end|>" in text
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert tokenizer.decode(ids) == text  # byte-level: any text (code, stderr) round-trips
    assert tokenizer.unk_token_id not in ids


def test_the_tools_demo_spec_is_a_valid_job_on_the_shipped_model() -> None:
    raw = load_job_file(EXAMPLES / "demo-tools.yaml")
    assert Path(raw["model_path"]) == SHIPPED
    spec = JobSpec.model_validate(raw)
    assert Path(spec.dataset.train_path) == SHIPPED / "train.jsonl"
    assert Path(spec.dataset.eval_path or "") == SHIPPED / "eval.jsonl"
    assert spec.tools is not None and spec.tools.environment.value == "python"
    assert spec.evaluation.every > 0 and spec.steps % spec.evaluation.every == 0
    check_job_input(spec)  # raises JobInputError naming a field (the template's tool support among them)


def test_rebuild_runs_the_tools_builder_with_the_recorded_options() -> None:
    assert rebuild_module(SHIPPED) == "everstep_tools.demo.tools"
    assert "--out" not in rebuild_options(SHIPPED)
    assert rebuild_module(EXAMPLES / "demo-model") == "everstep_tools.demo"


def test_the_plot_and_the_summary_show_the_tool_use_rate_of_a_job_with_tools() -> None:
    from step_rows import eval_row, step_row

    from everstep_cli.demo import _tool_use_summary, demo_figure

    history = [step_row(s).model_copy(update={"finished_tokens": 300, "num_finished_rollouts": 10,
                                              "tool_use_rate": s / 10}) for s in range(1, 11)]
    evaluation = {s: eval_row(s).model_copy(update={"k": 4}) for s in (0, 10)}
    lines = {line.get_label(): line for ax in demo_figure(history, evaluation).axes for line in ax.get_lines()}
    assert list(lines["samples that called a tool"].get_ydata()) == [s / 10 for s in range(1, 11)]
    assert _tool_use_summary(history[:2], history[-2:]) == pytest.approx({"tool_use_rate_first_steps": 0.15,
                                                                         "tool_use_rate_last_steps": 0.95})
    single_turn = [m.model_copy(update={"tool_use_rate": None}) for m in history]
    assert _tool_use_summary(single_turn[:2], single_turn[-2:]) == {}
    assert "samples that called a tool" not in {
        line.get_label() for ax in demo_figure(single_turn, evaluation).axes for line in ax.get_lines()}
