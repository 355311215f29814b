"""Conversions between proto messages and the engine's dataclasses (tensors: `everstep.tensors.tensor_codec`)."""

from __future__ import annotations

from dataclasses import replace

from everstep.settings.tools import ToolSettings
from everstep.tools.calls import FORMATS
from everstep.v1 import common_pb2
from everstep_rollout.sequence import GenerationRequest, SamplingOptions, SequenceResult


def sampling_from_proto(p: common_pb2.SamplingParams) -> SamplingOptions:
    return SamplingOptions(
        temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, max_new_tokens=p.max_new_tokens,
        stop=tuple(p.stop), seed=p.seed,
        return_routed_experts=p.return_routed_experts, min_p=p.min_p,
        repetition_penalty=p.repetition_penalty if p.HasField("repetition_penalty") else 1.0,
        presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
    )


def request_from_proto(seq: common_pb2.Sequence, sampling: SamplingOptions, stream: int,
                       tools: ToolSettings | None = None, sandbox_address: str = "",
                       call_format: str = "") -> GenerationRequest:
    """The sequence's own seed, when it has one, replaces the message's. `call_format` "": Hermes (a controller that
    predates the field); one this engine cannot parse is a ValueError naming it."""
    if call_format and call_format not in FORMATS:
        raise ValueError(f"tools.call_format {call_format!r} is not a tool-call format this engine parses "
                         f"({', '.join(FORMATS)})")
    if seq.seed:
        sampling = replace(sampling, seed=seq.seed)
    return GenerationRequest(
        id=seq.id, prompt_ids=list(seq.prompt_ids), output_ids=list(seq.output_ids),
        output_logprobs=list(seq.output_logprobs), output_versions=list(seq.output_versions),
        routed_experts=bytes(seq.routed_experts), sampling=sampling, stream=stream, tools=tools,
        sandbox_address=sandbox_address, tool_call_format=call_format or "hermes",
        output_tool_mask=list(seq.output_tool_mask),
        tool_trajectory=seq.tool_trajectory if seq.HasField("tool_trajectory") else None,
    )


def result_to_proto(r: SequenceResult) -> common_pb2.Sequence:
    return common_pb2.Sequence(
        id=r.id, prompt_ids=r.prompt_ids, output_ids=r.output_ids, output_logprobs=r.output_logprobs,
        output_versions=r.output_versions, finish_reason=int(r.finish_reason), output_text=r.output_text,
        routed_experts=r.routed_experts, output_tool_mask=r.output_tool_mask, tool_trajectory=r.tool_trajectory,
    )
