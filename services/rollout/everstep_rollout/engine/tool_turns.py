"""Multi-turn tool use as both engines run it (docs/tools.md): the live sequence they hold, the tool threads,
which sequences' tool calls replied and whether the reply fits their budget, and the wait when nothing runs but
tools.

A sequence that ends a model turn with tool calls is paused: its calls run on tool threads
(`everstep_rollout.tools.ToolRuntime`) while the other sequences go on. The turn itself (parsing the calls, running
them, the replies rendered by the chat template through `everstep.tools.turns`) is the sequence's
`everstep_rollout.tools.ToolSession`. What an engine does with a paused sequence stays in the engine: the torch
engine keeps its slot and feeds the reply through its decode row; the sglang engine submits the next turn.

The tool modules need grpc and protobuf, which an engine that never sees tools (benchmarks/gpu_check.py's machine
has neither) does without: they are imported at the first request with tools.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from everstep_rollout.routing import RouteBuffer
from everstep_rollout.sequence import FinishReason, GenerationRequest, SequenceResult

if TYPE_CHECKING:
    from everstep_rollout.tools import ToolRuntime, ToolSession

TOOL_POLL_SECONDS = 0.02
"""How long a step with every live sequence paused for its tools waits for a reply before it looks again (new
requests and drains are handled between steps)."""


def remaining_tokens(request: GenerationRequest, num_output: int, max_seq_len: int) -> int:
    """Tokens a sequence with `num_output` output tokens may still add: the room left in max_seq_len and, when the
    request sets max_new_tokens, in that (0 or less: its length is reached)."""
    by_length = max_seq_len - len(request.prompt_ids) - num_output
    max_new = request.sampling.max_new_tokens
    return min(by_length, max_new - num_output) if max_new > 0 else by_length


@dataclass(eq=False, kw_only=True)
class LiveSequence:
    """A sequence in an engine: its request, its output so far, its routes and its tool loop."""

    request: GenerationRequest
    output_ids: list[int]
    output_logprobs: list[float]
    output_versions: list[int]
    routes: RouteBuffer | None = None
    tools: ToolSession | None = None
    tool_mask: list[bool] | None = None
    """Per output token: True for a tool reply's tokens (None: the request has no tools)."""

    @property
    def paused(self) -> bool:
        """Waiting for its tool calls."""
        return self.tools is not None and self.tools.pending is not None

    @property
    def key(self) -> tuple[int, str]:
        return (self.request.stream, self.request.id)

    def remaining(self, max_seq_len: int) -> int:
        """Tokens it may still add (`remaining_tokens`)."""
        return remaining_tokens(self.request, len(self.output_ids), max_seq_len)

    def result(self, reason: FinishReason, tokenizer: Any) -> SequenceResult:
        r = self.request
        return SequenceResult(
            id=r.id, stream=r.stream, prompt_ids=list(r.prompt_ids), output_ids=self.output_ids,
            output_logprobs=self.output_logprobs, output_versions=self.output_versions, finish_reason=reason,
            output_text=tokenizer.decode(self.output_ids, skip_special_tokens=True),
            routed_experts=self.routes.to_bytes() if self.routes is not None else b"",
            output_tool_mask=list(self.tool_mask or []),
            tool_trajectory=self.tools.snapshot() if self.tools is not None else None,
        )


S = TypeVar("S", bound=LiveSequence)


@dataclass(frozen=True)
class ToolReply(Generic[S]):
    """A paused sequence whose tool calls replied."""

    seq: S
    reply_ids: list[int]
    """The reply's tokens, to append after the turn (empty when it finishes)."""
    finish: FinishReason | None
    """STOP: the environment ended the episode; LENGTH: the reply does not fit; None: it goes on."""


class ToolTurns:
    """An engine's tool threads (made at the first request with tools) and its paused sequences' turns. Called from
    the engine's thread only."""

    def __init__(self, *, sandbox_endpoint: str, tokenizer: Any, eos_token_ids: Iterable[int]) -> None:
        self.sandbox_endpoint = sandbox_endpoint
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self._runtime: ToolRuntime | None = None

    @property
    def runtime(self) -> ToolRuntime:
        if self._runtime is None:
            from everstep_rollout.tools import ToolRuntime

            self._runtime = ToolRuntime(self.sandbox_endpoint)
        return self._runtime

    def shutdown(self) -> None:
        """The tool threads stop (pending calls are cancelled)."""
        if self._runtime is not None:
            self._runtime.shutdown()

    def session(self, r: GenerationRequest, tool_mask: list[bool]) -> ToolSession:
        """The tool loop of a request with tools, carrying on its trajectory (a continued partial's)."""
        assert r.tools is not None
        from everstep.v1 import common_pb2
        from everstep_rollout.tools import ToolSession

        trajectory = common_pb2.ToolTrajectory()
        if r.tool_trajectory is not None:
            trajectory.CopyFrom(r.tool_trajectory)
        turn_start = max((i + 1 for i, is_tool in enumerate(tool_mask) if is_tool), default=0)
        return ToolSession(r.tools, self.runtime.client(r.tools, r.sandbox_address), self.tokenizer, trajectory,
                           turn_start=turn_start, call_format=r.tool_call_format)

    def at_end_of_turn(self, seq: LiveSequence) -> bool:
        """It has tools and its last output token is an end-of-turn token."""
        return seq.tools is not None and bool(seq.output_ids) and seq.output_ids[-1] in self.eos_token_ids

    def unanswered(self, seq: LiveSequence) -> bool:
        """A partial drained while its tools ran: its output ends with the model's end-of-turn token, not with a
        tool reply's (docs/tools.md, carry-over); `end_turn(seq, counted=False)` runs its calls again."""
        return self.at_end_of_turn(seq) and not (seq.tool_mask and seq.tool_mask[-1])

    def end_turn(self, seq: LiveSequence, *, counted: bool = True) -> bool:
        """The sequence's output ends a model turn: True when the turn made tool calls, now submitted, and the
        sequence is paused until they reply; False when its trajectory is over (or it is not at an end of turn)."""
        if not self.at_end_of_turn(seq):
            return False
        assert seq.tools is not None
        return seq.tools.end_turn(seq.output_ids, self.runtime.submit, counted=counted)

    def replies(self, sequences: Iterable[S], max_seq_len: int) -> list[ToolReply[S]]:
        """The paused sequences whose calls replied, each with its reply's tokens and whether it finishes (the
        reply must leave room for at least one more token). Their calls are recorded in their trajectories."""
        replied = []
        for seq in [s for s in sequences if s.tools is not None and s.tools.pending is not None
                    and s.tools.pending.done()]:
            assert seq.tools is not None
            end = seq.tools.take_reply(seq.output_ids)
            finish = FinishReason.STOP if end.finished else (
                FinishReason.LENGTH if len(end.reply_ids) >= seq.remaining(max_seq_len) else None)
            replied.append(ToolReply(seq, end.reply_ids, finish))
        return replied

    @staticmethod
    def wait(sequences: Iterable[LiveSequence]) -> None:
        """Nothing to run but tools: wait up to TOOL_POLL_SECONDS for one of the paused sequences' calls."""
        pending = [s.tools.pending for s in sequences if s.tools is not None and s.tools.pending is not None]
        if pending:
            concurrent.futures.wait(pending, timeout=TOOL_POLL_SECONDS, return_when=concurrent.futures.FIRST_COMPLETED)

    @staticmethod
    def cancel(seq: LiveSequence) -> bool:
        """A drained sequence's pending calls are cancelled (they run again where the partial is continued); True
        when it had some."""
        if seq.tools is None or seq.tools.pending is None:
            return False
        seq.tools.pending.cancel()
        seq.tools.pending = None
        return True

    def close(self, seq: LiveSequence, reason: FinishReason) -> None:
        """The sequence leaves the engine: a finished trajectory lets its environment forget it (an aborted one is
        continued elsewhere)."""
        if seq.tools is not None and reason != FinishReason.ABORTED:
            seq.tools.close(self.runtime.submit)
