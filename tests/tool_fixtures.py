"""Test fixtures for tool use: Qwen2.5-Instruct's chat template (tools included) and a tiny deterministic model.

QWEN25_TEMPLATE is the `chat_template` of Qwen/Qwen2.5-0.5B-Instruct's tokenizer_config.json as published
(transformers ships no tool template offline, so its text is written here).

`make_successor_model` builds a real Llama checkpoint whose greedy next token depends only on the current one:
attention and MLP outputs are zero (o_proj, down_proj), so the last hidden state is the normalised embedding, a
scaled one-hot vector, and lm_head maps token i to `successor[i]`. Greedy decoding then writes a chosen text, a tool
call included, through the real engine, executors and KV cache.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

QWEN25_TEMPLATE = (
    "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n    {%- else %}\n"
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n    {%- endif %}\n"
    "    {{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are "
    "provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}\n"
    "    {%- for tool in tools %}\n        {{- \"\\n\" }}\n        {{- tool | tojson }}\n    {%- endfor %}\n"
    "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\\n' }}\n    {%- endif %}\n{%- endif %}\n{%- for message in messages %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or "
    "(message.role == \"assistant\" and not message.tool_calls) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n            {{- '\\n' + message.content }}\n        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n            {%- endif %}\n"
    "            {{- '\\n<tool_call>\\n{\"name\": \"' }}\n            {{- tool_call.name }}\n"
    "            {{- '\", \"arguments\": ' }}\n            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n        {%- endfor %}\n        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == \"tool\" %}\n"
    "        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}\n"
    "            {{- '<|im_start|>user' }}\n        {%- endif %}\n        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n"
    "            {{- '<|im_end|>\\n' }}\n        {%- endif %}\n    {%- endif %}\n{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n"
)

# A chat template written here (not Meta's text) in the tool format of Llama 3.1/3.2-Instruct's published template:
# "Environment: ipython" and the tools (tojson, indent 4) with an instruction in the first user message; an
# assistant's tool call rendered as the whole turn `{"name": ..., "parameters": <arguments|tojson>}<|eot_id|>`, one
# call per turn; tool replies in the `ipython` role (a mapping or, as Meta's `is iterable` test also admits, a string
# through tojson). The markers `format_for_template` looks for are the published template's.
LLAMA31_STYLE_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- if not tools is defined %}{%- set tools = none %}{%- endif %}\n"
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {%- set system_message = messages[0]['content'] | trim %}\n"
    "    {%- set messages = messages[1:] %}\n"
    "{%- else %}\n"
    "    {%- set system_message = '' %}\n"
    "{%- endif %}\n"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}\n"
    "{%- if tools is not none %}{{- 'Environment: ipython\\n' }}{%- endif %}\n"
    "{{- 'Cutting Knowledge Date: December 2023\\nToday Date: 26 Jul 2024\\n\\n' }}\n"
    "{{- system_message + '<|eot_id|>' }}\n"
    "{%- if tools is not none %}\n"
    "    {%- set first_user = messages[0]['content'] | trim %}\n"
    "    {%- set messages = messages[1:] %}\n"
    "    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' }}\n"
    "    {{- 'Given the following functions, please respond with a JSON for a function call with its proper "
    "arguments that best answers the given prompt.\\n\\n' }}\n"
    "    {{- 'Respond in the format {\"name\": function name, \"parameters\": dictionary of argument name and its "
    "value}. Do not use variables.\\n\\n' }}\n"
    "    {%- for t in tools %}{{- t | tojson(indent=4) }}{{- '\\n\\n' }}{%- endfor %}\n"
    "    {{- first_user + '<|eot_id|>' }}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if message.role == 'assistant' and message.tool_calls is defined and message.tool_calls %}\n"
    "        {%- if message.tool_calls | length != 1 %}"
    "{{- raise_exception('This model only supports single tool-calls at once!') }}{%- endif %}\n"
    "        {%- set call = message.tool_calls[0].function %}\n"
    "        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "        {{- '{\"name\": \"' + call.name + '\", ' }}{{- '\"parameters\": ' }}{{- call.arguments | tojson }}"
    "{{- '}' }}\n"
    "        {{- '<|eot_id|>' }}\n"
    "    {%- elif message.role == 'tool' or message.role == 'ipython' %}\n"
    "        {{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' }}\n"
    "        {%- if message.content is mapping or message.content is iterable %}{{- message.content | tojson }}"
    "{%- else %}{{- message.content }}{%- endif %}\n"
    "        {{- '<|eot_id|>' }}\n"
    "    {%- else %}\n"
    "        {{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content | trim + "
    "'<|eot_id|>' }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}\n"
)
LLAMA3_CONTROL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                         "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"]

CONTROL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOOL_TAGS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

# The words of the successor model's vocabulary (a whitespace-split word-level tokenizer): the tool call the
# model writes is `<tool_call> {"name": "python", "arguments": {"code": "print(6*7)"}} </tool_call> <|im_end|>`,
# as the Qwen2.5 template renders a call to python with that code, split at whitespace.
CALL_WORDS = ["<tool_call>", '{"name":', '"python",', '"arguments":', '{"code":', '"print(6*7)"}}', "</tool_call>",
              "<|im_end|>"]
WORDS = ["<pad>", "<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", *TOOL_TAGS[:1], *TOOL_TAGS[1:],
         "system", "user", "assistant", "S", "U", "go", "call", "42", "done", "answer", *CALL_WORDS[1:6],
         '"calculate",', '{"expression":', '"6*7"}}']


# The same for a model with the Llama 3.1-style template: its call `{"name": "python", "parameters": {"code":
# "print(6*7)"}} <|eot_id|>` split at whitespace, and the python tool's reply "42\n" as that template renders it.
LLAMA_CALL_WORDS = ['{"name":', '"python",', '"parameters":', '{"code":', '"print(6*7)"}}', "<|eot_id|>"]
LLAMA_WORDS = ["<pad>", "<unk>", *LLAMA3_CONTROL_TOKENS, "system", "user", "assistant", "ipython", "S", "U", "done",
               *LLAMA_CALL_WORDS[:-1], '"42\\n"']


@dataclass(frozen=True)
class Vocabulary:
    """A word-level tokenizer's words and roles."""

    words: list[str]
    eos: str
    bos: str
    fallback: str
    """The successor of every word the model's chain does not list."""
    special: list[str]
    """Added as special tokens (never split)."""


QWEN_VOCABULARY = Vocabulary(WORDS, eos="<|im_end|>", bos="<|endoftext|>", fallback="<|endoftext|>",
                             special=["<|im_start|>", *TOOL_TAGS])
LLAMA_VOCABULARY = Vocabulary(LLAMA_WORDS, eos="<|eot_id|>", bos="<|begin_of_text|>", fallback="<|end_of_text|>",
                              special=LLAMA3_CONTROL_TOKENS[2:])


def python_call_text(code: str = "print(6*7)") -> str:
    return f'<tool_call>\n{json.dumps({"name": "python", "arguments": {"code": code}})}\n</tool_call>'


def make_byte_level_tokenizer(out: Path, corpus: list[str]):  # noqa: ANN201 - a transformers tokenizer
    """A byte-level BPE tokenizer (any text encodes) trained on `corpus`, with Qwen2.5's control tokens, tool tags
    and chat template, saved to `out` and loaded back as transformers loads a model's."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=500, special_tokens=CONTROL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>", *TOOL_TAGS]})
    fast.chat_template = QWEN25_TEMPLATE
    fast.save_pretrained(str(out))
    return transformers.AutoTokenizer.from_pretrained(str(out))


def _save_tokenizer(out: Path, template: str, vocabulary: Vocabulary = QWEN_VOCABULARY) -> dict[str, int]:
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(vocabulary.words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=vocabulary.eos, pad_token="<pad>",
                                                unk_token="<unk>", bos_token=vocabulary.bos)
    fast.add_special_tokens({"additional_special_tokens": vocabulary.special})
    fast.chat_template = template
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out)
    return vocab


def make_tool_moe_model(out: Path, *, hidden: int = 64) -> Path:
    """A random Qwen3-MoE model (8 experts, top-2) with the tool tokenizer and Qwen2.5's template: its routes are
    recorded (routing replay); its text is random."""
    import torch
    import transformers

    vocab = _save_tokenizer(out, QWEN25_TEMPLATE)
    config = transformers.Qwen3MoeConfig(
        vocab_size=len(vocab), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, max_position_embeddings=512,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=hidden, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], bos_token_id=vocab["<|endoftext|>"],
        eos_token_id=vocab["<|im_end|>"], pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(out)
    return out


def make_successor_model(out: Path, successor: dict[str, str | dict[str, float]], *,
                         template: str = QWEN25_TEMPLATE, hidden: int = 64,
                         vocabulary: Vocabulary = QWEN_VOCABULARY) -> Path:
    """A Llama model directory whose greedy decoding maps word -> successor[word] (words not listed go to the
    vocabulary's fallback, <|endoftext|> for WORDS), with a word-level tokenizer over the vocabulary's words (WORDS
    by default) and `template` as its chat template. A successor given as {word: logit} branches: sampling picks
    among those words by their logits (the others get logit 0)."""
    import torch
    import transformers

    vocab = _save_tokenizer(out, template, vocabulary)
    assert len(vocab) <= hidden, "one embedding dimension per word"
    config = transformers.LlamaConfig(
        vocab_size=len(vocab), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, bos_token_id=vocab[vocabulary.bos],
        eos_token_id=vocab[vocabulary.eos], pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.copy_(torch.eye(len(vocab), hidden))
        head = torch.zeros(len(vocab), hidden)
        for word, i in vocab.items():
            after = successor.get(word, vocabulary.fallback)
            for target, logit in ({after: 20.0} if isinstance(after, str) else after).items():
                head[vocab[target], i] = logit
        model.lm_head.weight.copy_(head)
        model.model.norm.weight.fill_(1.0)
    model.save_pretrained(out)
    return out
