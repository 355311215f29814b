"""A row's prompt as the model reads it: its messages through the model's chat template, or its text as is.

A row's prompt is a string or a list of `{role, content}` messages (verl's and TRL's conversational
`prompt`). With `prompt.format` 'chat' a string is one user message; `prompt.system`, when set, is put
first unless the row has a system message of its own (the row's wins: it was written for that row). The
messages are rendered with the model's template, ending with the assistant's turn opened, and tokenized
without adding special tokens (the template writes them). With 'raw' a string is tokenized as it is (with
the tokenizer's own special tokens, as before chat templates), and a row of messages cannot be used.
'auto' is 'chat' when the model has a chat template, else 'raw'.

What the reward service reads as the prompt (`PromptRow.prompt`) is the user's text: the string, or the
content of the last user message; never the template's text.
"""

from __future__ import annotations

from typing import Any

from tokenizers import Tokenizer

from everstep.rest.job_spec import PromptFormat, PromptSpec
from everstep.settings.tools import ToolSettings
from everstep.tools.calls import FORMATS, format_for_template
from everstep_controller.data.chat_template import ChatMessage, ChatTemplate, ChatTemplateError, read_chat_template

__all__ = ["PromptEncoder", "RowPrompt", "load_prompt_encoder", "read_row_prompt", "resolve_prompt_format",
           "tool_template", "user_content"]

RowPrompt = str | tuple[ChatMessage, ...]


class PromptEncoder:
    """Turns a row's prompt into prompt ids; `template` None: the raw format. `tools`: OpenAI function-calling tools
    the template shows the model (multi-turn tool use)."""

    def __init__(self, tokenizer: Tokenizer, template: ChatTemplate | None = None, system: str | None = None,
                 tools: list[dict[str, Any]] | None = None) -> None:
        if system is not None and template is None:
            raise ValueError("a system message needs a chat template")
        if tools is not None and template is None:
            raise ValueError("tools need a chat template")
        self.tokenizer = tokenizer
        self.template = template
        self.system = system
        self.tools = tools

    @property
    def format(self) -> PromptFormat:
        return PromptFormat.raw if self.template is None else PromptFormat.chat

    def conversation(self, prompt: RowPrompt) -> tuple[ChatMessage, ...]:
        """The messages the template renders: the row's (a string is one user message), after prompt.system."""
        messages = (ChatMessage("user", prompt),) if isinstance(prompt, str) else prompt
        if self.system is not None and not any(m.role == "system" for m in messages):
            messages = (ChatMessage("system", self.system), *messages)
        return messages

    def text(self, prompt: RowPrompt, field: str = "prompt") -> str:
        """The prompt as the model reads it; ValueError naming `field` when it cannot be rendered."""
        if self.template is None:
            if not isinstance(prompt, str):
                raise ValueError(f"field {field!r} is a list of messages, which needs a chat template; the model "
                                 "has none (prompt.format: raw)")
            return prompt
        try:
            return self.template.render(self.conversation(prompt), add_generation_prompt=True, tools=self.tools)
        except ChatTemplateError as e:
            raise ValueError(f"field {field!r}: {e}") from None

    def encode(self, prompt: RowPrompt, field: str = "prompt") -> tuple[int, ...]:
        text = self.text(prompt, field)
        # a chat template writes every control token itself (apply_chat_template: add_special_tokens=False)
        return tuple(self.tokenizer.encode(text, add_special_tokens=self.template is None).ids)


def resolve_prompt_format(spec: PromptSpec, template: ChatTemplate | None, model_path: str) -> PromptFormat:
    """'raw' or 'chat'; ValueError naming prompt.format or prompt.system when the model cannot do what they ask."""
    if spec.format == PromptFormat.chat and template is None:
        raise ValueError(f"prompt.format is 'chat' but model_path {model_path!r} has no chat template "
                         "(chat_template.jinja, or chat_template in tokenizer_config.json); use 'raw' or 'auto'")
    fmt = spec.format if spec.format != PromptFormat.auto else (
        PromptFormat.raw if template is None else PromptFormat.chat)
    if fmt == PromptFormat.raw and spec.system is not None:
        raise ValueError(f"prompt.system needs a chat template, and model_path {model_path!r} has none "
                         "(prompt.format 'auto' is 'raw' for it)")
    return fmt


def load_prompt_encoder(model_path: str, tokenizer: Tokenizer, spec: PromptSpec | None = None,
                        tools: ToolSettings | None = None) -> PromptEncoder:
    """The job's encoder: the model's template per `spec` (default: prompt.format 'auto', no system message); with
    `tools`, the template that shows them (`tool_template`)."""
    spec = spec or PromptSpec()
    if tools is not None:
        return PromptEncoder(tokenizer, tool_template(model_path, tools), spec.system,
                             [t.model_dump() for t in tools.offered()])
    template = read_chat_template(model_path) if spec.format != PromptFormat.raw else None
    if resolve_prompt_format(spec, template, model_path) == PromptFormat.raw:
        return PromptEncoder(tokenizer)
    return PromptEncoder(tokenizer, template, spec.system)


def tool_template(model_path: str, tools: ToolSettings) -> ChatTemplate:
    """The template a tool-using job renders with: tools.chat_template, else the model's own. ValueError naming it
    when it cannot show tools to the model, or writes tool calls in no format everstep parses
    (`everstep.tools.calls`)."""
    if tools.chat_template is not None:
        where = "tools.chat_template"
        template = read_chat_template(model_path, tools.chat_template)
    else:
        where = f"the chat template of model_path {model_path!r}"
        template = read_chat_template(model_path)
    if template is None:
        raise ValueError(f"tools need a chat template with tool support; model_path {model_path!r} has none "
                         "(set tools.chat_template)")
    if not template.supports_tools:
        raise ValueError(f"{where} has no tool support (it never reads `tools`); set tools.chat_template to a "
                         "template that has it, e.g. Qwen2.5's")
    if format_for_template(template.source) is None:
        raise ValueError(f"{where} writes tool calls in a format everstep cannot parse (known: "
                         f"{', '.join(FORMATS)}: Hermes-style <tool_call>...</tool_call>, Llama 3.1's JSON "
                         "{\"name\": ..., \"parameters\": ...} with the ipython role)")
    return template


def read_row_prompt(value: Any, field: str) -> RowPrompt:
    """A row's prompt: a non-empty string, or a list of {role, content} messages with a user message."""
    if isinstance(value, str):
        if not value.strip():
            raise ValueError(f"no prompt in field {field!r}")
        return value
    if value is None or (isinstance(value, list | tuple) and not value):
        raise ValueError(f"no prompt in field {field!r}")
    if not isinstance(value, list | tuple):
        raise ValueError(f"field {field!r} must be a string or a list of messages, got {type(value).__name__}")
    messages = []
    for i, message in enumerate(value):
        role = message.get("role") if isinstance(message, dict) else None
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(role, str) or not role or not isinstance(content, str):
            raise ValueError(f"{field}[{i}] must be a message {{role: string, content: string}}, got {message!r}")
        messages.append(ChatMessage(role, content))
    if not any(m.role == "user" and m.content.strip() for m in messages):
        raise ValueError(f"field {field!r} has no user message with content")
    return tuple(messages)


def user_content(prompt: RowPrompt) -> str:
    """What the reward service gets as the prompt: the string, or the last user message's content."""
    if isinstance(prompt, str):
        return prompt
    return next(m.content for m in reversed(prompt) if m.role == "user" and m.content.strip())
