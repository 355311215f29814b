"""The torch generation engine: a KV cache, continuous batching and in-place weight updates.

`Engine.step()` is one iteration of schedule -> execute -> update: queued sequences are admitted into
free KV cache slots and prefilled, then every running sequence decodes one token, and sequences that hit
EOS, a stop string or their length limit leave (their slot is reused at the next step).

Per-token log-probabilities (`output_logprobs`): log_softmax(logits / T) of the sampled token, in
float32, over the full vocabulary BEFORE top-k/top-p filtering, with T the sequence's temperature
(T = 1 for greedy, temperature 0). Every output token records the engine's policy version at the step
that generated it (`output_versions`).

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

import torch

from everstep_rollout.config import EngineConfig
from everstep_rollout.kv_cache import CacheShape, KVCache
from everstep_rollout.llama_executor import LlamaExecutor, LlamaSpec, LlamaWeights, read_config, read_state_dict
from everstep_rollout.sampling import SamplingBatch, sample
from everstep_rollout.sequence import FinishReason, GenerationRequest, SamplingOptions, SequenceResult

log = logging.getLogger(__name__)

_THROUGHPUT_WINDOW_SECONDS = 10.0
# Stop strings are matched on the decoded last (longest stop string + this many) output tokens: every
# text token decodes to at least one character, so a stop string that the last token completed lies
# inside that window; decoding the whole output every step would cost O(length) per token.
_STOP_WINDOW_EXTRA_TOKENS = 8


class QueueFullError(RuntimeError):
    """add() refused: accepting the requests would make more than max_queued sequences wait."""


@dataclass(frozen=True, kw_only=True)
class StepStats:
    """What one step did, for metrics."""

    num_decoded: int
    """Sequences that generated a token (= tokens generated)."""
    num_prefilled: int
    decode_seconds: float
    step_seconds: float
    finished: dict[FinishReason, int]


@dataclass(eq=False, kw_only=True)
class _Sequence:
    request: GenerationRequest
    token_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    output_versions: list[int]
    generator: torch.Generator | None
    stop_window: int
    slot: int = -1

    @property
    def key(self) -> tuple[int, str]:
        return (self.request.stream, self.request.id)


@dataclass(kw_only=True)
class _Throughput:
    window_seconds: float
    events: collections.deque = field(default_factory=collections.deque)  # (end_time, num_tokens)

    def record(self, end_time: float, num_tokens: int) -> None:
        self.events.append((end_time, num_tokens))

    def tokens_per_second(self, now: float) -> float:
        while self.events and self.events[0][0] < now - self.window_seconds:
            self.events.popleft()
        if len(self.events) < 2:
            return 0.0
        span = now - self.events[0][0]
        return sum(n for _, n in list(self.events)[1:]) / span if span > 0 else 0.0


class Engine:
    """Continuous-batching generation over one Llama/Qwen2 model; see the module docstring."""

    def __init__(self, model_dir: str | Path, config: EngineConfig | None = None) -> None:
        from transformers import AutoTokenizer

        self.config = config or EngineConfig()
        self.model_dir = Path(model_dir)
        model_config = read_config(self.model_dir)
        self.spec = LlamaSpec.from_config(model_config)
        device = torch.device(self.config.device)
        self.max_seq_len = min(self.config.max_seq_len, self.spec.max_position_embeddings)
        self.weights = LlamaWeights(self.spec, dtype=self.config.torch_dtype, device=device)
        with torch.no_grad():
            self.weights.copy_in(read_state_dict(self.model_dir), require_all=True)
        self.cache = KVCache(
            CacheShape(
                num_layers=self.spec.num_layers, num_slots=self.config.max_running,
                max_seq_len=self.max_seq_len, num_kv_heads=self.spec.num_kv_heads, head_dim=self.spec.head_dim,
            ),
            dtype=self.config.torch_dtype, device=device,
        )
        self.executor = LlamaExecutor(self.spec, self.weights, self.cache)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.eos_token_ids = _read_eos_token_ids(self.model_dir, model_config)
        self.version = self.config.version
        self._device = device
        self._generator = torch.Generator(device=device).manual_seed(self.config.seed)
        self._queue: collections.deque[_Sequence] = collections.deque()
        self._slots: list[_Sequence | None] = [None] * self.config.max_running
        self._live: dict[tuple[int, str], _Sequence] = {}
        self._needs_prefill: list[_Sequence] = []
        self._finished_on_add: list[SequenceResult] = []
        self._throughput = _Throughput(window_seconds=_THROUGHPUT_WINDOW_SECONDS)
        self.last_step: StepStats | None = None
        log.info(
            "loaded %s (%s, %d parameters, %s on %s); KV cache %d slots x %d tokens, %.1f MiB",
            self.model_dir, self.spec.model_type, self.weights.num_parameters, self.config.dtype, device,
            self.config.max_running, self.max_seq_len, self.cache.num_bytes / 2**20,
        )

    # -- state ------------------------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self._live) - len(self._queue)

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

        Raises ValueError on a request whose (stream, id) is already live or whose tokens fall outside
        the vocabulary, and QueueFullError when more than max_queued sequences would wait for a slot.
        """
        requests = list(requests)
        keys = [(r.stream, r.id) for r in requests]
        duplicates = {k for k in keys if k in self._live} | {k for k in keys if keys.count(k) > 1}
        if duplicates:
            raise ValueError(f"sequence ids already in flight: {sorted(k[1] for k in duplicates)[:5]}")
        vocab = self.spec.vocab_size
        for r in requests:
            if any(not 0 <= t < vocab for t in (*r.prompt_ids, *r.output_ids)):
                raise ValueError(f"sequence {r.id!r}: token id outside the vocabulary [0, {vocab})")
        # The next step moves the head of the queue into the free slots; the rest waits.
        would_wait = max(0, len(self._queue) + len(requests) - self.cache.num_free)
        if would_wait > self.config.max_queued:
            raise QueueFullError(
                f"rollout queue full: {len(self._queue)} sequences queued, {len(requests)} more requested, "
                f"max_queued={self.config.max_queued}, {self.cache.num_free} free slots"
            )
        for r in requests:
            seq = self._new_sequence(r)
            if self._length_reached(seq):
                self._finished_on_add.append(self._result(seq, FinishReason.LENGTH))
            else:
                self._queue.append(seq)
                self._live[seq.key] = seq

    def _new_sequence(self, r: GenerationRequest) -> _Sequence:
        generator = None
        if r.sampling.seed:
            generator = torch.Generator(device=self._device).manual_seed(r.sampling.seed)
        stop_window = max((len(s) for s in r.sampling.stop), default=0) + _STOP_WINDOW_EXTRA_TOKENS
        return _Sequence(
            request=r, token_ids=[*r.prompt_ids, *r.output_ids], output_ids=list(r.output_ids),
            output_logprobs=list(r.output_logprobs), output_versions=list(r.output_versions),
            generator=generator, stop_window=stop_window,
        )

    def drain(self, stream: int | None = None) -> list[SequenceResult]:
        """Remove every unfinished sequence (of `stream`, or of all streams) and return it as ABORTED."""
        drained = [s for s in self._live.values() if stream is None or s.request.stream == stream]
        for seq in drained:
            self._remove(seq)
        return [self._result(s, FinishReason.ABORTED) for s in drained]

    def _remove(self, seq: _Sequence) -> None:
        del self._live[seq.key]
        if seq.slot >= 0:
            self._slots[seq.slot] = None
            self.cache.release(seq.slot)
            seq.slot = -1
            if seq in self._needs_prefill:
                self._needs_prefill.remove(seq)
        else:
            self._queue.remove(seq)

    # -- weights ----------------------------------------------------------------------------------------

    def update_weights(self, named_tensors: Mapping[str, torch.Tensor], version: int) -> int:
        """Copy Hugging Face-named tensors into the existing parameters (in place) and set the version.

        Any subset of the parameters may be given; a tied model accepts either embedding name. Raises
        ValueError (nothing changed) on unknown names or shape mismatches. Returns the bytes copied.
        """
        with torch.no_grad():
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
        to_prefill, self._needs_prefill = self._needs_prefill, []
        while self._queue and self.cache.num_free:
            seq = self._queue.popleft()
            seq.slot = self.cache.allocate()
            self._slots[seq.slot] = seq
            to_prefill.append(seq)
        self._prefill(to_prefill)
        decode_start = time.perf_counter()
        reasons: collections.Counter[FinishReason] = collections.Counter(r.finish_reason for r in finished)
        running = [s for s in self._slots if s is not None]
        if running:
            for seq, reason in self._decode(running):
                if reason is not None:
                    self._remove(seq)
                    finished.append(self._result(seq, reason))
                    reasons[reason] += 1
        end = time.perf_counter()
        self._throughput.record(time.monotonic(), len(running))
        self.last_step = StepStats(
            num_decoded=len(running), num_prefilled=len(to_prefill), decode_seconds=end - decode_start,
            step_seconds=end - start, finished=dict(reasons),
        )
        return finished

    def _prefill(self, sequences: list[_Sequence]) -> None:
        rows = sorted((s for s in sequences if len(s.token_ids) > 1), key=lambda s: len(s.token_ids))
        budget = self.config.prefill_max_tokens
        while rows:
            # Rows are sorted by length, so the chunk's last row is its longest.
            n = 1
            while n < len(rows) and (n + 1) * (len(rows[n].token_ids) - 1) <= budget:
                n += 1
            chunk, rows = rows[:n], rows[n:]
            self.executor.prefill([s.token_ids[:-1] for s in chunk], [s.slot for s in chunk])

    def _decode(self, running: list[_Sequence]) -> list[tuple[_Sequence, FinishReason | None]]:
        num_rows = max(s.slot for s in running) + 1
        tokens, positions = [0] * num_rows, [0] * num_rows
        temperature, top_p, top_k = [0.0] * num_rows, [1.0] * num_rows, [0] * num_rows
        generators: list[torch.Generator | None] = [None] * num_rows
        for s in running:
            o = s.request.sampling
            tokens[s.slot], positions[s.slot] = s.token_ids[-1], len(s.token_ids) - 1
            temperature[s.slot], top_p[s.slot], top_k[s.slot] = o.temperature, o.top_p, o.top_k
            generators[s.slot] = s.generator
        device = self._device
        logits = self.executor.decode(
            torch.tensor(tokens, device=device), torch.tensor(positions, device=device)
        )
        params = SamplingBatch(
            temperature=torch.tensor(temperature, dtype=torch.float32, device=device),
            top_p=torch.tensor(top_p, dtype=torch.float32, device=device),
            top_k=torch.tensor(top_k, dtype=torch.long, device=device), generators=generators,
        )
        sampled, logprobs = sample(logits, params, self._generator)
        sampled_ids, sampled_logprobs = sampled.tolist(), logprobs.tolist()
        outcome = []
        for s in running:
            token = sampled_ids[s.slot]
            s.token_ids.append(token)
            s.output_ids.append(token)
            s.output_logprobs.append(sampled_logprobs[s.slot])
            s.output_versions.append(self.version)
            outcome.append((s, self._finish_reason(s, token)))
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
        max_new = seq.request.sampling.max_new_tokens
        return (max_new > 0 and len(seq.output_ids) >= max_new) or len(seq.token_ids) >= self.max_seq_len

    def _result(self, seq: _Sequence, reason: FinishReason) -> SequenceResult:
        r = seq.request
        return SequenceResult(
            id=r.id, stream=r.stream, prompt_ids=list(r.prompt_ids), output_ids=seq.output_ids,
            output_logprobs=seq.output_logprobs, output_versions=seq.output_versions, finish_reason=reason,
            output_text=self.tokenizer.decode(seq.output_ids, skip_special_tokens=True),
        )


def _read_eos_token_ids(model_dir: Path, model_config: Mapping) -> frozenset[int]:
    """EOS ids of config.json and generation_config.json together (either may hold an int or a list)."""
    import json

    ids: set[int] = set()
    sources = [model_config]
    generation_config = model_dir / "generation_config.json"
    if generation_config.exists():
        sources.append(json.loads(generation_config.read_text()))
    for source in sources:
        eos = source.get("eos_token_id")
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list):
            ids.update(int(e) for e in eos)
    return frozenset(ids)


__all__ = ["Engine", "EngineConfig", "GenerationRequest", "QueueFullError", "SamplingOptions", "SequenceResult",
           "StepStats"]
