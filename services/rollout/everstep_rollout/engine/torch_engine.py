"""The torch generation engine: a KV cache, continuous batching and in-place weight updates.

`Engine.step()` is one iteration of schedule -> execute -> update: queued sequences are admitted into
free KV cache slots, and one forward pass prefills them and decodes one token for every running sequence
(the joining ones included); sequences that hit EOS, a stop string or their length limit leave (their slot
is reused at the next step). The model runs in an executor (`everstep_rollout.executor`): our native one
for Llama, Qwen2, Qwen3 and Qwen3-MoE models, or transformers' own modeling code for any other causal LM.

Per-token log-probabilities (`output_logprobs`): log_softmax(logits / T) of the sampled token, in
float32, over the full vocabulary BEFORE top-k/top-p filtering, with T the sequence's temperature
(T = 1 for greedy, temperature 0). Every output token records the engine's policy version at the step
that generated it (`output_versions`).

Routing replay (`SamplingOptions.return_routed_experts`, MoE models on the native executor): after every forward
pass the routes the executor recorded for a requesting sequence's positions (its prefill rows, and its decode
row's input token) go into the sequence's `RouteBuffer`, which keeps each position's first routes (those it was
sent with, then those computed first): a re-prefill or a KV recompute after a weight swap adds only positions
beyond them. See `everstep_rollout.routing`.

Multi-turn tool use (`GenerationRequest.tools`, docs/tools.md): when a sequence ends a turn with tool calls
(`everstep_rollout.tools.ToolSession`), it is paused in its slot with its KV cache kept while the calls run on tool
threads; the other sequences go on decoding. A paused sequence's decode row recomputes its last token's keys (the
same values) and its sampled token is dropped. When the replies come, their tokens are fed through its decode row,
one per step (`_Sequence.forced`): the history is never prefilled again. Only when sequences wait for a slot and
every slot is taken are paused sequences evicted (`num_tool_evictions`); they are prefilled again once their
replies came. Tool tokens are marked in `output_tool_mask`, with log-prob 0 and version -1.

Prompt sharing (`EngineConfig.share_prompt_prefill`, the RL case of G samples per prompt): fresh sequences (no
output yet) admitted in the same step with the same prompt token ids are prefilled once. The first of them (the
leader) is prefilled as any sequence is (in the decode pass, or a prefill pass before it), and the executor writes
its keys and values into the other copies' slots too (`ForwardBatch.prefill_copies`), before any decode row
attends; its routed experts for the prompt positions go to every copy that records them. Every copy then decodes
in its own row with its own sampling. A continued (carried-over, re-admitted or recomputed) sequence is
never shared, nor are copies that arrive in different steps. All sequences of an engine run on the same weights
(adapters are merged into them), so equal prompt ids mean equal keys and values.

A prefilled sequence's last token is not prefilled: it is the input of the next decode step, so new,
continued and recomputed sequences join the decode batch the same way. The engine is not thread safe;
`EngineLoop` drives it from one thread.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from everstep.model_config import MAX_ROUTED_EXPERTS, position_limit
from everstep_rollout.config import EngineConfig
from everstep_rollout.engine.interface import QueueFullError, StepStats
from everstep_rollout.engine.sampling import SamplingBatch, sample
from everstep_rollout.engine.throughput import ThroughputWindow
from everstep_rollout.engine.tool_turns import LiveSequence, ToolTurns
from everstep_rollout.executor import ExecutorOptions, ForwardBatch, build_executor
from everstep_rollout.kv_cache import SlotAllocator
from everstep_rollout.model_files import read_config, read_eos_token_ids
from everstep_rollout.routing import RouteBuffer, check_routed_experts
from everstep_rollout.sequence import FinishReason, GenerationRequest, SequenceResult

log = logging.getLogger(__name__)

_THROUGHPUT_WINDOW_SECONDS = 10.0
# Stop strings are matched on the decoded last (longest stop string + this many) output tokens: every
# text token decodes to at least one character, so a stop string that the last token completed lies
# inside that window; decoding the whole output every step would cost O(length) per token.
_STOP_WINDOW_EXTRA_TOKENS = 8


@dataclass(eq=False, kw_only=True)
class _Sequence(LiveSequence):
    token_ids: list[int]
    """Prompt + output: the tokens its slot holds keys and values for (all but the last) or will."""
    generator: torch.Generator | None
    stop_window: int
    slot: int = -1
    forced: collections.deque[int] = field(default_factory=collections.deque)
    """Tool-reply tokens still to feed through the decode row."""


class Engine:
    """Continuous-batching generation over one Hugging Face causal LM; see the module docstring."""

    def __init__(self, model_dir: str | Path, config: EngineConfig | None = None) -> None:
        from transformers import AutoTokenizer

        self.config = config or EngineConfig()
        self.model_dir = Path(model_dir)
        model_config = read_config(self.model_dir)
        device = torch.device(self.config.device)
        self.executor = build_executor(self.model_dir, model_config, self.config.executor, ExecutorOptions(
            num_slots=self.config.max_running, max_seq_len=self.config.max_seq_len,
            dtype=self.config.torch_dtype, device=device, quantization=self.config.quantization,
        ))
        self.weights = self.executor.weights
        self.max_seq_len = self.executor.max_seq_len
        self.position_limit = position_limit(model_config) or 0
        self.executor_name = self.executor.name
        self.architecture = self.executor.model_type
        self.vocab_size = self.executor.vocab_size
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.eos_token_ids = read_eos_token_ids(self.model_dir, model_config)
        self.version = self.config.version
        self.routing_shape = self.executor.routing_shape
        self._routes_refusal = self._why_no_routes()
        self._device = device
        self._generator = torch.Generator(device=device).manual_seed(self.config.seed)
        self._free_slots = SlotAllocator(self.config.max_running)
        self._queue: collections.deque[_Sequence] = collections.deque()
        self._slots: list[_Sequence | None] = [None] * self.config.max_running
        self._live: dict[tuple[int, str], _Sequence] = {}
        self._needs_prefill: list[_Sequence] = []
        self._finished_on_add: list[SequenceResult] = []
        self._throughput = ThroughputWindow(window_seconds=_THROUGHPUT_WINDOW_SECONDS)
        self._turns = ToolTurns(sandbox_endpoint=self.config.sandbox_endpoint, tokenizer=self.tokenizer,
                                eos_token_ids=self.eos_token_ids)
        self._evicted: list[_Sequence] = []
        """Paused sequences that gave up their slot (memory pressure); prefilled again after their replies."""
        self.num_tool_evictions = 0
        self.num_prefilled_total = 0
        """Sequences prefilled since the start (admitted, re-admitted after an eviction, or recomputed)."""
        self.num_prefill_tokens_total = 0
        """Positions written by prefill passes since the start (every prefilled sequence's tokens but its last)."""
        self.num_prefill_tokens_shared_total = 0
        """Prompt positions not prefilled because a copy of the prompt was (`share_prompt_prefill`)."""
        self.last_step: StepStats | None = None
        log.info(
            "loaded %s (%s, %s executor, %d parameters, %s, quantization %s, weights %.1f MiB on %s); "
            "KV cache %d slots x %d tokens, %.1f MiB",
            self.model_dir, self.executor.model_type, type(self.executor).__name__, self.num_parameters,
            self.config.dtype, self.config.quantization.value, self.weights.num_bytes / 2**20, device,
            self.config.max_running, self.max_seq_len, self.executor.cache_bytes / 2**20,
        )

    @property
    def num_parameters(self) -> int:
        return self.weights.num_parameters

    def _why_no_routes(self) -> str | None:
        """Why this engine cannot return routed experts (None: it can)."""
        if self.executor_name == "transformers":
            return (f"the transformers executor, which serves {self.model_dir} ({self.architecture}), cannot record "
                    "routes; routing replay needs the native executor (a Qwen3-MoE model)")
        shape = self.routing_shape
        if shape is None:
            return f"{self.model_dir} ({self.architecture}) is a dense model: it has no experts to route to"
        if shape.num_experts > MAX_ROUTED_EXPERTS:
            return (f"{self.model_dir} has {shape.num_experts} experts; routed expert ids travel as uint8 "
                    f"(at most {MAX_ROUTED_EXPERTS} experts)")
        return None

    def shutdown(self) -> None:
        """The tool threads stop; the weights and cache are freed with the engine."""
        self._turns.shutdown()

    # -- state ------------------------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self._live) - len(self._queue) - len(self._evicted)

    @property
    def num_queued(self) -> int:
        return len(self._queue)

    @property
    def has_work(self) -> bool:
        return bool(self._live or self._finished_on_add)

    def tokens_per_second(self) -> float:
        """Tokens generated per second over the last 10 seconds."""
        return self._throughput.tokens_per_second(time.monotonic())

    # -- requests ---------------------------------------------------------------------------------------

    def add(self, requests: Iterable[GenerationRequest]) -> None:
        """Queue requests (all or none).

        Raises ValueError on a request whose (stream, id) is already live, whose tokens fall outside
        the vocabulary or whose prompt plus max_new_tokens exceeds max_seq_len (it would be cut short and
        reported as LENGTH though max_new_tokens was not reached), and QueueFullError when more than
        max_queued sequences would wait for a slot.
        """
        requests = list(requests)
        keys = [(r.stream, r.id) for r in requests]
        duplicates = {k for k in keys if k in self._live} | {k for k in keys if keys.count(k) > 1}
        if duplicates:
            raise ValueError(f"sequence ids already in flight: {sorted(k[1] for k in duplicates)[:5]}")
        vocab = self.vocab_size
        for r in requests:
            if r.sampling.return_routed_experts:
                if self._routes_refusal is not None:
                    raise ValueError(f"sequence {r.id!r}: return_routed_experts refused: {self._routes_refusal}")
                shape = self.routing_shape
                assert shape is not None
                check_routed_experts(r.id, r.routed_experts, num_layers=len(shape.moe_layers), top_k=shape.top_k,
                                     num_positions=len(r.prompt_ids) + len(r.output_ids) - 1)
            if any(not 0 <= t < vocab for t in (*r.prompt_ids, *r.output_ids)):
                raise ValueError(f"sequence {r.id!r}: token id outside the vocabulary [0, {vocab})")
            if len(r.prompt_ids) + r.sampling.max_new_tokens > self.max_seq_len:
                raise ValueError(
                    f"sequence {r.id!r}: prompt ({len(r.prompt_ids)} tokens) + max_new_tokens "
                    f"({r.sampling.max_new_tokens}) exceeds the engine's max_seq_len ({self.max_seq_len})")
        # The next step moves the head of the queue into the free slots; the rest waits.
        would_wait = max(0, len(self._queue) + len(requests) - self._free_slots.num_free)
        if would_wait > self.config.max_queued:
            raise QueueFullError(
                f"rollout queue full: {len(self._queue)} sequences queued, {len(requests)} more requested, "
                f"max_queued={self.config.max_queued}, {self._free_slots.num_free} free slots"
            )
        for r in requests:
            seq = self._new_sequence(r)
            if self._length_reached(seq):
                self._finished_on_add.append(self._result(seq, FinishReason.LENGTH))
            elif self._turns.unanswered(seq):  # a partial drained while its tool ran: the call runs again
                if self._turns.end_turn(seq, counted=False):
                    self._queue.append(seq)
                    self._live[seq.key] = seq
                else:
                    self._finished_on_add.append(self._result(seq, FinishReason.STOP))
            else:
                self._queue.append(seq)
                self._live[seq.key] = seq

    def _new_sequence(self, r: GenerationRequest) -> _Sequence:
        generator = None
        if r.sampling.seed:
            generator = torch.Generator(device=self._device).manual_seed(r.sampling.seed)
        stop_window = max((len(s) for s in r.sampling.stop), default=0) + _STOP_WINDOW_EXTRA_TOKENS
        routes = None
        if r.sampling.return_routed_experts and self.routing_shape is not None:
            # Room for the whole sequence when max_new_tokens bounds it; it grows otherwise.
            length = len(r.prompt_ids) + (r.sampling.max_new_tokens or len(r.output_ids) + 64)
            routes = RouteBuffer(len(self.routing_shape.moe_layers), self.routing_shape.top_k, r.routed_experts,
                                 capacity=min(length, self.max_seq_len))
        tools = tool_mask = None
        if r.tools is not None:
            tool_mask = list(r.output_tool_mask) or [False] * len(r.output_ids)
            tools = self._turns.session(r, tool_mask)
        return _Sequence(
            request=r, token_ids=[*r.prompt_ids, *r.output_ids], output_ids=list(r.output_ids),
            output_logprobs=list(r.output_logprobs), output_versions=list(r.output_versions),
            generator=generator, stop_window=stop_window, routes=routes, tools=tools, tool_mask=tool_mask,
        )

    def drain(self, stream: int | None = None) -> list[SequenceResult]:
        """Remove every unfinished sequence (of `stream`, or of all streams) and return it as ABORTED."""
        drained = [s for s in self._live.values() if stream is None or s.request.stream == stream]
        for seq in drained:
            self._remove(seq)
        return [self._result(s, FinishReason.ABORTED) for s in drained]

    def _remove(self, seq: _Sequence) -> None:
        del self._live[seq.key]
        self._turns.cancel(seq)
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

    # -- weights ----------------------------------------------------------------------------------------

    def update_weights(self, named_tensors: Mapping[str, torch.Tensor], version: int, *,
                       may_keep: bool = False) -> int:
        """Copy Hugging Face-named tensors into the existing parameters (in place) and set the version.

        Any subset of the parameters may be given; a tied model accepts either embedding name. Raises
        ValueError (nothing changed) on unknown names or shape mismatches. Returns the bytes copied.
        `may_keep`: the tensors stay unchanged while the engine uses them (a one-copy shm push), so the weights
        they hold in the engine's dtype and layout run on them without a copy (`WeightStore.adopt`; 0 bytes copied
        when all do); a later copying update first takes them back into the engine's own memory.
        """
        with torch.no_grad():
            if may_keep:
                num_bytes = self.weights.adopt(named_tensors)
            else:
                num_bytes = self.weights.copy_in(named_tensors, require_all=False)
        self.version = version
        if self.config.recompute_kv_on_update:
            self._needs_prefill = [s for s in self._slots if s is not None]
        return num_bytes

    # -- the step ---------------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[SequenceResult]:
        """Admit, prefill, decode one token for every running sequence; return the sequences that finished."""
        start = time.perf_counter()
        finished, self._finished_on_add = self._finished_on_add, []
        finished += self._take_tool_replies()
        self._evict_paused_for_queued()
        to_prefill, self._needs_prefill = self._needs_prefill, []
        admitted = []
        while self._queue and self._free_slots.num_free:
            seq = self._queue.popleft()
            seq.slot = self._free_slots.allocate()
            self._slots[seq.slot] = seq
            admitted.append(seq)
        to_prefill += admitted
        self._compact_slots()
        self.num_prefilled_total += len(to_prefill)
        running = [s for s in self._slots if s is not None]
        if not to_prefill and all(s.paused for s in running):
            self._turns.wait(self._live.values())  # nothing to decode until a tool replies
            running = []
        sharers = self._shared_prompts(admitted) if self.config.share_prompt_prefill else {}
        followers = {f for group in sharers.values() for f in group}
        to_prefill = [s for s in to_prefill if s not in followers]
        num_prefill_tokens = sum(max(0, len(s.token_ids) - 1) for s in to_prefill)
        num_shared_tokens = sum(len(f.token_ids) - 1 for f in followers)
        self.num_prefill_tokens_total += num_prefill_tokens
        self.num_prefill_tokens_shared_total += num_shared_tokens
        fused = self._prefill_all_but_last_chunk(to_prefill, sharers)
        decode_start = time.perf_counter()
        reasons: collections.Counter[FinishReason] = collections.Counter(r.finish_reason for r in finished)
        if running:
            for seq, reason in self._decode(running, fused, sharers):
                if reason is not None:
                    self._remove(seq)
                    finished.append(self._result(seq, reason))
                    reasons[reason] += 1
        end = time.perf_counter()
        num_decoded = sum(not s.paused for s in running)
        self._throughput.record(time.monotonic(), num_decoded)
        self.last_step = StepStats(
            num_decoded=num_decoded, num_prefilled=len(to_prefill), decode_seconds=end - decode_start,
            step_seconds=end - start, finished=dict(reasons),
            num_paused=sum(1 for s in self._live.values() if s.paused), num_tool_evictions=self.num_tool_evictions,
            num_prefill_tokens=num_prefill_tokens, num_prefill_tokens_shared=num_shared_tokens,
        )
        return finished

    # -- tools ------------------------------------------------------------------------------------------

    def _take_tool_replies(self) -> list[SequenceResult]:
        """Sequences whose tool calls replied: their reply tokens go to the decode row (or, evicted, straight into
        the sequence, which queues for a prefill); the finished ones (the environment ended the episode, or the
        reply would not fit) are returned."""
        finished = []
        for reply in self._turns.replies(self._live.values(), self.max_seq_len):
            seq = reply.seq
            if reply.finish is not None:
                self._remove(seq)
                finished.append(self._result(seq, reply.finish))
            elif seq in self._evicted:
                for token in reply.reply_ids:
                    self._append(seq, token, 0.0, -1, tool=True)
                self._evicted.remove(seq)
                self._queue.appendleft(seq)
            else:
                seq.forced.extend(reply.reply_ids)
        return finished

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

    def _append(self, seq: _Sequence, token: int, logprob: float, version: int, *, tool: bool = False) -> None:
        seq.token_ids.append(token)
        seq.output_ids.append(token)
        seq.output_logprobs.append(logprob)
        seq.output_versions.append(version)
        if seq.tool_mask is not None:
            seq.tool_mask.append(tool)

    def _compact_slots(self) -> None:
        """Move the sequences of the highest slots into free lower ones: a decode step computes every row up
        to the highest occupied slot, so holes left by finished sequences (when no queued sequence fills
        them) would cost as much as running sequences."""
        high = len(self._slots) - 1
        while True:
            while high >= 0 and self._slots[high] is None:
                high -= 1
            low = self._free_slots.lowest_free()
            if low is None or low > high:
                return
            seq = self._slots[high]
            self._free_slots.allocate()  # takes `low`
            self.executor.move_slot(high, low, len(seq.token_ids) - 1)
            self._slots[low], self._slots[high] = seq, None
            self._free_slots.release(high)
            seq.slot = low

    @staticmethod
    def _shared_prompts(admitted: list[_Sequence]) -> dict[_Sequence, list[_Sequence]]:
        """Fresh sequences (no output) with equal prompts, admitted together: leader -> the other copies. Prompts of
        one token have nothing to prefill."""
        groups: dict[tuple[int, ...], list[_Sequence]] = {}
        for s in admitted:
            if not s.output_ids and len(s.token_ids) > 1:
                groups.setdefault(tuple(s.token_ids), []).append(s)
        return {g[0]: g[1:] for g in groups.values() if len(g) > 1}

    @staticmethod
    def _forward_batch(prefill: list[_Sequence], sharers: Mapping[_Sequence, list[_Sequence]], *,
                       decode_tokens: list[int] | None = None,
                       decode_positions: list[int] | None = None) -> ForwardBatch:
        """These prefill rows (each sequence's tokens but its last, its slot, its prompt copies' slots) and decode
        rows."""
        copies = [[f.slot for f in sharers.get(s, ())] for s in prefill] if sharers else []
        return ForwardBatch(decode_tokens=decode_tokens or [], decode_positions=decode_positions or [],
                            prefill_rows=[s.token_ids[:-1] for s in prefill], prefill_slots=[s.slot for s in prefill],
                            prefill_copies=copies)

    def _prefill_all_but_last_chunk(self, sequences: list[_Sequence],
                                    sharers: Mapping[_Sequence, list[_Sequence]]) -> list[_Sequence]:
        """Prefill in chunks of at most prefill_max_tokens padded tokens; returns the last chunk, which the
        decode pass prefills itself (a sequence's last token is its decode input, so a one-token sequence
        needs no prefill). `sharers`: leader -> the copies of its prompt, whose slots get its keys and values."""
        chunks = self._chunks(sequences)
        for chunk in chunks[:-1]:
            self.executor.forward(self._forward_batch(chunk, sharers))
            self._record_routes(chunk, [], sharers)
        return chunks[-1] if chunks else []

    def _chunks(self, sequences: list[_Sequence]) -> list[list[_Sequence]]:
        """The sequences to prefill (all but one-token ones) in chunks of at most prefill_max_tokens padded
        tokens, shortest first."""
        rows = sorted((s for s in sequences if len(s.token_ids) > 1), key=lambda s: len(s.token_ids))
        budget = self.config.prefill_max_tokens
        chunks = []
        while rows:
            # Rows are sorted by length, so the chunk's last row is its longest.
            n = 1
            while n < len(rows) and (n + 1) * (len(rows[n].token_ids) - 1) <= budget:
                n += 1
            chunks.append(rows[:n])
            rows = rows[n:]
        return chunks

    def _record_routes(self, prefill: list[_Sequence], decode: list[_Sequence],
                       sharers: Mapping[_Sequence, list[_Sequence]] | None = None) -> None:
        """Hand the last forward pass's routes to the sequences that record them: prefill row j is `prefill[j]`
        (positions 0..len-2) and the copies of its prompt in `sharers`, each decoded sequence's row is its slot (its
        input token's position). Rows of free slots and of sequences that do not ask are skipped; one
        device-to-host copy per pass, and none when no sequence needs a position it lacks."""
        sharers = sharers or {}
        wanted = [(j, s) for j, leader in enumerate(prefill) for s in (leader, *sharers.get(leader, ()))
                  if s.routes is not None and s.routes.length < len(s.token_ids) - 1]
        decoded = [s for s in decode if s.routes is not None and s.routes.length < len(s.token_ids)]
        if not wanted and not decoded:
            return
        routing = self.executor.expert_routing
        assert routing is not None
        ids: np.ndarray = routing.expert_ids.cpu().numpy()
        offsets = routing.prefill_offsets
        for j, s in wanted:
            assert s.routes is not None
            s.routes.record(0, ids[offsets[j] : offsets[j + 1]])
        for s in decoded:
            assert s.routes is not None
            s.routes.record(len(s.token_ids) - 1, ids[s.slot : s.slot + 1])

    def _decode(self, running: list[_Sequence], prefill: list[_Sequence],
                sharers: Mapping[_Sequence, list[_Sequence]]) -> list[
        tuple[_Sequence, FinishReason | None]
    ]:
        num_rows = max(s.slot for s in running) + 1
        tokens, positions = [0] * num_rows, [0] * num_rows
        temperature, top_p, top_k = [0.0] * num_rows, [1.0] * num_rows, [0] * num_rows
        generators: list[torch.Generator | None] = [None] * num_rows
        for s in running:
            o = s.request.sampling
            slot = s.slot
            tokens[slot], positions[slot] = s.token_ids[-1], len(s.token_ids) - 1
            temperature[slot], top_p[slot], top_k[slot] = o.temperature, o.top_p, o.top_k
            # a row whose token is dropped (paused) or given (a tool reply) draws nothing from the sequence's own
            # generator: a seeded trajectory samples the same tokens however long its tools take
            generators[slot] = None if s.paused or s.forced else s.generator
        logits = self.executor.forward(self._forward_batch(prefill, sharers, decode_tokens=tokens,
                                                           decode_positions=positions))
        self._record_routes(prefill, running, sharers)
        params = SamplingBatch(temperature=temperature, top_p=top_p, top_k=top_k, generators=generators)
        sampled, logprobs = sample(logits, params, self._generator)
        sampled_ids, sampled_logprobs = sampled.tolist(), logprobs.tolist()
        version = self.version
        outcome = []
        for s in running:
            if s.paused:
                continue  # its row recomputed its last token's keys; the token sampled is dropped
            if s.forced:
                self._append(s, s.forced.popleft(), 0.0, -1, tool=True)
                outcome.append((s, FinishReason.LENGTH if self._length_reached(s) else None))
                continue
            token = sampled_ids[s.slot]
            self._append(s, token, sampled_logprobs[s.slot], version)
            reason = self._finish_reason(s, token)
            if reason == FinishReason.STOP and self._turns.end_turn(s):
                reason = None  # paused until its tools reply
            outcome.append((s, reason))
        return outcome

    def _finish_reason(self, seq: _Sequence, token: int) -> FinishReason | None:
        if token in self.eos_token_ids:
            return FinishReason.STOP
        stop = seq.request.sampling.stop
        if stop:
            tail = self.tokenizer.decode(seq.output_ids[-seq.stop_window:], skip_special_tokens=True)
            if any(s in tail for s in stop):
                return FinishReason.STOP
        return FinishReason.LENGTH if self._length_reached(seq) else None

    def _length_reached(self, seq: _Sequence) -> bool:
        return seq.remaining(self.max_seq_len) <= 0

    def _result(self, seq: _Sequence, reason: FinishReason) -> SequenceResult:
        while seq.forced:  # a partial returns its whole tool reply: the engine that continues it prefills it
            self._append(seq, seq.forced.popleft(), 0.0, -1, tool=True)
        self._turns.close(seq, reason)
        return seq.result(reason, self.tokenizer)
