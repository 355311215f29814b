"""Tool-using jobs in the controller: the tools reach the prompt through the chat template (token for token as
transformers' apply_chat_template(tools=...)), a template without tool support is refused at submission naming it,
and a trajectory's answer, model tokens and tool mask reach the verifiers, the budget and the trainer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_chat_template import SMOLLM2_TEMPLATE, _model_dir
from tool_fixtures import QWEN25_TEMPLATE

from everstep.tool_settings import ToolSettings
from everstep.v1 import common_pb2, reward_pb2
from everstep_controller.algo.training_batch import build_batch
from everstep_controller.data.chat_template import ChatMessage
from everstep_controller.data.dataset import PromptRow, load_tokenizer
from everstep_controller.data.prompt_rendering import load_prompt_encoder
from everstep_controller.data.reward_items import RewardItemBuilder
from everstep_controller.data.submission_checks import JobInputError, check_job_input
from everstep_controller.data.trajectories import new_sequence, num_model_tokens
from everstep_controller.spec.job_spec import JobSpec, VerifierWeight
from everstep_controller.store.progress_store import ScoredSample

transformers = pytest.importorskip("transformers")

QUESTION = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is 2 + 3? Answer with a number."}]


def _spec(model: Path, tmp_path: Path, **tools) -> JobSpec:
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"prompt": "What is 2 + 3?", "answer": "5"}) + "\n")
    return JobSpec(model_path=str(model), dataset={"train_path": str(data)}, tools={"environment": "python", **tools})


def test_the_tools_are_rendered_into_the_prompt_as_transformers_does(tmp_path: Path) -> None:
    model = _model_dir(tmp_path / "model", QWEN25_TEMPLATE, jinja_file=True)
    tools = ToolSettings(environment="python")
    encoder = load_prompt_encoder(str(model), load_tokenizer(str(model)), tools=tools)
    reference = transformers.AutoTokenizer.from_pretrained(str(model))
    expected = reference.apply_chat_template(QUESTION, tools=[t.model_dump() for t in tools.offered()],
                                             add_generation_prompt=True, tokenize=True, return_dict=False)
    prompt = tuple(ChatMessage(m["role"], m["content"]) for m in QUESTION)
    assert list(encoder.encode(prompt)) == expected
    assert '"name": "python"' in encoder.text(prompt) and "<tools>" in encoder.text(prompt)


def test_a_template_without_tool_support_is_refused_naming_it(tmp_path: Path) -> None:
    smollm = _model_dir(tmp_path / "smollm", SMOLLM2_TEMPLATE, jinja_file=True)
    with pytest.raises(JobInputError, match="has no tool support") as refused:
        check_job_input(_spec(smollm, tmp_path))
    assert refused.value.loc == ("tools",) and str(smollm) in str(refused.value)
    check_job_input(_spec(smollm, tmp_path, chat_template=QWEN25_TEMPLATE))  # a spec's own template with tools
    with pytest.raises(JobInputError, match="tools.chat_template has no tool support") as refused:
        check_job_input(_spec(smollm, tmp_path, chat_template=SMOLLM2_TEMPLATE))
    assert refused.value.loc == ("tools", "chat_template")
    with pytest.raises(ValueError, match="tools need prompt.format"):
        JobSpec(model_path=str(smollm), dataset={"train_path": "x.jsonl"}, prompt={"format": "raw"},
                tools={"environment": "python"})


def test_a_trajectory_reaches_verifiers_budget_and_trainer_as_the_model_wrote_it() -> None:
    row = PromptRow(index=3, prompt="What is 123 * 456?", prompt_ids=(1, 2, 3), answer="56088")
    sequence = new_sequence("s1", row, tools=True)
    assert json.loads(sequence.tool_trajectory.row_json) == {"index": 3, "prompt": row.prompt, "answer": "56088"}
    sequence.output_ids.extend([10, 11, 12, 13, 14, 15])
    sequence.output_tool_mask.extend([False, False, True, True, False, False])
    sequence.output_logprobs.extend([-0.1, -0.2, 0.0, 0.0, -0.3, -0.4])
    sequence.output_versions.extend([1, 1, -1, -1, 1, 1])
    sequence.output_text = "<tool_call>...</tool_call> 56088 The answer is 56088."
    sequence.tool_trajectory.final_text = "The answer is 56088."
    sequence.tool_trajectory.calls.add(name="python", arguments_json='{"code": "print(123*456)"}', reply="56088")
    assert num_model_tokens(sequence) == 4

    item = RewardItemBuilder([VerifierWeight(name="math")])("s1", row, sequence)
    assert item.response == "The answer is 56088." and item.trajectory == sequence.output_text
    assert item.num_response_tokens == 4 and item.tool_trajectory.calls[0].reply == "56088"

    class Members:
        def surviving_samples(self, group_id: str) -> list[str]:
            return ["s1", "s2"]

    other = common_pb2.Sequence(id="s2", prompt_ids=[1, 2, 3], output_ids=[9], output_logprobs=[-1.0],
                                output_versions=[1], output_tool_mask=[False])
    scored = {"s1": ScoredSample.of(sequence, reward_pb2.ScoreResult(id="s1", reward=1.0)),
              "s2": ScoredSample.of(other, reward_pb2.ScoreResult(id="s2", reward=0.0))}
    batch = build_batch(["g"], Members(), scored, drop_zero_signal=True, normalize_std=True)
    assert list(batch.samples[0].output_tool_mask) == list(sequence.output_tool_mask)
