"""The tools demo's tokenizer: byte-level BPE (any text round-trips: code, JSON, a sandbox's stderr) with
Qwen2.5's control tokens and chat template, so it can express tool calls the way Qwen2.5-Instruct does.

Digits are split one per token (as Qwen's and Llama 3's tokenizers do), so a number is copied digit by digit.
The merges are learned from the warm start's own conversations (`build_tokenizer`), so the fixed system turn
that lists the tools takes a few dozen tokens instead of hundreds. `<|im_end|>` is the end of a turn (eos).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

__all__ = ["CHAT_TEMPLATE", "CONTROL_TOKENS", "TOOL_TAGS", "build_tokenizer", "save_tokenizer"]

PAD, BOS, EOT, START = "<|endoftext|>", "<|endoftext|>", "<|im_end|>", "<|im_start|>"
CONTROL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TOOL_TAGS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
"""Single tokens, as in Qwen2.5's vocabulary (ids 0..6 here)."""

CHAT_TEMPLATE = (
    "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n    {%- if messages[0]['role'] == 'syste"
    "m' %}\n        {{- messages[0]['content'] }}\n    {%- else %}\n        {{- 'You are Qwen, cre"
    'ated by Alibaba Cloud. You are a helpful assistant.\' }}\n    {%- endif %}\n    {{- "\\n\\n# To'
    'ols\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provid'
    'ed with function signatures within <tools></tools> XML tags:\\n<tools>" }}\n    {%- for tool'
    ' in tools %}\n        {{- "\\n" }}\n        {{- tool | tojson }}\n    {%- endfor %}\n    {{- "\\'
    'n</tools>\\n\\nFor each function call, return a json object with function name and arguments'
    ' within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"argu'
    'ments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}\n{%- else %}\n    {%- if messages'
    "[0]['role'] == 'system' %}\n        {{- '<|im_start|>system\\n' + messages[0]['content'] + '"
    "<|im_end|>\\n' }}\n    {%- else %}\n        {{- '<|im_start|>system\\nYou are Qwen, created by"
    " Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}\n    {%- endif %}\n{%- endif %}"
    '\n{%- for message in messages %}\n    {%- if (message.role == "user") or (message.role == "s'
    'ystem" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}\n'
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }"
    '}\n    {%- elif message.role == "assistant" %}\n        {{- \'<|im_start|>\' + message.role }}'
    "\n        {%- if message.content %}\n            {{- '\\n' + message.content }}\n        {%- e"
    'ndif %}\n        {%- for tool_call in message.tool_calls %}\n            {%- if tool_call.fu'
    'nction is defined %}\n                {%- set tool_call = tool_call.function %}\n           '
    ' {%- endif %}\n            {{- \'\\n<tool_call>\\n{"name": "\' }}\n            {{- tool_call.nam'
    'e }}\n            {{- \'", "arguments": \' }}\n            {{- tool_call.arguments | tojson }}'
    "\n            {{- '}\\n</tool_call>' }}\n        {%- endfor %}\n        {{- '<|im_end|>\\n' }}\n"
    '    {%- elif message.role == "tool" %}\n        {%- if (loop.index0 == 0) or (messages[loop'
    '.index0 - 1].role != "tool") %}\n            {{- \'<|im_start|>user\' }}\n        {%- endif %}'
    "\n        {{- '\\n<tool_response>\\n' }}\n        {{- message.content }}\n        {{- '\\n</tool"
    '_response>\' }}\n        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}\n '
    "           {{- '<|im_end|>\\n' }}\n        {%- endif %}\n    {%- endif %}\n{%- endfor %}\n{%- i"
    "f add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n"
)
"""Qwen/Qwen2.5-0.5B-Instruct's `chat_template`, as published (tools in the system turn, Hermes calls, replies in
the tool role as `<tool_response>` blocks of a user turn)."""


def build_tokenizer(corpus: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE of ``vocab_size`` tokens (control tokens and tool tags first) trained on ``corpus``."""
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])  # merges may span spaces
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[*CONTROL_TOKENS, *TOOL_TAGS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    core.train_from_iterator(corpus, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token=EOT, pad_token=PAD, bos_token=None, unk_token=None,
        additional_special_tokens=[START, *TOOL_TAGS], padding_side="left", clean_up_tokenization_spaces=False,
        model_max_length=2048)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, out: Path) -> None:
    tokenizer.save_pretrained(out)
