"""Typed requests and results that cross the engine boundary (the gRPC layer converts them to and from
proto `everstep.v1.Sequence`)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from everstep.settings.tools import ToolSettings

if TYPE_CHECKING:  # protobuf only where tools are used (benchmarks/gpu_check.py's machine has none)
    from everstep.v1 import common_pb2


class FinishReason(enum.IntEnum):
    """Why a sequence left the engine; values equal proto `everstep.v1.FinishReason`."""

    STOP = 1  # EOS token or a stop string
    LENGTH = 2  # max_new_tokens or the engine's max_seq_len reached
    ABORTED = 3  # drained: a partial rollout that may be continued


@dataclass(frozen=True, kw_only=True)
class SamplingOptions:
    """Per-sequence sampling parameters."""

    temperature: float = 1.0
    """0 means greedy (argmax); otherwise logits are divided by it before sampling."""
    top_p: float = 1.0
    """Nucleus filtering mass; 0 or 1 disables it."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 disables it."""
    max_new_tokens: int = 0
    """Total output tokens of the sequence, earlier continuations included; 0: only max_seq_len limits."""
    stop: tuple[str, ...] = ()
    """Stop strings, matched on the decoded output text (the tokens that complete one are kept)."""
    seed: int = 0
    """0: the engine's seeded generator; otherwise a private generator seeded with this value."""
    return_routed_experts: bool = False
    """Routing replay: record the experts every position was routed to (`SequenceResult.routed_experts`). An
    engine that serves a dense model or cannot record routes refuses it (ValueError naming it)."""
    min_p: float = 0.0
    """Keep tokens whose probability is at least min_p x the top token's, after top-k/top-p; 0 disables it."""
    repetition_penalty: float = 1.0
    """CTRL's penalty on tokens already in the output: positive logits / r, negative logits * r; 1 disables it."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token already in the output."""
    frequency_penalty: float = 0.0
    """Times a token's count in the output, subtracted from its logit."""

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 <= self.top_p <= 1:
            raise ValueError(f"top_p must be in [0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")

    @property
    def penalized(self) -> bool:
        """Whether any repetition, presence or frequency penalty is on."""
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0


@dataclass(kw_only=True)
class GenerationRequest:
    """A prompt to generate from, or a partial rollout to continue (output_* non-empty)."""

    id: str
    """Caller-chosen id, unique among the live sequences of one stream."""
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    """Tokens generated earlier (possibly by older policy versions); generation continues after them."""
    output_logprobs: list[float] = field(default_factory=list)
    """log pi_infer of each earlier output token, carried through unchanged."""
    output_versions: list[int] = field(default_factory=list)
    """Policy version of each earlier output token, carried through unchanged."""
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    routed_experts: bytes = b""
    """Routes of the earlier positions (a carried-over rollout; `everstep_rollout.routing`): kept as they are,
    only later positions are recorded. Read only with sampling.return_routed_experts."""
    stream: int = 0
    """Which client stream submitted it; `Engine.drain(stream=...)` selects by it."""
    tools: ToolSettings | None = None
    """Multi-turn tool use (docs/tools.md); None: one turn, as before."""
    sandbox_address: str = ""
    """The python tool's sandbox ("": the engine's --sandbox-endpoint)."""
    tool_call_format: str = "hermes"
    """How the model writes tool calls (`everstep.tools.calls.FORMATS`; ToolConfig.call_format)."""
    output_tool_mask: list[bool] = field(default_factory=list)
    """True on each earlier output token that a tool wrote (empty: none did)."""
    tool_trajectory: common_pb2.ToolTrajectory | None = None
    """The tool loop's state carried with a partial (None: a new trajectory)."""

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError(f"sequence {self.id!r}: prompt_ids is empty")
        if self.output_tool_mask and len(self.output_tool_mask) != len(self.output_ids):
            raise ValueError(f"sequence {self.id!r}: output_tool_mask has {len(self.output_tool_mask)} entries for "
                             f"{len(self.output_ids)} output tokens")
        n = len(self.output_ids)
        if len(self.output_logprobs) != n or len(self.output_versions) != n:
            raise ValueError(
                f"sequence {self.id!r}: output_ids, output_logprobs and output_versions differ in length "
                f"({n}, {len(self.output_logprobs)}, {len(self.output_versions)})"
            )


@dataclass(kw_only=True)
class SequenceResult:
    """Everything generated for one sequence so far; returned once, finished or drained."""

    id: str
    stream: int
    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    """log_softmax(logits / T) of each sampled token before top-k/top-p (T = 1 when greedy)."""
    output_versions: list[int]
    """Engine policy version when each output token was generated."""
    finish_reason: FinishReason
    output_text: str = ""
    """tokenizer.decode(output_ids, skip_special_tokens=True)."""
    output_tool_mask: list[bool] = field(default_factory=list)
    """With tools: True on each output token a tool wrote (log-prob 0, version -1); empty without tools."""
    tool_trajectory: common_pb2.ToolTrajectory | None = None
    """With tools: the tool loop's state (turns, calls, the final turn's text)."""
    routed_experts: bytes = b""
    """With sampling.return_routed_experts: uint8 expert ids [position][moe layer][k] of every position the model
    took as input, len(prompt_ids) + len(output_ids) - 1 of them once the sequence ran (one drained before its
    first forward pass holds only what it was sent with); each position's first routes (`everstep_rollout.routing`)."""
