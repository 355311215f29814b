"""The torch generation engine: a KV cache, continuous batching and in-place weight updates.

`Engine.step()` is one iteration of schedule -> execute -> update, as vLLM v1's `EngineCore.step`: the scheduler
(`engine/scheduler.py`, plain Python) admits queued sequences into free KV cache slots and says what to prefill
and decode; the engine runs it, one forward pass that prefills the joining sequences and decodes one token for
every running one, and samples; the scheduler then appends the tokens and decides who continues, pauses for its
tools or leaves (EOS, a stop string, its length limit; its slot is reused at the next step). The model runs in an
executor (`everstep_rollout.executor`): our native one for Llama, Qwen2, Qwen3 and Qwen3-MoE models, or
transformers' own modeling code for any other causal LM.

Per-token log-probabilities (`output_logprobs`): log_softmax(logits / T) of the sampled token, in
float32, over the full vocabulary BEFORE the penalties and top-k/top-p/min-p filtering (`engine.sampling`), with T
the sequence's temperature (T = 1 for greedy, temperature 0). Every output token records the engine's policy version
at the step that generated it (`output_versions`).

Routing replay (`SamplingOptions.return_routed_experts`, MoE models on the native executor): after every forward
pass the routes the executor recorded for a requesting sequence's positions (its prefill rows, and its decode
row's input token) go into the sequence's `RouteBuffer`, which keeps each position's first routes (those it was
sent with, then those computed first): a re-prefill or a KV recompute after a weight swap adds only positions
beyond them. See `everstep_rollout.routing`.

Multi-turn tool use (`GenerationRequest.tools`, docs/tools.md): when a sequence ends a turn with tool calls
(`everstep_rollout.tools.ToolSession`), it is paused in its slot with its KV cache kept while the calls run on tool
threads; the other sequences go on decoding. A paused sequence's decode row recomputes its last token's keys (the
same values) and its sampled token is dropped. When the replies come, their tokens are fed through its decode row,
one per step (`ScheduledSequence.forced`): the history is never prefilled again. Only when sequences wait for a slot and
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
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from everstep.model_config import MAX_ROUTED_EXPERTS, position_limit
from everstep_rollout.config import EngineConfig
from everstep_rollout.engine.interface import QueueFullError, StepStats
from everstep_rollout.engine.sampling import SamplingBatch, sample
from everstep_rollout.engine.scheduler import ScheduledSequence, Scheduler
from everstep_rollout.engine.throughput import ThroughputWindow
from everstep_rollout.engine.tool_turns import ToolTurns
from everstep_rollout.executor import ExecutorOptions, ForwardBatch, build_executor
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
class _Sequence(ScheduledSequence):
    generator: torch.Generator | None
    """Its own sampling generator (a seeded request); None: the engine's."""


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
        self.version = self.config.version
        self.routing_shape = self.executor.routing_shape
        self._routes_refusal = self._why_no_routes()
        self._device = device
        self._generator = torch.Generator(device=device).manual_seed(self.config.seed)
        self._finished_on_add: list[SequenceResult] = []
        self._throughput = ThroughputWindow(window_seconds=_THROUGHPUT_WINDOW_SECONDS)
        self._turns = ToolTurns(sandbox_endpoint=self.config.sandbox_endpoint, tokenizer=self.tokenizer,
                                eos_token_ids=read_eos_token_ids(self.model_dir, model_config))
        self._scheduler: Scheduler[_Sequence] = Scheduler(
            num_slots=self.config.max_running, max_seq_len=self.max_seq_len,
            prefill_max_tokens=self.config.prefill_max_tokens, share_prompt_prefill=self.config.share_prompt_prefill,
            turns=self._turns, decode_text=lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True))
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
    def eos_token_ids(self) -> frozenset[int]:
        """The end-of-turn tokens: a sequence that samples one stops (or, with tools, ends its turn). A benchmark may
        set none, to run every sequence to its length."""
        return self._turns.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: Iterable[int]) -> None:
        self._turns.eos_token_ids = frozenset(ids)

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
        return self._scheduler.num_running

    @property
    def num_queued(self) -> int:
        return self._scheduler.num_queued

    @property
    def num_tool_evictions(self) -> int:
        return self._scheduler.num_tool_evictions

    @property
    def has_work(self) -> bool:
        return bool(self._scheduler.live or self._finished_on_add)

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
        duplicates = {k for k in keys if k in self._scheduler.live} | {k for k in keys if keys.count(k) > 1}
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
        scheduler = self._scheduler
        would_wait = max(0, scheduler.num_queued + len(requests) - scheduler.num_free_slots)
        if would_wait > self.config.max_queued:
            raise QueueFullError(
                f"rollout queue full: {scheduler.num_queued} sequences queued, {len(requests)} more requested, "
                f"max_queued={self.config.max_queued}, {scheduler.num_free_slots} free slots"
            )
        for r in requests:
            seq = self._new_sequence(r)
            finished = scheduler.add(seq)
            if finished is not None:
                self._finished_on_add.append(self._result(seq, finished))

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
        return [self._result(s, FinishReason.ABORTED) for s in self._scheduler.drain(stream)]

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
            self._scheduler.recompute_all()
        return num_bytes

    # -- the step ---------------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[SequenceResult]:
        """Admit, prefill, decode one token for every running sequence; return the sequences that finished."""
        start = time.perf_counter()
        finished, self._finished_on_add = self._finished_on_add, []
        scheduler = self._scheduler
        finished += [self._result(seq, reason) for seq, reason in scheduler.take_tool_replies()]
        plan = scheduler.schedule()
        for move in plan.moves:
            self.executor.move_slot(move.src, move.dst, move.length)
        self.num_prefilled_total += plan.num_prefilled
        if plan.waiting_for_tools:
            self._turns.wait(scheduler.live.values())  # nothing to decode until a tool replies
        num_prefill_tokens = sum(max(0, len(s.token_ids) - 1) for s in plan.prefill)
        num_shared_tokens = sum(len(f.token_ids) - 1 for group in plan.sharers.values() for f in group)
        self.num_prefill_tokens_total += num_prefill_tokens
        self.num_prefill_tokens_shared_total += num_shared_tokens
        for chunk in plan.prefill_chunks[:-1]:  # the last chunk is prefilled by the decode pass
            self.executor.forward(self._forward_batch(chunk, plan.sharers))
            self._record_routes(chunk, [], plan.sharers)
        decode_start = time.perf_counter()
        reasons: collections.Counter[FinishReason] = collections.Counter(r.finish_reason for r in finished)
        if plan.decode:
            fused = plan.prefill_chunks[-1] if plan.prefill_chunks else []
            sampled_ids, sampled_logprobs = self._decode(plan.decode, fused, plan.sharers)
            for seq, reason in scheduler.update_from_output(plan.decode, sampled_ids, sampled_logprobs, self.version):
                finished.append(self._result(seq, reason))
                reasons[reason] += 1
        end = time.perf_counter()
        num_decoded = sum(not s.paused for s in plan.decode)
        self._throughput.record(time.monotonic(), num_decoded)
        self.last_step = StepStats(
            num_decoded=num_decoded, num_prefilled=len(plan.prefill), decode_seconds=end - decode_start,
            step_seconds=end - start, finished=dict(reasons), num_paused=scheduler.num_paused,
            num_tool_evictions=scheduler.num_tool_evictions, num_prefill_tokens=num_prefill_tokens,
            num_prefill_tokens_shared=num_shared_tokens,
        )
        return finished

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
                sharers: Mapping[_Sequence, list[_Sequence]]) -> tuple[list[int], list[float]]:
        """One forward pass: `prefill`'s rows, then a decode row per slot up to the highest running one; the token
        sampled for every row and its log-prob (indexed by slot)."""
        num_rows = max(s.slot for s in running) + 1
        tokens, positions = [0] * num_rows, [0] * num_rows
        temperature, top_p, top_k, min_p = [0.0] * num_rows, [1.0] * num_rows, [0] * num_rows, [0.0] * num_rows
        repetition, presence, frequency = [1.0] * num_rows, [0.0] * num_rows, [0.0] * num_rows
        output_ids: list[list[int]] = [[]] * num_rows
        generators: list[torch.Generator | None] = [None] * num_rows
        for s in running:
            o = s.request.sampling
            slot = s.slot
            tokens[slot], positions[slot] = s.token_ids[-1], len(s.token_ids) - 1
            temperature[slot], top_p[slot], top_k[slot], min_p[slot] = o.temperature, o.top_p, o.top_k, o.min_p
            if o.penalized:
                repetition[slot], presence[slot], frequency[slot] = (o.repetition_penalty, o.presence_penalty,
                                                                     o.frequency_penalty)
                output_ids[slot] = s.output_ids
            # a row whose token is dropped (paused) or given (a tool reply) draws nothing from the sequence's own
            # generator: a seeded trajectory samples the same tokens however long its tools take
            generators[slot] = None if s.paused or s.forced else s.generator
        logits = self.executor.forward(self._forward_batch(prefill, sharers, decode_tokens=tokens,
                                                           decode_positions=positions))
        self._record_routes(prefill, running, sharers)
        params = SamplingBatch(temperature=temperature, top_p=top_p, top_k=top_k, generators=generators, min_p=min_p,
                               repetition_penalty=repetition, presence_penalty=presence, frequency_penalty=frequency,
                               output_ids=output_ids)
        sampled, logprobs = sample(logits, params, self._generator)
        return sampled.tolist(), logprobs.tolist()

    def _result(self, seq: _Sequence, reason: FinishReason) -> SequenceResult:
        while seq.forced:  # a partial returns its whole tool reply: the engine that continues it prefills it
            seq.append(seq.forced.popleft(), 0.0, -1, tool=True)
        self._turns.close(seq, reason)
        return seq.result(reason, self.tokenizer)
