"""Tool-using jobs in the controller: the tools reach the prompt through the chat template (token for token as
transformers' apply_chat_template(tools=...)), a template without tool support is refused at submission naming it,
and a trajectory's answer, model tokens and tool mask reach the verifiers, the budget and the trainer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import redis
from fastapi.testclient import TestClient
from step_rows import step_row
from test_chat_template import SMOLLM2_TEMPLATE, _model_dir
from tool_fixtures import LLAMA31_STYLE_TEMPLATE, QWEN25_TEMPLATE

from everstep.rest.job_spec import JobSpec, VerifierWeight
from everstep.rest.step_samples import SampleSegment, StepSample
from everstep.settings.tools import ToolSettings
from everstep.v1 import common_pb2, reward_pb2
from everstep_cli.samples import format_samples
from everstep_controller.algo.training_batch import build_batch
from everstep_controller.api.app import create_app
from everstep_controller.data.chat_template import ChatMessage
from everstep_controller.data.dataset import PromptRow, load_tokenizer
from everstep_controller.data.file_checks import check_job_input
from everstep_controller.data.prompt_rendering import load_prompt_encoder
from everstep_controller.data.reward_items import RewardItemBuilder
from everstep_controller.data.trajectories import new_sequence, num_model_tokens
from everstep_controller.launchers.shared import SharedLauncher
from everstep_controller.run.job_data import load_job_data
from everstep_controller.run.manager import JobManager
from everstep_controller.run.trajectory_report import TrajectoryStats, render_sample
from everstep_controller.spec.submission_checks import JobInputError
from everstep_controller.store.job_store import JobStore
from everstep_controller.store.progress_store import JobProgress, ProgressStore, ScoredSample

transformers = pytest.importorskip("transformers")

QUESTION = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is 2 + 3? Answer with a number."}]


def _spec(model: Path, tmp_path: Path, **tools) -> JobSpec:
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"prompt": "What is 2 + 3?", "answer": "5"}) + "\n")
    return JobSpec(model_path=str(model), dataset={"train_path": str(data)}, tools={"environment": "python", **tools})


@pytest.mark.parametrize(("template", "call_format", "marker"), [
    (QWEN25_TEMPLATE, "hermes", "<tools>"),
    (LLAMA31_STYLE_TEMPLATE, "llama3_json", 'Environment: ipython\n'),
], ids=["qwen25-hermes", "llama31-json"])
def test_the_tools_are_rendered_into_the_prompt_as_transformers_does(tmp_path: Path, template: str, call_format: str,
                                                                    marker: str) -> None:
    model = _model_dir(tmp_path / "model", template, jinja_file=True)
    tools = ToolSettings(environment="python")
    encoder = load_prompt_encoder(str(model), load_tokenizer(str(model)), tools=tools)
    reference = transformers.AutoTokenizer.from_pretrained(str(model))
    expected = reference.apply_chat_template(QUESTION, tools=[t.model_dump() for t in tools.offered()],
                                             add_generation_prompt=True, tokenize=True, return_dict=False)
    prompt = tuple(ChatMessage(m["role"], m["content"]) for m in QUESTION)
    assert list(encoder.encode(prompt)) == expected
    assert '"name": "python"' in encoder.text(prompt) and marker in encoder.text(prompt)
    # the job tells the engine how the template writes calls
    data = load_job_data(_spec(model, tmp_path))
    assert data.tool_config("sandbox:1").call_format == call_format


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


def _trajectory() -> tuple[PromptRow, common_pb2.Sequence]:
    row = PromptRow(index=0, prompt="What is 6 * 7?", prompt_ids=(1,), answer="42")
    sequence = new_sequence("s1", row, tools=True)
    sequence.output_ids.extend([1, 2, 3, 4, 5])
    sequence.output_tool_mask.extend([False, False, True, True, False])
    sequence.finish_reason = common_pb2.FINISH_REASON_STOP
    t = sequence.tool_trajectory
    t.num_turns, t.num_tool_calls, t.final_text = 2, 2, "42"
    t.calls.add(turn=1, name="python", arguments_json='{"code": "print(6*7)"}', reply="42\n", seconds=0.5)
    t.calls.add(turn=1, name="", arguments_json="{oops", reply="error: not JSON", seconds=0.1,
                error=common_pb2.TOOL_ERROR_KIND_MALFORMED)
    return row, sequence


def test_step_samples_and_tool_metrics_are_served_by_rest_and_shown_by_the_cli(redis_url: str,
                                                                              tmp_path: Path) -> None:
    row, sequence = _trajectory()
    plain = common_pb2.Sequence(id="s2", prompt_ids=[1], output_ids=[7], finish_reason=common_pb2.FINISH_REASON_LENGTH)
    stats = TrajectoryStats.of([sequence, plain])
    assert (stats.turns_per_sample, stats.tool_use_rate, stats.num_tool_calls) == (1.0, 0.5, 2)
    assert stats.tool_errors == {"malformed": 1} and stats.tool_seconds_mean == pytest.approx(0.3)
    assert not TrajectoryStats.of([plain]).has_tools

    words = {1: "<tool_call>", 2: "<|im_end|>", 3: "<tool_response>", 4: "42", 5: "done", 7: "hello",
             8: "<|im_start|>", 9: "user"}
    sequence.prompt_ids[:] = [8, 9, 2, 8]
    sequence.output_versions.extend([3, 3, -1, -1, 4])  # a tool reply's tokens have no version
    samples = [render_sample("s1", row, sequence, 1.0, lambda ids: " ".join(words[i] for i in ids), group_id="g7",
                             advantage=0.5),
               render_sample("s2", row, plain, None, lambda ids: " ".join(words[i] for i in ids))]
    assert [(s.role, s.text) for s in samples[0].segments] == [
        ("model", "<tool_call> <|im_end|>"), ("tool", "<tool_response> 42"), ("model", "done")]
    assert samples[1].segments == [SampleSegment(role="model", text="hello")] and samples[1].num_turns == 1
    # the row's text, and the prompt as the model saw it (control tokens kept)
    assert samples[0].prompt == "What is 6 * 7?"
    assert samples[0].rendered_prompt == "<|im_start|> user <|im_end|> <|im_start|>"

    store = JobStore(redis.Redis.from_url(redis_url))
    manager = JobManager(store, SharedLauncher(rollout="127.0.0.1:1", trainer="127.0.0.1:1"), "127.0.0.1:1", tmp_path)
    client = TestClient(create_app(manager, store))
    job_id = store.create(JobSpec(model_path="/m", dataset={"train_path": "/d.jsonl"})).id
    store.claim(job_id, "c")
    row_metrics = step_row(1).model_copy(update={"turns_per_sample": 1.0, "num_tool_calls": 2,
                                                 "tool_errors": {"malformed": 1}})
    state = JobProgress(step=1, version=1, prompt_epoch=0, prompt_cursor=1, group_counter=1, scheduler={})
    ProgressStore(store).commit_step(job_id, "c", progress=state, carried=[], closed_sample_ids=[],
                                     metrics=row_metrics, record_changes={"step": 1, "metrics": row_metrics},
                                     samples=samples)
    served = client.get(f"/v1/jobs/{job_id}/samples", params={"step": 1}).json()
    assert served == [s.model_dump(mode="json") for s in samples]
    assert client.get(f"/v1/jobs/{job_id}/samples").json() == served  # the latest step
    missing = client.get(f"/v1/jobs/{job_id}/samples", params={"step": 2})
    assert missing.status_code == 404 and "no samples of step 2" in missing.json()["detail"]
    assert client.get("/v1/jobs/nope/samples").status_code == 404
    assert client.get(f"/v1/jobs/{job_id}/metrics").json()[0]["tool_errors"] == {"malformed": 1}

    text = format_samples(served)
    assert "== s1  reward 1.000  turns 2  tool calls 2  (stop)" in text
    assert "tool:\n    <tool_response> 42" in text and "call (turn 1) ?({oops)  0.100s  error malformed" in text
    assert "== s2  reward failed  turns 1  tool calls 0  (length)" in text
    assert (samples[0].group_id, samples[0].advantage, samples[0].version_min, samples[0].version_max) == \
        ("g7", 0.5, 3, 4)
    assert "== s1  reward 1.000  turns 2  tool calls 2  (stop)\n   group g7  advantage +0.500  policy version 3-4\n" \
        in text
    assert "   group ?  advantage not trained  policy version ?\n" in text  # s2: no group, versions or advantage
    assert "prompt:\n    What is 6 * 7?\nrendered prompt:\n    <|im_start|> user <|im_end|> <|im_start|>\n" in text
    older = {k: v for k, v in served[0].items() if k != "rendered_prompt"}  # kept before the field was added
    assert StepSample.model_validate(older).rendered_prompt == ""
    assert "rendered prompt:" not in format_samples([older])


def test_a_tool_jobs_metrics_row_is_tracked_as_numbers() -> None:
    from everstep_controller.tracking.trackers import step_values

    row = step_row(2).model_copy(update={"turns_per_sample": 1.5, "num_tool_calls": 3,
                                         "tool_errors": {"timeout": 1, "malformed": 2}})
    values = step_values(row)
    assert values["tool_errors/timeout"] == 1.0 and values["tool_errors/malformed"] == 2.0
    assert values["turns_per_sample"] == 1.5 and "tool_errors" not in values and "step" not in values
