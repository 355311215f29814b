"""The torch engine's scheduler: which sequence holds which KV cache slot, and what runs next. Plain Python (no
torch, no model), as vLLM v1's `core/sched` is apart from its engine core: `Engine.step` asks `schedule()` what to
run, runs it on the executor, and hands the sampled tokens to `update_from_output()`, which decides for every
sequence whether it continues, pauses for its tools or finishes.

- Admission: queued sequences take free slots, lowest first (`SlotAllocator`), so that the running set stays a
  dense prefix of the slots; when sequences leave and no queued one takes their slots, the highest ones move down
  (`SlotMove`, which the engine applies to the KV cache) so that a decode step computes no empty rows.
- Prefill: the admitted sequences, and those whose keys must be computed again (after a weight update with
  `recompute_kv_on_update`), in chunks of at most `prefill_max_tokens` padded tokens, shortest first; the last chunk
  is fused into the decode pass. A sequence's last token is never prefilled: it is the input of its next decode row.
- Prompt sharing (`share_prompt_prefill`): fresh sequences admitted together with equal prompts are prefilled once
  (the leader); the executor writes its keys and values into its copies' slots.
- Tool turns: a sequence that ends a turn with tool calls is paused in its slot; its replies are fed through its
  decode row one token per step (`forced`). Only when sequences wait for a slot and every slot is taken are paused
  sequences evicted; they queue for a prefill once their replies came.
"""

from __future__ import annotations

import collections
import heapq
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from everstep_rollout.engine.tool_turns import LiveSequence, ToolTurns
from everstep_rollout.sequence import FinishReason


class SlotAllocator:
    """Free KV cache slot numbers, lowest first."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots))
        heapq.heapify(self._free)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def lowest_free(self) -> int | None:
        return self._free[0] if self._free else None

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError("no free KV cache slot")
        return heapq.heappop(self._free)

    def release(self, slot: int) -> None:
        heapq.heappush(self._free, slot)


@dataclass(eq=False, kw_only=True)
class ScheduledSequence(LiveSequence):
    """A sequence of the torch engine: its tokens and its KV cache slot."""

    token_ids: list[int]
    """Prompt + output: the tokens its slot holds keys and values for (all but the last) or will."""
    stop_window: int
    """How many last output tokens to decode when matching stop strings."""
    slot: int = -1
    forced: collections.deque[int] = field(default_factory=collections.deque)
    """Tool-reply tokens still to feed through the decode row."""

    def append(self, token: int, logprob: float, version: int, *, tool: bool = False) -> None:
        self.token_ids.append(token)
        self.output_ids.append(token)
        self.output_logprobs.append(logprob)
        self.output_versions.append(version)
        if self.tool_mask is not None:
            self.tool_mask.append(tool)


S = TypeVar("S", bound=ScheduledSequence)


@dataclass(frozen=True)
class SlotMove:
    """Keys and values of positions 0..length-1 move from slot src to slot dst (the sequence already holds dst)."""

    src: int
    dst: int
    length: int


@dataclass(kw_only=True)
class StepPlan(Generic[S]):
    """What one step runs."""

    moves: list[SlotMove]
    """To apply to the KV cache first, in order."""
    prefill: list[S]
    """The sequences prefilled (one-token ones have no prefill row; a shared prompt's copies are not here)."""
    prefill_chunks: list[list[S]]
    """Prefill rows, chunked; the last chunk goes with the decode pass (when there is one)."""
    sharers: dict[S, list[S]]
    """A prefilled leader -> the fresh copies of its prompt, whose slots get its keys and values."""
    decode: list[S]
    """Every sequence in a slot, each one decode row (its slot); empty when only tools run."""
    waiting_for_tools: bool
    """Nothing to prefill and every sequence in a slot is paused: the engine waits for a tool reply."""
    num_prefilled: int
    """Sequences prefilled this step, the copies of a shared prompt included."""


class Scheduler(Generic[S]):
    """Decides admission, slots, prefill chunks, pauses and finishes for the torch engine; not thread safe."""

    def __init__(self, *, num_slots: int, max_seq_len: int, prefill_max_tokens: int, share_prompt_prefill: bool,
                 turns: ToolTurns, decode_text: Callable[[list[int]], str]) -> None:
        """`decode_text`: output tokens -> text, for stop strings."""
        self.max_seq_len = max_seq_len
        self.prefill_max_tokens = prefill_max_tokens
        self.share_prompt_prefill = share_prompt_prefill
        self.turns = turns
        self._decode_text = decode_text
        self.live: dict[tuple[int, str], S] = {}
        self._free_slots = SlotAllocator(num_slots)
        self._queue: collections.deque[S] = collections.deque()
        self._slots: list[S | None] = [None] * num_slots
        self._needs_prefill: list[S] = []
        self._evicted: list[S] = []
        """Paused sequences that gave up their slot (memory pressure); prefilled again after their replies."""
        self.num_tool_evictions = 0

    # -- state ------------------------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.live) - len(self._queue) - len(self._evicted)

    @property
    def num_queued(self) -> int:
        return len(self._queue)

    @property
    def num_free_slots(self) -> int:
        return self._free_slots.num_free

    @property
    def num_paused(self) -> int:
        return sum(1 for s in self.live.values() if s.paused)

    def in_slots(self) -> list[S]:
        return [s for s in self._slots if s is not None]

    # -- sequences come and go --------------------------------------------------------------------------

    def add(self, seq: S) -> FinishReason | None:
        """Queue a new or continued sequence; the reason when it is finished as it comes (its length reached, or a
        partial drained while its tools ran whose trajectory is over)."""
        if self.length_reached(seq):
            return FinishReason.LENGTH
        if self.turns.unanswered(seq) and not self.turns.end_turn(seq, counted=False):
            return FinishReason.STOP  # otherwise the drained call runs again and the sequence waits for it
        self._queue.append(seq)
        self.live[seq.key] = seq
        return None

    def remove(self, seq: S) -> None:
        """The sequence leaves (finished or drained): its slot, queue place or eviction is given up; its pending
        tool calls are cancelled."""
        del self.live[seq.key]
        self.turns.cancel(seq)
        if seq in self._evicted:
            self._evicted.remove(seq)
        elif seq.slot >= 0:
            self._slots[seq.slot] = None
            self._free_slots.release(seq.slot)
            seq.slot = -1
            if seq in self._needs_prefill:
                self._needs_prefill.remove(seq)
        else:
            self._queue.remove(seq)

    def drain(self, stream: int | None = None) -> list[S]:
        """Remove every live sequence (of `stream`, or of all streams) and return them."""
        drained = [s for s in self.live.values() if stream is None or s.request.stream == stream]
        for seq in drained:
            self.remove(seq)
        return drained

    def recompute_all(self) -> None:
        """The weights changed: every sequence in a slot is prefilled again at the next step."""
        self._needs_prefill = self.in_slots()

    # -- the step ---------------------------------------------------------------------------------------

    def take_tool_replies(self) -> list[tuple[S, FinishReason]]:
        """Sequences whose tool calls replied: their reply tokens go to the decode row (or, evicted, straight into
        the sequence, which queues for a prefill); the finished ones (the environment ended the episode, or the
        reply would not fit) are removed and returned."""
        finished = []
        for reply in self.turns.replies(self.live.values(), self.max_seq_len):
            seq = reply.seq
            if reply.finish is not None:
                self.remove(seq)
                finished.append((seq, reply.finish))
            elif seq in self._evicted:
                for token in reply.reply_ids:
                    seq.append(token, 0.0, -1, tool=True)
                self._evicted.remove(seq)
                self._queue.appendleft(seq)
            else:
                seq.forced.extend(reply.reply_ids)
        return finished

    def schedule(self) -> StepPlan[S]:
        """Evict, admit and compact; what this step prefills and decodes."""
        self._evict_paused_for_queued()
        to_prefill, self._needs_prefill = self._needs_prefill, []
        admitted = []
        while self._queue and self._free_slots.num_free:
            seq = self._queue.popleft()
            seq.slot = self._free_slots.allocate()
            self._slots[seq.slot] = seq
            admitted.append(seq)
        to_prefill += admitted
        moves = self._compact_slots()
        num_prefilled = len(to_prefill)
        decode = self.in_slots()
        waiting = not to_prefill and all(s.paused for s in decode)
        if waiting:
            decode = []
        sharers = self._shared_prompts(admitted) if self.share_prompt_prefill else {}
        followers = {f for group in sharers.values() for f in group}
        to_prefill = [s for s in to_prefill if s not in followers]
        return StepPlan(moves=moves, prefill=to_prefill, prefill_chunks=self._chunks(to_prefill), sharers=sharers,
                        decode=decode, waiting_for_tools=waiting, num_prefilled=num_prefilled)

    def update_from_output(self, decoded: Iterable[S], sampled_ids: list[int], sampled_logprobs: list[float],
                           version: int) -> list[tuple[S, FinishReason]]:
        """The decode pass sampled `sampled_ids[slot]` for every row: each sequence continues (its token, or its
        next tool-reply token, appended), pauses for its tools, or finishes (removed, and returned with why). A
        paused sequence's row recomputed its last token's keys; the token sampled is dropped."""
        finished = []
        for s in decoded:
            if s.paused:
                continue
            if s.forced:
                s.append(s.forced.popleft(), 0.0, -1, tool=True)
                reason = FinishReason.LENGTH if self.length_reached(s) else None
            else:
                token = sampled_ids[s.slot]
                s.append(token, sampled_logprobs[s.slot], version)
                reason = self._finish_reason(s, token)
                if reason == FinishReason.STOP and self.turns.end_turn(s):
                    reason = None  # paused until its tools reply
            if reason is not None:
                self.remove(s)
                finished.append((s, reason))
        return finished

    def length_reached(self, seq: S) -> bool:
        return seq.remaining(self.max_seq_len) <= 0

    def _finish_reason(self, seq: S, token: int) -> FinishReason | None:
        if token in self.turns.eos_token_ids:
            return FinishReason.STOP
        stop = seq.request.sampling.stop
        if stop:
            tail = self._decode_text(seq.output_ids[-seq.stop_window:])
            if any(s in tail for s in stop):
                return FinishReason.STOP
        return FinishReason.LENGTH if self.length_reached(seq) else None

    def _evict_paused_for_queued(self) -> None:
        """Memory pressure: sequences wait for a slot and every slot is taken; paused ones give theirs up."""
        if not self._queue or self._free_slots.num_free:
            return
        for seq in [s for s in self._slots if s is not None and s.paused][: len(self._queue)]:
            self._slots[seq.slot] = None
            self._free_slots.release(seq.slot)
            seq.slot = -1
            if seq in self._needs_prefill:
                self._needs_prefill.remove(seq)
            self._evicted.append(seq)
            self.num_tool_evictions += 1

    def _compact_slots(self) -> list[SlotMove]:
        """Move the sequences of the highest slots into free lower ones: a decode step computes every row up
        to the highest occupied slot, so holes left by finished sequences (when no queued sequence fills
        them) would cost as much as running sequences."""
        moves = []
        high = len(self._slots) - 1
        while True:
            while high >= 0 and self._slots[high] is None:
                high -= 1
            low = self._free_slots.lowest_free()
            if low is None or low > high:
                return moves
            seq = self._slots[high]
            assert seq is not None
            self._free_slots.allocate()  # takes `low`
            moves.append(SlotMove(high, low, len(seq.token_ids) - 1))
            self._slots[low], self._slots[high] = seq, None
            self._free_slots.release(high)
            seq.slot = low

    @staticmethod
    def _shared_prompts(admitted: list[S]) -> dict[S, list[S]]:
        """Fresh sequences (no output) with equal prompts, admitted together: leader -> the other copies. Prompts of
        one token have nothing to prefill."""
        groups: dict[tuple[int, ...], list[S]] = {}
        for s in admitted:
            if not s.output_ids and len(s.token_ids) > 1:
                groups.setdefault(tuple(s.token_ids), []).append(s)
        return {g[0]: g[1:] for g in groups.values() if len(g) > 1}

    def _chunks(self, sequences: list[S]) -> list[list[S]]:
        """The sequences to prefill (all but one-token ones) in chunks of at most prefill_max_tokens padded
        tokens, shortest first."""
        rows = sorted((s for s in sequences if len(s.token_ids) > 1), key=lambda s: len(s.token_ids))
        chunks = []
        while rows:
            # Rows are sorted by length, so the chunk's last row is its longest.
            n = 1
            while n < len(rows) and (n + 1) * (len(rows[n].token_ids) - 1) <= self.prefill_max_tokens:
                n += 1
            chunks.append(rows[:n])
            rows = rows[n:]
        return chunks
