"""Tool calls in a model's text, in the format its chat template declares, and their arguments' check.

A format is found by what the template writes: Hermes-style `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
(Qwen2.5, Qwen3, Hermes) is the one registered; `FORMATS` takes others (Llama 3's `<|python_tag|>`, Mistral's
`[TOOL_CALLS]`) by name. Pure text and JSON: no tokenizer, no jinja2.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["FORMATS", "HermesFormat", "MalformedCall", "ParsedCall", "ToolCallFormat", "check_arguments",
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


def _call_from_json(body: str) -> ParsedCall | MalformedCall:
    try:
        value = json.loads(body)
    except json.JSONDecodeError as e:
        return MalformedCall(body, f"the tool call is not valid JSON: {e.msg} at character {e.pos}")
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return MalformedCall(body, 'a tool call is a JSON object {"name": ..., "arguments": {...}}')
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return MalformedCall(body, "the tool call's arguments are a string that is not a JSON object")
    if not isinstance(arguments, dict):
        return MalformedCall(body, "the tool call's arguments must be a JSON object")
    return ParsedCall(value["name"], arguments)


FORMATS: dict[str, ToolCallFormat] = {"hermes": HermesFormat()}


def format_for_template(template_source: str) -> str | None:
    """The registered call format the template declares, or None."""
    return next((name for name, f in FORMATS.items() if f.declared_by(template_source)), None)


_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,), "object": (dict,),
    "array": (list,), "null": (type(None),),
}


def check_arguments(parameters: dict[str, Any], arguments: dict[str, Any]) -> str | None:
    """Why `arguments` do not fit the JSON schema `parameters` (required keys, property types, extra keys when
    additionalProperties is false), or None. Not a full JSON-schema validator: the checks a model most often fails."""
    properties = parameters.get("properties") or {}
    missing = [k for k in parameters.get("required") or [] if k not in arguments]
    if missing:
        return f"missing required argument(s) {missing}"
    if parameters.get("additionalProperties") is False:
        extra = sorted(set(arguments) - set(properties))
        if extra:
            return f"unknown argument(s) {extra}; the tool takes {sorted(properties)}"
    for key, value in arguments.items():
        expected = (properties.get(key) or {}).get("type")
        names = [expected] if isinstance(expected, str) else list(expected or [])
        types = tuple(t for n in names for t in _JSON_TYPES.get(n, ()))
        if types and (not isinstance(value, types) or (isinstance(value, bool) and bool not in types)):
            return f"argument {key!r} must be of type {expected}, got {type(value).__name__}"
    return None
