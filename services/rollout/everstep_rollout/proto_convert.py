"""Conversions between proto messages and the engine's dataclasses and tensors."""

from __future__ import annotations

from dataclasses import replace

import torch

from everstep.v1 import common_pb2
from everstep_rollout.sequence import GenerationRequest, SamplingOptions, SequenceResult


def sampling_from_proto(p: common_pb2.SamplingParams) -> SamplingOptions:
    return SamplingOptions(
        temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, max_new_tokens=p.max_new_tokens,
        stop=tuple(p.stop), seed=p.seed,
    )


def request_from_proto(seq: common_pb2.Sequence, sampling: SamplingOptions, stream: int) -> GenerationRequest:
    """The sequence's own seed, when it has one, replaces the message's."""
    if seq.seed:
        sampling = replace(sampling, seed=seq.seed)
    return GenerationRequest(
        id=seq.id, prompt_ids=list(seq.prompt_ids), output_ids=list(seq.output_ids),
        output_logprobs=list(seq.output_logprobs), output_versions=list(seq.output_versions),
        sampling=sampling, stream=stream,
    )


def result_to_proto(r: SequenceResult) -> common_pb2.Sequence:
    return common_pb2.Sequence(
        id=r.id, prompt_ids=r.prompt_ids, output_ids=r.output_ids, output_logprobs=r.output_logprobs,
        output_versions=r.output_versions, finish_reason=int(r.finish_reason), output_text=r.output_text,
    )


def tensor_from_proto(t: common_pb2.Tensor) -> torch.Tensor:
    """Raw little-endian bytes -> a tensor that owns a copy of them."""
    dtype = getattr(torch, t.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"tensor {t.name!r}: unknown dtype {t.dtype!r}")
    shape = tuple(t.shape)
    expected = torch.Size(shape).numel() * dtype.itemsize
    if len(t.data) != expected:
        raise ValueError(f"tensor {t.name!r}: {len(t.data)} bytes, expected {expected} for {t.dtype}{list(shape)}")
    if expected == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(t.data), dtype=torch.uint8).view(dtype).reshape(shape)


def tensor_to_proto(name: str, tensor: torch.Tensor) -> common_pb2.Tensor:
    t = tensor.detach().contiguous().cpu()
    data = t.reshape(-1).view(torch.uint8).numpy().tobytes()
    return common_pb2.Tensor(name=name, dtype=str(t.dtype).removeprefix("torch."), shape=list(t.shape), data=data)
