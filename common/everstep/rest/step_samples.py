"""What a step's samples were, as people read them (`GET /v1/jobs/{id}/samples?step=N`, `everstep samples`): each
trajectory as its turns (the model's text and the tools' replies, decoded with the template's control tokens), its
tool calls and its reward. Single-turn jobs have one model segment per sample."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["SAMPLES_PER_STEP", "SampleSegment", "StepSample", "ToolCallView"]

SAMPLES_PER_STEP = 16
"""Samples kept per step (the first ones of the step's trained groups)."""


class SampleSegment(BaseModel):
    model_config = ConfigDict(frozen=True)
    role: Literal["model", "tool"] = Field(description="'model': tokens the model wrote; 'tool': a tool's reply "
                                                       "with the template's wrapper tokens (not trained).")
    text: str


class ToolCallView(BaseModel):
    model_config = ConfigDict(frozen=True)
    turn: int = Field(description="The model turn that made the call (1 for the first).")
    name: str = Field(description="The tool called ('' when the call could not be parsed).")
    arguments: str = Field(description="The arguments as JSON (the call's text when it could not be parsed).")
    reply: str = Field(description="What went back to the model.")
    error: str = Field(description="'none', or the error kind: malformed, unknown_tool, bad_arguments, timeout, "
                                   "unavailable, limit, environment.")
    seconds: float
    truncated: bool


class StepSample(BaseModel):
    model_config = ConfigDict(frozen=True)
    sample_id: str
    prompt: str = Field(description="The row's prompt (the user's text).")
    rendered_prompt: str = Field(default="", description="The prompt as the model saw it: the row's prompt rendered "
                                                         "with the chat template (the system turn, the tools' "
                                                         "definitions, the generation prompt), decoded with its "
                                                         "control tokens ('' in samples kept before it was added).")
    segments: list[SampleSegment]
    final_answer: str = Field(description="What the verifiers scored as the answer (the last model turn).")
    reward: float | None = Field(description="None when the sample's reward failed.")
    num_turns: int
    tool_calls: list[ToolCallView] = Field(default_factory=list)
    finish_reason: str = Field(description="stop or length.")
    engine: str = Field(default="", description="The address of the rollout engine of the job's pool that decoded "
                                                "the sample last (a carried-over sample may have started on another).")
    group_id: str = Field(default="", description="The sample's group: the G samples of one prompt share it, and "
                                                  "its advantage is measured against them.")
    advantage: float | None = Field(default=None, description="The advantage it was trained with; None when it "
                                                              "was not trained (its group left out, or truncated "
                                                              "with algorithm.mask_truncated_completions).")
    kl_penalty: float | None = Field(default=None, description="trainer.kl_in_reward: the KL penalty subtracted from "
                                                               "its reward before the advantages (the coefficient "
                                                               "times its summed KL to the reference); None "
                                                               "without, or when its group was left out.")
    version_min: int | None = Field(default=None, description="The oldest policy version that sampled its tokens "
                                                              "(output_versions; tool tokens left out).")
    version_max: int | None = Field(default=None, description="The newest: above version_min for a sample carried "
                                                              "over (C3PO++) or decoded across a weight swap.")
