"""The `tools` section of a job spec, declared once: the tools the model may call, where they run, and the limits of
the tool loop. The controller's job spec composes it; `to_proto`/`from_proto` carry it to the rollout engine in
`GenerateRequest.tools` (`everstep.v1.ToolConfig`). See docs/tools.md.

Importable without torch and without jinja2 (pydantic and the proto stubs only).
"""

from __future__ import annotations

import json
from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from everstep.tools.schemas import ToolSchemaError, check_parameters_schema

__all__ = ["PYTHON_TOOL", "ToolEnvironment", "ToolFunction", "ToolSettings", "ToolSpec", "from_proto", "to_proto"]


class ToolEnvironment(StrEnum):
    """Where the model's tool calls run."""

    python = "python"
    """The built-in `python` tool: the code runs in the sandbox service, stdout and stderr come back."""
    http = "http"
    """An environment over HTTP (reset / step / close; docs/tools.md)."""


class ToolFunction(BaseModel):
    """An OpenAI function definition: what the chat template shows the model."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, pattern=r"^[A-Za-z_][A-Za-z0-9_.-]*$", description="The function's name.")
    description: str = Field(default="", description="What it does, for the model.")
    parameters: dict[str, Any] = Field(
        default_factory=lambda: {"type": "object", "properties": {}},
        description="JSON schema (Draft 2020-12) of its arguments, of type 'object'; refused when invalid or when it "
                    "uses what the validator cannot check (docs/tools.md#argument-schemas).")

    @model_validator(mode="after")
    def _check_parameters(self) -> ToolFunction:
        try:
            check_parameters_schema(self.parameters)
        except ToolSchemaError as e:
            raise ValueError(f"tool {self.name!r}: {e}") from None
        return self


class ToolSpec(BaseModel):
    """An OpenAI function-calling tool: `{type: function, function: {name, description, parameters}}`."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["function"] = Field(default="function", description="Always 'function'.")
    function: ToolFunction


PYTHON_TOOL = ToolSpec(function=ToolFunction(
    name="python",
    description="Run a Python program and return what it prints (stdout, then stderr). Use print() to see values.",
    parameters={"type": "object", "properties": {"code": {"type": "string", "description": "The program."}},
                "required": ["code"]},
))


class ToolSettings(BaseModel):
    """Multi-turn tool use: the model calls tools between its turns; the replies become part of its context."""

    model_config = ConfigDict(extra="forbid")
    environment: ToolEnvironment = Field(description="'python' (the sandbox) or 'http' (an environment server).")
    url: str = Field(default="", description="http: the environment's base URL (POST {url}/reset, /step, /close).")
    functions: list[ToolSpec] = Field(
        default_factory=list,
        description="The tools offered to the model, OpenAI function-calling form. python: empty means the "
                    "built-in `python` tool; http: required (what the environment's step accepts).")
    max_turns: int = Field(default=4, ge=1, description="Model turns per trajectory; the last one gets no tool reply.")
    max_tool_calls: int = Field(default=8, ge=1, description="Tool calls per trajectory; later calls get an error.")
    tool_timeout_seconds: float = Field(default=10.0, gt=0, allow_inf_nan=False,
                                        description="Longest wait for one tool reply (then an error reply).")
    max_tool_reply_tokens: int = Field(default=256, ge=8,
                                       description="Tokens of one tool reply; longer ones are cut and say so.")
    language: str = Field(default="python", min_length=1, description="python: the sandbox language the code runs in.")
    chat_template: str | None = Field(
        default=None, description="A chat template with tool support to use instead of the model's own (Jinja).")

    @model_validator(mode="after")
    def _check(self) -> ToolSettings:
        if self.environment == ToolEnvironment.http:
            if not self.url.startswith(("http://", "https://")):
                raise ValueError("tools.url: an http environment needs its base URL (http://HOST:PORT)")
            if not self.functions:
                raise ValueError("tools.functions: an http environment needs the tools it accepts")
        else:
            if self.url:
                raise ValueError("tools.url: only an http environment has a URL")
            if [t.function.name for t in self.functions] not in ([], ["python"]):
                raise ValueError("tools.functions: the python environment runs one tool, python(code); leave "
                                 "functions empty, or describe that one tool in your own words")
        names = [t.function.name for t in self.functions]
        if len(set(names)) != len(names):
            raise ValueError(f"tools.functions: names must differ, got {names}")
        return self

    def offered(self) -> list[ToolSpec]:
        """The tools the template shows the model."""
        if self.environment == ToolEnvironment.python and not self.functions:
            return [PYTHON_TOOL]
        return list(self.functions)

    def tools_json(self) -> str:
        return json.dumps([t.model_dump() for t in self.offered()])


def to_proto(settings: ToolSettings, *, sandbox_address: str = "", call_format: str = "hermes"):  # noqa: ANN201
    """`everstep.v1.ToolConfig` for the rollout engine; `call_format` from the chat template (`tool_calls`)."""
    from everstep.v1 import common_pb2

    return common_pb2.ToolConfig(
        tools_json=settings.tools_json(), environment=settings.environment.value, url=settings.url,
        sandbox_address=sandbox_address, max_turns=settings.max_turns, max_tool_calls=settings.max_tool_calls,
        tool_timeout_seconds=settings.tool_timeout_seconds, max_tool_reply_tokens=settings.max_tool_reply_tokens,
        call_format=call_format, chat_template=settings.chat_template or "", language=settings.language)


def from_proto(config: Any) -> ToolSettings:
    """The settings a ToolConfig carries (ValueError naming the field on a bad one)."""
    functions = [ToolSpec.model_validate(t) for t in json.loads(config.tools_json or "[]")]
    if config.environment == ToolEnvironment.python and functions == [PYTHON_TOOL]:
        functions = []  # the built-in tool, as `offered()` sends it
    return ToolSettings(
        environment=ToolEnvironment(config.environment), url=config.url, functions=functions,
        max_turns=config.max_turns, max_tool_calls=config.max_tool_calls,
        tool_timeout_seconds=config.tool_timeout_seconds, max_tool_reply_tokens=config.max_tool_reply_tokens,
        language=config.language or "python", chat_template=config.chat_template or None)
