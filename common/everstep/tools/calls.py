"""Tool calls in a model's text, in the format its chat template declares (their arguments' check:
`everstep.tools.schemas`).

A format is found by what the template writes. Registered: Hermes-style
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen2.5, Qwen3, Hermes), and Llama 3.1/3.2's JSON tool
calls, a turn that is one object `{"name": ..., "parameters": {...}}` (optionally after `<|python_tag|>`), whose
replies come back in the `ipython` role. `FORMATS` takes others (Mistral's `[TOOL_CALLS]`) by name. Pure text and
JSON: no tokenizer, no jinja2.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["FORMATS", "HermesFormat", "LlamaJsonFormat", "MalformedCall", "ParsedCall", "ToolCallFormat",
           "format_for_template"]


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: dict[str, Any]

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


@dataclass(frozen=True)
class MalformedCall:
    """Text that opens a tool call but is not one: the reason goes back to the model."""

    text: str
    reason: str


class ToolCallFormat(Protocol):
    name: str

    def declared_by(self, template_source: str) -> bool:
        """Whether a chat template writes tool calls in this format."""
        ...

    def parse(self, text: str) -> list[ParsedCall | MalformedCall]:
        """The calls of one model turn, in order; [] when the turn calls nothing."""
        ...


class HermesFormat:
    """`<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`, one block per call."""

    name = "hermes"
    _BLOCK = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)

    def declared_by(self, template_source: str) -> bool:
        return "<tool_call>" in template_source

    def parse(self, text: str) -> list[ParsedCall | MalformedCall]:
        calls: list[ParsedCall | MalformedCall] = []
        for match in self._BLOCK.finditer(text):
            body, closed = match.group(1).strip(), bool(match.group(2))
            if not closed:
                calls.append(MalformedCall(body, "the tool call has no closing </tool_call>"))
                continue
            calls.append(_call_from_json(body))
        return calls


class LlamaJsonFormat:
    """Llama 3.1/3.2 with custom tools: the whole turn is one JSON object `{"name": "f", "parameters": {...}}`, maybe
    after `<|python_tag|>`; the template renders an assistant's `tool_calls` that way and tool replies in the
    `ipython` role (one call per turn: the template refuses more). A turn that does not start with `{` (or the tag) is
    an answer; one that starts so but is not one such object is a malformed call."""

    name = "llama3_json"
    _TAG = "<|python_tag|>"

    def declared_by(self, template_source: str) -> bool:
        # what Meta's templates write: the call's "parameters" key and the ipython role's header
        return '"parameters": ' in template_source and "ipython" in template_source

    def parse(self, text: str) -> list[ParsedCall | MalformedCall]:
        body = text.strip()
        tagged = body.startswith(self._TAG)
        if tagged:
            body = body[len(self._TAG):].strip()
        if not body.startswith("{"):
            return [MalformedCall(body, 'after <|python_tag|> comes a JSON object {"name": ..., "parameters": '
                                        '{...}}')] if tagged else []
        try:
            value, end = json.JSONDecoder().raw_decode(body)
        except json.JSONDecodeError as e:
            return [MalformedCall(body, f"the tool call is not valid JSON: {e.msg} at character {e.pos}")]
        if body[end:].strip():
            return [MalformedCall(body, "a tool call turn is one JSON object and nothing after it (one call per "
                                        "turn)")]
        return [_call_from_value(body, value, "parameters")]


def _call_from_json(body: str) -> ParsedCall | MalformedCall:
    try:
        value = json.loads(body)
    except json.JSONDecodeError as e:
        return MalformedCall(body, f"the tool call is not valid JSON: {e.msg} at character {e.pos}")
    return _call_from_value(body, value, "arguments")


def _call_from_value(body: str, value: Any, key: str) -> ParsedCall | MalformedCall:
    """`key`: where the format puts the arguments ("arguments"; Llama's "parameters", which also takes the other)."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return MalformedCall(body, f'a tool call is a JSON object {{"name": ..., "{key}": {{...}}}}')
    arguments = value.get(key, value.get("arguments", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return MalformedCall(body, "the tool call's arguments are a string that is not a JSON object")
    if not isinstance(arguments, dict):
        return MalformedCall(body, "the tool call's arguments must be a JSON object")
    return ParsedCall(value["name"], arguments)


FORMATS: dict[str, ToolCallFormat] = {"hermes": HermesFormat(), "llama3_json": LlamaJsonFormat()}
"""By name, in the order `format_for_template` tries them."""


def format_for_template(template_source: str) -> str | None:
    """The registered call format the template declares, or None."""
    return next((name for name, f in FORMATS.items() if f.declared_by(template_source)), None)

