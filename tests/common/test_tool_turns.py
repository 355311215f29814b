"""Tool-call parsing and tool-reply rendering (everstep.tools.calls, everstep.tools.turns): a whole conversation with
tool calls, rendered and tokenized by transformers' apply_chat_template with Qwen2.5's template (Hermes calls) and
with a template in Llama 3.1's tool format (JSON calls, the ipython role), equals the prompt, the model's turns and
our tool-reply text, token for token."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tool_fixtures import (
    LLAMA3_CONTROL_TOKENS,
    LLAMA31_STYLE_TEMPLATE,
    QWEN25_TEMPLATE,
    make_byte_level_tokenizer,
    python_call_text,
)

from everstep.settings.tools import PYTHON_TOOL, ToolSettings, from_proto, to_proto
from everstep.tools.calls import FORMATS, MalformedCall, ParsedCall, format_for_template
from everstep.tools.turns import tool_reply_text

transformers = pytest.importorskip("transformers")  # the reference

CORPUS = ["What is 123 * 456? Use the tool.", "You are a helpful assistant.", "print(123 * 456)", "56088",
          '{"name": "python", "arguments": {"code": "print(1)"}}', "Traceback NameError", "The answer is 56088."]
TOOLS = [PYTHON_TOOL.model_dump(), {"type": "function", "function": {
    "name": "lookup", "description": "Look a word up.",
    "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]}}}]


@pytest.fixture(scope="module")
def qwen_tokenizer(tmp_path_factory: pytest.TempPathFactory):
    return make_byte_level_tokenizer(tmp_path_factory.mktemp("qwen-tools"), CORPUS)


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("replies", [["56088\n"], ["56088", "no such word"]], ids=["one-call", "two-calls"])
def test_prompt_turns_and_tool_replies_equal_transformers_token_for_token(qwen_tokenizer, replies: list[str]) -> None:
    calls = [{"name": "python", "arguments": {"code": "print(123 * 456)"}},
             {"name": "lookup", "arguments": {"word": "answer"}}][: len(replies)]
    question = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "What is 123 * 456? Use the tool."}]
    call_text = "\n".join(f"<tool_call>\n{json.dumps(c)}\n</tool_call>" for c in calls)
    conversation = [*question,
                    {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": c}
                                                                        for c in calls]},
                    *[{"role": "tool", "name": c["name"], "content": r} for c, r in zip(calls, replies, strict=True)],
                    {"role": "assistant", "content": "The answer is 56088."}]
    expected = qwen_tokenizer.apply_chat_template(conversation, tools=TOOLS, tokenize=True, return_dict=False)

    def render(messages, add_generation_prompt):
        return qwen_tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    prompt = qwen_tokenizer.apply_chat_template(question, tools=TOOLS, tokenize=True, add_generation_prompt=True,
                                                return_dict=False)
    parsed = FORMATS["hermes"].parse(call_text)
    assert parsed == [ParsedCall(c["name"], c["arguments"]) for c in calls]
    first_turn = _encode(qwen_tokenizer, call_text) + [qwen_tokenizer.convert_tokens_to_ids("<|im_end|>")]
    reply = _encode(qwen_tokenizer, tool_reply_text(render, parsed, replies, end_of_turn="<|im_end|>"))
    last_turn = _encode(qwen_tokenizer, "The answer is 56088.<|im_end|>\n")
    assert prompt + first_turn + reply + last_turn == expected
    decoded = qwen_tokenizer.decode(reply)
    assert decoded.startswith("\n<|im_start|>user\n<tool_response>\n") and decoded.endswith("<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def llama_tokenizer(tmp_path_factory: pytest.TempPathFactory):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=500, special_tokens=LLAMA3_CONTROL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>",
                                                eos_token="<|eot_id|>", pad_token="<|end_of_text|>")
    fast.add_special_tokens({"additional_special_tokens": LLAMA3_CONTROL_TOKENS[2:]})
    fast.chat_template = LLAMA31_STYLE_TEMPLATE
    out = tmp_path_factory.mktemp("llama-tools")
    fast.save_pretrained(str(out))
    return transformers.AutoTokenizer.from_pretrained(str(out))


@pytest.mark.parametrize("tagged", [False, True], ids=["plain", "python-tag"])
def test_llama_json_calls_and_ipython_replies_equal_transformers_token_for_token(llama_tokenizer, tagged: bool) -> None:
    """Llama 3.1's format: the call is the whole turn, `{"name": ..., "parameters": ...}<|eot_id|>` (a model may put
    <|python_tag|> before it; the template writes none), the reply an ipython message, then the answer."""
    call = {"name": "python", "arguments": {"code": "print(123 * 456)"}}
    question = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "What is 123 * 456? Use the tool."}]
    conversation = [*question, {"role": "assistant", "content": "", "tool_calls": [{"type": "function",
                                                                                   "function": call}]},
                    {"role": "tool", "name": "python", "content": "56088\n"},
                    {"role": "assistant", "content": "The answer is 56088."}]
    expected = llama_tokenizer.apply_chat_template(conversation, tools=TOOLS, tokenize=True, return_dict=False)

    def render(messages, add_generation_prompt):
        return llama_tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False,
                                                   add_generation_prompt=add_generation_prompt)

    prompt = llama_tokenizer.apply_chat_template(question, tools=TOOLS, tokenize=True, add_generation_prompt=True,
                                                 return_dict=False)
    call_text = json.dumps({"name": call["name"], "parameters": call["arguments"]})
    llama = FORMATS[format_for_template(LLAMA31_STYLE_TEMPLATE)]
    assert llama.name == "llama3_json"
    parsed = llama.parse(("<|python_tag|>" if tagged else "") + call_text)
    assert parsed == [ParsedCall("python", call["arguments"])]
    eot = llama_tokenizer.convert_tokens_to_ids("<|eot_id|>")
    first_turn = _encode(llama_tokenizer, call_text) + [eot]
    reply = _encode(llama_tokenizer, tool_reply_text(render, parsed, ["56088\n"], end_of_turn="<|eot_id|>"))
    last_turn = _encode(llama_tokenizer, "The answer is 56088.<|eot_id|>")
    assert prompt + first_turn + reply + last_turn == expected
    decoded = llama_tokenizer.decode(reply)
    assert decoded.startswith("<|start_header_id|>ipython<|end_header_id|>\n\n")
    assert decoded.endswith("<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")


def test_llama_json_parsing_names_what_is_wrong() -> None:
    llama = FORMATS["llama3_json"]
    assert llama.parse("The answer is 42.") == []
    assert llama.parse(' {"name": "f", "parameters": {"x": 1}} ') == [ParsedCall("f", {"x": 1})]
    assert llama.parse('{"name": "f", "arguments": {"x": 1}}') == [ParsedCall("f", {"x": 1})]
    assert llama.parse('{"name": "f", "parameters": "{\\"x\\": 1}"}') == [ParsedCall("f", {"x": 1})]
    assert llama.parse('{"name": "f"}') == [ParsedCall("f", {})]
    bad_json, = llama.parse('{"name": "f", "parameters": {')
    assert isinstance(bad_json, MalformedCall) and "not valid JSON" in bad_json.reason
    no_name, = llama.parse('{"parameters": {}}')
    assert isinstance(no_name, MalformedCall) and '"parameters"' in no_name.reason
    two, = llama.parse('{"name": "f", "parameters": {}}; {"name": "g", "parameters": {}}')
    assert isinstance(two, MalformedCall) and "one call per turn" in two.reason
    tag_only, = llama.parse("<|python_tag|>print(1)")
    assert isinstance(tag_only, MalformedCall) and "JSON object" in tag_only.reason
    assert format_for_template(QWEN25_TEMPLATE) == "hermes"  # Qwen's template is Hermes, whatever else it holds


def test_hermes_parsing_names_what_is_wrong() -> None:
    hermes = FORMATS["hermes"]
    assert hermes.parse("I will just answer: 42.") == []
    assert hermes.parse(python_call_text("print(1)")) == [ParsedCall("python", {"code": "print(1)"})]
    string_args = '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>'
    assert hermes.parse(string_args) == [ParsedCall("f", {"x": 1})]
    bad_json, = hermes.parse('<tool_call>{"name": "f", "arguments": {</tool_call>')
    assert isinstance(bad_json, MalformedCall) and "not valid JSON" in bad_json.reason
    no_name, = hermes.parse('<tool_call>{"arguments": {}}</tool_call>')
    assert isinstance(no_name, MalformedCall) and "name" in no_name.reason
    unclosed, = hermes.parse('<tool_call>{"name": "f", "arguments": {}}')
    assert isinstance(unclosed, MalformedCall) and "</tool_call>" in unclosed.reason
    assert format_for_template(QWEN25_TEMPLATE) == "hermes"
    assert format_for_template("{{ messages[0]['content'] }}") is None


def test_tool_settings_round_trip_through_the_proto() -> None:
    settings = ToolSettings(environment="http", url="http://127.0.0.1:9", functions=TOOLS[1:], max_turns=3,
                            max_tool_calls=5, tool_timeout_seconds=2.5, max_tool_reply_tokens=64,
                            chat_template=QWEN25_TEMPLATE)
    assert from_proto(to_proto(settings)) == settings
    python = ToolSettings(environment="python")
    assert from_proto(to_proto(python)) == python and json.loads(python.tools_json())[0]["function"]["name"] == "python"
    with pytest.raises(ValueError, match="tools.url"):
        ToolSettings(environment="http", functions=TOOLS[1:])
    with pytest.raises(ValueError, match="tools.functions"):
        ToolSettings(environment="http", url="http://x")
    with pytest.raises(ValueError, match="tools.functions: the python environment runs one tool"):
        ToolSettings(environment="python", functions=TOOLS[1:])
    described = ToolSettings(environment="python", functions=[{"function": {
        "name": "python", "description": "Run Python.", "parameters": PYTHON_TOOL.function.parameters}}])
    assert described.offered()[0].function.description == "Run Python."


def test_the_fixture_template_is_qwen25s(tmp_path: Path) -> None:
    """The fixture renders the published Qwen2.5 tool prompt (a check that the text was copied whole)."""
    env_text = transformers.utils.chat_template_utils.render_jinja_template(
        conversations=[[{"role": "user", "content": "hi"}]], tools=TOOLS, chat_template=QWEN25_TEMPLATE,
        add_generation_prompt=True)[0][0]
    assert env_text.startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
                               "assistant.\n\n# Tools\n\nYou may call one or more functions")
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' \
        in env_text
