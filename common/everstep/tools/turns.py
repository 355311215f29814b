"""A tool reply's tokens as the chat template renders them, appended after a model turn.

The model's turn ends with its end-of-turn token (Qwen's `<|im_end|>`); what follows in the conversation that
transformers' `apply_chat_template` renders is the template's text after that token (Qwen: a newline), the tool
messages in the template's tool role, and the next assistant turn opened. We render a stand-in conversation once
without and once with the tool messages (verl's way) and take the difference, so that prompt + model tokens + this
text tokenize as transformers tokenizes the whole conversation (tests/common/test_tool_turns.py checks it token for
token). `render(messages, add_generation_prompt)` is the caller's: the rollout engine's tokenizer renders with the
job's tools, the controller's Jinja renderer the same.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from everstep.tools.calls import MalformedCall, ParsedCall

__all__ = ["Render", "ToolTemplateError", "tool_reply_text"]

Render = Callable[[list[dict[str, Any]], bool], str]
"""(messages, add_generation_prompt) -> the template's text."""

# The stand-in history: its text cancels out; only what follows the assistant's end of turn is kept.
_HISTORY: list[dict[str, Any]] = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]


class ToolTemplateError(ValueError):
    """The template does not render tool replies as an append-only continuation."""


def _assistant(calls: Sequence[ParsedCall | MalformedCall]) -> dict[str, Any]:
    tool_calls = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}} if isinstance(
        c, ParsedCall) else {"type": "function", "function": {"name": "invalid", "arguments": {}}} for c in calls]
    return {"role": "assistant", "content": "", "tool_calls": tool_calls}


def tool_reply_text(render: Render, calls: Sequence[ParsedCall | MalformedCall], replies: Sequence[str],
                    end_of_turn: str) -> str:
    """The text that follows the model's end-of-turn token: the template's rest of the assistant turn, one tool
    message per reply (in the order of `calls`), and the next assistant turn opened."""
    if len(calls) != len(replies):
        raise ValueError(f"{len(calls)} calls but {len(replies)} replies")
    assistant = _assistant(calls)
    tools = [{"role": "tool", "name": c.name if isinstance(c, ParsedCall) else "invalid", "content": r}
             for c, r in zip(calls, replies, strict=True)]
    without = render([*_HISTORY, assistant], False)
    with_replies = render([*_HISTORY, assistant, *tools], True)
    if not with_replies.startswith(without):
        raise ToolTemplateError("the chat template renders the conversation before a tool reply differently once the "
                                "reply is added; tool replies cannot be appended token by token")
    end = without.rfind(end_of_turn) if end_of_turn else -1
    trailer = without[end + len(end_of_turn):] if end >= 0 else ""
    return trailer + with_replies[len(without):]
