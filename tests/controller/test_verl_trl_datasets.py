"""verl's and TRL's dataset files read as they are: Parquet in exactly their schemas (nested struct columns,
prompts as list<struct<role, content>>), fields by dotted path, rendered with a chat template; a field the
file lacks is refused before any row is read (a 422 naming it at POST /v1/jobs); over-long rows skipped."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import redis
from fastapi.testclient import TestClient
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

from everstep.rest.job_spec import DatasetSpec, JobSpec
from everstep_controller.api.app import create_app
from everstep_controller.data.dataset import RowFields, load_prompt_rows, load_tokenizer
from everstep_controller.data.dataset_columns import DatasetFieldError, check_dataset_fields
from everstep_controller.data.prompt_rendering import PromptEncoder, load_prompt_encoder
from everstep_controller.launchers.shared import SharedLauncher
from everstep_controller.run.job_data import load_job_data
from everstep_controller.run.manager import JobManager
from everstep_controller.store.job_store import JobStore

# Qwen2-Instruct's template (Qwen/Qwen2-0.5B-Instruct's tokenizer_config.json), as in test_chat_template.py
TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful assistant.<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
QUESTIONS = ["Natalia sold 48 clips . How many ?", "What is 2 + 3 ?", "A very long question " + "and more " * 30 + "?"]
ANSWERS = ["72", "5", "7"]

# verl's schema, as examples/data_preprocess/gsm8k.py writes it
VERL_SCHEMA = pa.schema([
    ("data_source", pa.string()),
    ("prompt", pa.list_(pa.struct([("content", pa.string()), ("role", pa.string())]))),
    ("ability", pa.string()),
    ("reward_model", pa.struct([("ground_truth", pa.string()), ("style", pa.string())])),
    ("extra_info", pa.struct([("answer", pa.string()), ("index", pa.int64()), ("question", pa.string()),
                              ("split", pa.string())])),
])
MESSAGES = pa.list_(pa.struct([("content", pa.string()), ("role", pa.string())]))


def _verl_parquet(path: Path) -> Path:
    rows = [{"data_source": "openai/gsm8k", "prompt": [{"content": q, "role": "user"}], "ability": "math",
             "reward_model": {"ground_truth": a, "style": "rule"},
             "extra_info": {"answer": f"... #### {a}", "index": i, "question": q, "split": "train"}}
            for i, (q, a) in enumerate(zip(QUESTIONS, ANSWERS, strict=True))]
    pq.write_table(pa.Table.from_pylist(rows, schema=VERL_SCHEMA), path)
    return path


def _trl_parquet(path: Path, *, conversational: bool, answer_column: str) -> Path:
    """TRL's prompt-only formats: a `prompt` string (standard) or list of messages (conversational), plus the
    reference the reward function reads (`answer` or `solution`)."""
    prompts = [[{"content": q, "role": "user"}] for q in QUESTIONS] if conversational else QUESTIONS
    table = pa.table({"prompt": pa.array(prompts, type=MESSAGES if conversational else pa.string()),
                      answer_column: pa.array(ANSWERS)})
    pq.write_table(table, path)
    return path


@pytest.fixture
def chat_model(tmp_path: Path) -> Path:
    """A model directory as the controller reads it: tokenizer.json and tokenizer_config.json with a template."""
    model = tmp_path / "chat-model"
    model.mkdir()
    words = ["<unk>", "user", "assistant", "system"] + sorted({w for q in QUESTIONS for w in q.split()})
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken("<|im_start|>", special=True), AddedToken("<|im_end|>", special=True)])
    tok.save(str(model / "tokenizer.json"))
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, "eos_token": "<|im_end|>"}))
    return model


def _encoder(model: Path) -> PromptEncoder:
    return load_prompt_encoder(str(model), load_tokenizer(str(model)))


def _check_rows(loaded, encoder: PromptEncoder) -> None:  # noqa: ANN001
    assert [(r.prompt, r.answer) for r in loaded.rows] == list(zip(QUESTIONS, ANSWERS, strict=True))
    im_start = encoder.tokenizer.token_to_id("<|im_start|>")
    for row in loaded.rows:
        assert row.prompt_ids[0] == im_start and row.prompt_ids.count(im_start) == 3  # system, user, assistant
        assert encoder.text(row.row_prompt).endswith(f"<|im_start|>user\n{row.prompt}<|im_end|>\n"
                                                     "<|im_start|>assistant\n")


def test_verl_parquet_is_read_with_the_answer_at_a_dotted_path(tmp_path: Path, chat_model: Path) -> None:
    path = _verl_parquet(tmp_path / "train.parquet")
    encoder = _encoder(chat_model)
    loaded = load_prompt_rows(str(path), encoder, fields=RowFields(answer="reward_model.ground_truth"))
    _check_rows(loaded, encoder)
    assert loaded.rows[0].messages[0].role == "user" and loaded.num_skipped == 0
    check_dataset_fields(DatasetSpec(train_path=str(path), answer_field="reward_model.ground_truth"))


@pytest.mark.parametrize(("conversational", "answer_column"), [(False, "solution"), (True, "answer"),
                                                                (True, "solution")])
def test_trl_parquet_is_read(tmp_path: Path, chat_model: Path, conversational: bool, answer_column: str) -> None:
    path = _trl_parquet(tmp_path / "train.parquet", conversational=conversational, answer_column=answer_column)
    encoder = _encoder(chat_model)
    loaded = load_prompt_rows(str(path), encoder, fields=RowFields(answer=answer_column))
    _check_rows(loaded, encoder)
    assert bool(loaded.rows[0].messages) == conversational


def test_a_job_spec_reads_verl_data_through_load_job_data(tmp_path: Path, chat_model: Path) -> None:
    path = _verl_parquet(tmp_path / "train.parquet")
    spec = JobSpec(model_path=str(chat_model), prompt={"system": "Be brief."},
                   dataset={"train_path": str(path), "answer_field": "reward_model.ground_truth"})
    data = load_job_data(spec)
    assert [r.answer for r in data.train.rows] == ANSWERS
    assert data.train.rows[0].prompt == QUESTIONS[0]  # what the reward service gets: the user's text
    row = data.train.rows[0]
    encoder = load_prompt_encoder(str(chat_model), load_tokenizer(str(chat_model)), spec.prompt)
    assert row.prompt_ids == encoder.encode(row.row_prompt) != _encoder(chat_model).encode(row.row_prompt)
    # prompt.system in place of the template's default system message
    assert encoder.text(row.row_prompt).startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n")


def test_missing_fields_are_named_before_any_row_is_read(tmp_path: Path) -> None:
    verl = str(_verl_parquet(tmp_path / "train.parquet"))
    with pytest.raises(DatasetFieldError, match=r"dataset.answer_field 'answer' and dataset.tests_field 'tests'.*"
                                                r"a verl file: set answer_field: reward_model.ground_truth") as e:
        check_dataset_fields(DatasetSpec(train_path=verl))
    assert e.value.setting == "answer_field" and "reward_model.ground_truth" in str(e.value)
    with pytest.raises(DatasetFieldError, match=r"dataset.answer_field names 'reward_model.truth'") as e:
        check_dataset_fields(DatasetSpec(train_path=verl, answer_field="reward_model.truth"))
    with pytest.raises(DatasetFieldError, match=r"dataset.prompt_field names 'question'") as e:
        check_dataset_fields(DatasetSpec(train_path=verl, prompt_field="question",
                                         answer_field="reward_model.ground_truth"))
    # a field named other than by default must be there even when optional; defaults of optional fields need not,
    # also in a spec read back from the job store (where every field is set)
    stored = DatasetSpec(train_path=verl, answer_field="reward_model.ground_truth")
    check_dataset_fields(DatasetSpec.model_validate_json(stored.model_dump_json()))
    with pytest.raises(DatasetFieldError, match=r"dataset.language_field names 'lang'") as e:
        check_dataset_fields(DatasetSpec(train_path=verl, answer_field="reward_model.ground_truth",
                                         language_field="lang"))
    assert e.value.setting == "language_field"
    trl = str(_trl_parquet(tmp_path / "trl.parquet", conversational=True, answer_column="solution"))
    with pytest.raises(DatasetFieldError, match="a TRL file: set answer_field: solution"):
        check_dataset_fields(DatasetSpec(train_path=verl, answer_field="reward_model.ground_truth", eval_path=trl))
    # JSONL: a field is there when some row has it, nested objects by dotted path
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text('{"q": "1 + 1 ="}\nnot json\n{"q": "2 + 2 =", "meta": {"gt": "4"}}\n')
    check_dataset_fields(DatasetSpec(train_path=str(jsonl), prompt_field="q", answer_field="meta.gt"))
    with pytest.raises(DatasetFieldError, match=r"dataset.answer_field names 'meta.answer', which no row of .*"
                                                r"has \(it has fields q, meta, meta.gt\)"):
        check_dataset_fields(DatasetSpec(train_path=str(jsonl), prompt_field="q", answer_field="meta.answer"))


def test_a_job_whose_file_lacks_a_field_fails_at_load_naming_it(tmp_path: Path, chat_model: Path) -> None:
    """The same check when the job loads its data (a file written after submission, a job taken over)."""
    path = _verl_parquet(tmp_path / "train.parquet")
    spec = JobSpec(model_path=str(chat_model), dataset={"train_path": str(path)})
    with pytest.raises(DatasetFieldError, match="set answer_field: reward_model.ground_truth"):
        load_job_data(spec)
    raw_model = tmp_path / "raw-model"
    raw_model.mkdir()
    (raw_model / "tokenizer.json").write_text((chat_model / "tokenizer.json").read_text())
    with pytest.raises(ValueError, match="prompt.format is 'chat' but model_path .* has no chat template"):
        load_job_data(JobSpec(model_path=str(raw_model), prompt={"format": "chat"},
                              dataset={"train_path": str(path), "answer_field": "reward_model.ground_truth"}))


def test_submission_with_a_missing_field_is_a_422_naming_it(redis_url: str, tmp_path: Path,
                                                            chat_model: Path) -> None:
    store = JobStore(redis.Redis.from_url(redis_url))
    manager = JobManager(store, SharedLauncher(rollout="127.0.0.1:1", trainer="127.0.0.1:1"), "127.0.0.1:1", tmp_path)
    client = TestClient(create_app(manager, store))
    verl = str(_verl_parquet(tmp_path / "train.parquet"))
    spec = {"model_path": str(chat_model), "dataset": {"train_path": verl, "answer_field": "reward_model.truth"}}
    response = client.post("/v1/jobs", json=spec)
    assert response.status_code == 422, response.text
    (error,) = response.json()["detail"]
    assert error["loc"] == ["body", "dataset", "answer_field"] and "reward_model.truth" in error["msg"]

    no_template = tmp_path / "raw-model"
    no_template.mkdir()
    (no_template / "tokenizer.json").write_text((chat_model / "tokenizer.json").read_text())
    response = client.post("/v1/jobs", json={"model_path": str(no_template), "prompt": {"format": "chat"},
                                             "dataset": {"train_path": verl}})
    assert response.status_code == 422 and response.json()["detail"][0]["loc"] == ["body", "prompt", "format"]
    response = client.post("/v1/jobs", json={"model_path": str(no_template), "prompt": {"system": "Be brief."},
                                             "dataset": {"train_path": verl}})
    assert response.status_code == 422 and response.json()["detail"][0]["loc"] == ["body", "prompt", "system"]

    response = client.post("/v1/jobs", json={"model_path": str(chat_model), "prompt": {"format": "raw",
                                             "system": "Be brief."}, "dataset": {"train_path": verl}})
    assert response.status_code == 422 and "prompt.system needs a chat template" in response.text

    broken = tmp_path / "broken-template"
    broken.mkdir()
    (broken / "tokenizer.json").write_text((chat_model / "tokenizer.json").read_text())
    (broken / "chat_template.jinja").write_text("{% for message in messages %}{{ message['content'] }}")
    response = client.post("/v1/jobs", json={"model_path": str(broken), "dataset": {"train_path": verl}})
    assert response.status_code == 422 and response.json()["detail"][0]["loc"] == ["body", "model_path"]
    assert "the chat template does not compile" in response.json()["detail"][0]["msg"]

    spec["dataset"]["answer_field"] = "reward_model.ground_truth"
    assert client.post("/v1/jobs", json=spec).status_code == 201
    # files that are not there yet are left to the job's load (which fails the job with the cause)
    assert client.post("/v1/jobs", json={"model_path": "/no/model", "prompt": {"format": "chat"},
                                         "dataset": {"train_path": "/no/train.parquet"}}).status_code == 201


def test_rows_longer_than_max_prompt_tokens_are_skipped_and_counted(tmp_path: Path, chat_model: Path) -> None:
    path = _verl_parquet(tmp_path / "train.parquet")
    encoder = _encoder(chat_model)
    fields = RowFields(answer="reward_model.ground_truth")
    lengths = [len(r.prompt_ids) for r in load_prompt_rows(str(path), encoder, fields=fields).rows]
    limit = sorted(lengths)[1]  # the longest row is over it
    loaded = load_prompt_rows(str(path), encoder, fields=fields, max_prompt_tokens=limit)
    assert [r.index for r in loaded.rows] == [0, 1] and loaded.num_skipped == 1
    assert loaded.skipped[0].index == 2
    assert loaded.skipped[0].reason == f"prompt is {lengths[2]} tokens, more than max_prompt_tokens ({limit})"
    with pytest.raises(ValueError, match=r"no usable rows \(3 skipped, e.g. row 0: prompt is"):
        load_prompt_rows(str(path), encoder, fields=fields, max_prompt_tokens=1)
    # the user's dataset.max_prompt_length skips the same rows, named in the reason, before the model's limit
    loaded = load_prompt_rows(str(path), encoder, fields=fields, max_prompt_length=limit, max_prompt_tokens=1000)
    assert [r.index for r in loaded.rows] == [0, 1] and loaded.num_skipped == 1
    assert loaded.skipped[0].reason == f"prompt is {lengths[2]} tokens, more than dataset.max_prompt_length ({limit})"


def test_malformed_messages_skip_their_row(tmp_path: Path, chat_model: Path) -> None:
    path = tmp_path / "rows.jsonl"
    rows = [{"prompt": [{"role": "user", "content": "What is 2 + 3 ?"}], "answer": "5"},
            {"prompt": [{"role": "user"}], "answer": "1"},
            {"prompt": [{"role": "system", "content": "Be brief."}], "answer": "1"},
            {"prompt": [], "answer": "1"},
            {"prompt": {"role": "user", "content": "x"}, "answer": "1"},
            {"prompt": [{"role": "user", "content": [{"type": "text", "text": "x"}]}], "answer": "1"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    loaded = load_prompt_rows(str(path), _encoder(chat_model))
    assert [r.index for r in loaded.rows] == [0]
    reasons = {s.index: s.reason for s in loaded.skipped}
    assert "prompt[0] must be a message {role: string, content: string}" in reasons[1]
    assert "field 'prompt' has no user message" in reasons[2]
    assert "no prompt in field 'prompt'" in reasons[3]
    assert "must be a string or a list of messages, got dict" in reasons[4]
    assert "prompt[0] must be a message" in reasons[5]
    # the raw format (a model without a template) cannot render messages: such rows are skipped with the cause
    raw = PromptEncoder(load_tokenizer(str(chat_model)))
    with pytest.raises(ValueError, match="list of messages, which needs a chat template"):
        load_prompt_rows(str(path), raw)
