"""The sglang engine: the rollout service's engine interface over sglang's offline `sglang.Engine` (GPU).

NOT RUN: sglang is not installed on the CPU machines this was written on and no GPU was available; this
module is written against the source of sglang 0.5.3 (the version `make sglang-venv` and
deploy/docker/rollout-sglang.Dockerfile pin): `Engine.tokenizer_manager.generate_request` with a
`GenerateReqInput`, `Engine.update_weights_from_tensor`, `Engine.init_weights_update_group`,
`Engine.update_weights_from_distributed`, `Engine.tokenizer_manager.abort_request`. Its request
bookkeeping and its event-loop discipline are tested on CPU against a stand-in
(tests/rollout/test_sglang_engine.py), not against sglang.

sglang runs in an environment of its own (its exact torch and transformers pins conflict with ours):
see docs/rollout.md, "The sglang environment".

Event loops: sglang's `Engine` has no loop of its own; `SglangEngine` owns one (`sglang_api.SglangLoop`), on which
every sglang call and every request's stream runs.

How it maps the engine interface (the same one `Engine` has, driven by `EngineLoop`):

- `add`: each sequence is one streaming request (input ids = prompt + earlier output,
  `return_logprob=True`) whose chunks a task consumes on the engine's event loop. It is a
  `GenerateReqInput` with our own `rid` given to `tokenizer_manager.generate_request` (what
  `Engine.async_generate` does, except that 0.5.3's `async_generate` takes no `rid`, and aborting a
  request needs its rid from the start). That loop runs only inside `step()` and the other methods, all called
  from the engine-loop thread.
- Tokens and log-probs: `sglang_api.read_chunk` (the same log-prob the torch engine records).
- `drain` aborts the requests (`abort_request(rid)`, sent from a coroutine on the loop and repeated every
  50 ms until the request ends: sglang ignores an abort for a rid it has not registered yet), waits for their
  last chunks and returns what they generated as ABORTED partials (or as finished, when a request ended
  before the abort reached it).
- `update_weights` (and `update_weights_from_distributed`) first takes every running request out the same
  way, swaps the weights with sglang's cache flushed, then resubmits each as a continuation (prompt +
  output so far), so that its prefix is recomputed under the new weights and every token carries the
  version it was generated under. sglang re-shares the tensors with its scheduler process
  (`MultiprocessingSerializer`), and torch refuses to share a CUDA tensor this process received by CUDA
  IPC, so those are cloned first (`everstep.tensors.cuda_ipc.owned`: one device copy, the CUDA IPC push's only one).
- Memory: `EngineConfig.mem_fraction_static` goes to sglang (0: sglang's default, most of the GPU).
- Threads: a `Load` builds the engine on a gRPC thread, where sglang's `signal.signal(SIGQUIT, ...)`
  would raise; see `sglang_api.signal_handlers_skipped_off_main_thread`.
- Backpressure: at most max_running + max_queued sequences live at once (sglang queues internally), more
  are refused with QueueFullError. `num_queued` is 0: sglang's own queue is not visible here.
- Per-request seeds are not passed on (sglang's seeding differs by version); the engine seed is sglang's
  random_seed.
- Routing replay (`return_routed_experts`): only where sglang has it (after 0.5.3, the pinned version; refused
  with the reason otherwise, as for a dense model); see `sglang_api`, "Routed experts". A request ended without
  routes loses its output tokens beyond the positions it has routes for: a token is kept only with the routes of
  the input it was sampled from.
- Multi-turn tool use (`GenerationRequest.tools`, docs/tools.md), as verl's sglang agent loop does it (token in,
  token out; the trajectory so far is the next request's input_ids): each model turn is one sglang request whose
  input_ids are the whole trajectory so far (prompt + model tokens + tool-reply tokens), with `stop_token_ids` =
  the engine's EOS set (the torch engine's end-of-turn tokens). When a request stops at an end-of-turn token, the
  turn goes to `engine/tool_turns.py`, as on the torch engine (same session, threads, limits); the sequence
  has no request in sglang meanwhile, and every other request goes on decoding in sglang's batches. The replies'
  tokens are appended (`output_tool_mask` True, log-prob 0, version -1) and the next turn is submitted.
  sglang's radix cache (on unless --disable-radix-cache) keeps the finished request's KV (`cache_finished_req`
  inserts `(origin_input_ids + output_ids)[:-1]`: the turn's last token was sampled, never fed), so the next
  request's `match_prefix` finds the whole history but that token, and only it and the reply's tokens are
  prefilled; `meta_info["cached_tokens"]` reports the hit, summed in `tool_continuation_cached_tokens` against
  `tool_continuation_input_tokens`. Under memory pressure sglang evicts radix nodes by LRU, and a weight update
  flushes the cache: a continuation whose cached tokens fall short of its history (but the last token) had its
  history prefilled again, and is counted in `num_tool_evictions` (`everstep_rollout_tool_evictions_total`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from everstep.model_config import MAX_ROUTED_EXPERTS, moe_shape, position_limit
from everstep.settings.quantization import Quantization
from everstep.tensors import cuda_ipc
from everstep_rollout.config import EngineConfig, resolve_max_seq_len
from everstep_rollout.engine import sglang_api
from everstep_rollout.engine.interface import QueueFullError, StepStats
from everstep_rollout.engine.throughput import ThroughputWindow
from everstep_rollout.engine.tool_turns import LiveSequence, ToolTurns
from everstep_rollout.model_files import read_config, read_eos_token_ids
from everstep_rollout.routing import RouteBuffer, check_routed_experts
from everstep_rollout.sequence import FinishReason, GenerationRequest, SequenceResult

log = logging.getLogger(__name__)

_POLL_SECONDS = 0.005
@dataclass(eq=False, kw_only=True)
class _Request(LiveSequence):
    rid: str
    version: int
    task: asyncio.Task | None = None
    finish: FinishReason | None = None
    error: str = ""
    new_tokens: int = field(default=0)
    """Tokens this sglang request generated (the continuation's own, not the earlier output)."""
    routes_start: int = 0
    """The first position the current sglang request returns routes for (its routed_experts_start_len)."""
    input_len: int = 0
    """Tokens the current sglang request was sent (prompt + earlier output)."""
    continues_trajectory: bool = False
    """The current request follows a tool reply (its input extends the previous request's)."""
    cached_tokens: int = 0
    """sglang's `meta_info["cached_tokens"]` of the current request: its input tokens found in the radix cache."""
    history_len: int = 0
    """Tokens before the tool reply the current request continues from (the radix cache holds all but the last)."""


class SglangEngine:
    """The engine interface over `sglang.Engine`; see the module docstring. Not thread safe (EngineLoop)."""

    def __init__(self, model_dir: str | Path, config: EngineConfig | None = None, *, sglang_engine=None,
                 request_type=None) -> None:
        """`sglang_engine`: an already built engine object (tests pass a stand-in); built from config otherwise.
        `request_type`: the class of a generate request (default: sglang's `GenerateReqInput`).

        Build it on the thread that will drive it or not: every sglang call goes through `_loop`."""
        from transformers import AutoTokenizer

        self.config = config or EngineConfig(engine="sglang")
        self.model_dir = Path(model_dir)
        model_config = read_config(self.model_dir)
        self.position_limit = position_limit(model_config) or 0
        self.max_seq_len = resolve_max_seq_len(self.config.max_seq_len, self.position_limit or None)
        self.executor_name = "sglang"
        self.architecture = str(model_config.get("model_type", ""))
        self.moe = moe_shape(model_config)
        """(sparse decoder layers, top_k, num_experts); None for a dense model."""
        self.num_hidden_layers = int((model_config.get("text_config") or model_config).get("num_hidden_layers", 0))
        if self.config.quantization != Quantization.none:
            raise ValueError(f"quantization: {self.config.quantization.value!r} is a torch-engine setting; the sglang "
                             "engine takes quantization 'none'")
        if sglang_engine is None:
            sglang = sglang_api.import_sglang()
            if self.config.device == "cpu":
                raise ValueError("engine 'sglang' runs on a GPU: set device to 'cuda' (or use engine 'torch')")
            self._request_type = request_type
            self.sglang_routes = sglang_api.has_routed_experts(self._new_request_type())
            with sglang_api.signal_handlers_skipped_off_main_thread():
                sglang_engine = sglang.Engine(**self.sglang_arguments())
        else:
            self._request_type = request_type
            self.sglang_routes = sglang_api.has_routed_experts(self._new_request_type())
        self._routes_refusal = self._why_no_routes()
        self._sgl = sglang_engine
        self._loop = sglang_api.SglangLoop()
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.eos_token_ids = read_eos_token_ids(self.model_dir, model_config)
        self.version = self.config.version
        self.num_parameters = sglang_api.count_parameters(self.model_dir)
        self._live: dict[tuple[int, str], _Request] = {}
        self._finished_on_add: list[SequenceResult] = []
        self._rid_counter = 0
        self._throughput = ThroughputWindow(window_seconds=10.0)
        self.last_step: StepStats | None = None
        self._turns = ToolTurns(sandbox_endpoint=self.config.sandbox_endpoint, tokenizer=self.tokenizer,
                                eos_token_ids=self.eos_token_ids)
        self.tool_continuation_input_tokens = 0
        """Input tokens of the requests that continued a trajectory after a tool reply (finished ones)."""
        self.tool_continuation_cached_tokens = 0
        """Of those, the tokens sglang's radix cache had (not prefilled again)."""
        self.num_tool_evictions = 0
        """Continuations whose history sglang prefilled again (evicted from its radix cache, or flushed)."""
        log.info("sglang engine over %s (%s, max_running %d)", self.model_dir, self.config.dtype,
                 self.config.max_running)

    def sglang_arguments(self) -> dict:
        """The keyword arguments of `sglang.Engine` (its ServerArgs fields) this config gives."""
        arguments = {"model_path": str(self.model_dir), "dtype": self.config.dtype, "random_seed": self.config.seed,
                     "max_running_requests": self.config.max_running, "context_length": self.max_seq_len,
                     "log_level": "error"}
        if self.config.device.startswith("cuda:"):
            arguments["base_gpu_id"] = int(self.config.device.partition(":")[2] or 0)
        if self.config.mem_fraction_static:
            arguments["mem_fraction_static"] = self.config.mem_fraction_static
        if self.moe is not None and getattr(self, "sglang_routes", False):
            # The capture costs a host buffer of int32 [KV tokens, layers, top_k]; only an MoE model has routes.
            arguments["enable_return_routed_experts"] = True
        return arguments

    def _new_request_type(self):
        if self._request_type is None:
            from sglang.srt.managers.io_struct import GenerateReqInput

            self._request_type = GenerateReqInput
        return self._request_type

    def _new_request(self, **fields):
        return self._new_request_type()(**fields)

    def _why_no_routes(self) -> str | None:
        """Why this engine cannot return routed experts (None: it can)."""
        if self.moe is None:
            return f"{self.model_dir} ({self.architecture}) is a dense model: it has no experts to route to"
        if self.moe.num_experts > MAX_ROUTED_EXPERTS:
            return (f"{self.model_dir} has {self.moe.num_experts} experts; routed expert ids travel as uint8 (at most "
                    f"{MAX_ROUTED_EXPERTS})")
        if not self.sglang_routes:
            return ("this sglang has no routed-experts capture (GenerateReqInput.return_routed_experts and "
                    "--enable-return-routed-experts came after sglang 0.5.3, the version "
                    "deploy/sglang/requirements.txt pins); use the torch engine, or an sglang that has it")
        return None

    # -- state ------------------------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self._live)

    @property
    def num_queued(self) -> int:
        return 0

    @property
    def has_work(self) -> bool:
        return bool(self._live or self._finished_on_add)

    def tokens_per_second(self) -> float:
        return self._throughput.tokens_per_second(time.monotonic())

    # -- requests ---------------------------------------------------------------------------------------

    def add(self, requests: Iterable[GenerationRequest]) -> None:
        """Submit requests (all or none); ValueError on duplicates, QueueFullError past the bound."""
        requests = list(requests)
        keys = [(r.stream, r.id) for r in requests]
        duplicates = {k for k in keys if k in self._live} | {k for k in keys if keys.count(k) > 1}
        if duplicates:
            raise ValueError(f"sequence ids already in flight: {sorted(k[1] for k in duplicates)[:5]}")
        limit = self.config.max_running + self.config.max_queued
        if len(self._live) + len(requests) > limit:
            raise QueueFullError(
                f"rollout queue full: {len(self._live)} sequences in sglang, {len(requests)} more requested, "
                f"max_running + max_queued = {limit}"
            )
        for r in requests:
            if r.sampling.return_routed_experts:
                if self._routes_refusal is not None:
                    raise ValueError(f"sequence {r.id!r}: return_routed_experts refused: {self._routes_refusal}")
                assert self.moe is not None
                check_routed_experts(r.id, r.routed_experts, num_layers=len(self.moe.moe_layers), top_k=self.moe.top_k,
                                     num_positions=len(r.prompt_ids) + len(r.output_ids) - 1)
        if any(r.sampling.seed for r in requests):
            log.warning("per-request seeds are ignored by the sglang engine")
        for r in requests:
            entry = _Request(request=r, rid="", version=self.version, output_ids=list(r.output_ids),
                             output_logprobs=list(r.output_logprobs), output_versions=list(r.output_versions))
            if r.sampling.return_routed_experts and self.moe is not None:
                entry.routes = RouteBuffer(len(self.moe.moe_layers), self.moe.top_k, r.routed_experts,
                                           capacity=len(r.prompt_ids) + (r.sampling.max_new_tokens or 64))
            if r.tools is not None:
                entry.tool_mask = list(r.output_tool_mask) or [False] * len(r.output_ids)
                entry.tools = self._turns.session(r, entry.tool_mask)
            if entry.remaining(self.max_seq_len) <= 0:
                self._finished_on_add.append(self._result(entry, FinishReason.LENGTH))
            elif self._turns.unanswered(entry):  # a partial drained while its tool ran: the call runs again
                if self._turns.end_turn(entry, counted=False):
                    self._live[entry.key] = entry
                else:
                    self._finished_on_add.append(self._result(entry, FinishReason.STOP))
            else:
                self._submit(entry)

    def _submit(self, entry: _Request) -> None:
        o = entry.request.sampling
        self._rid_counter += 1
        entry.rid = f"everstep-{self._rid_counter}"
        entry.version, entry.finish, entry.error, entry.new_tokens = self.version, None, "", 0
        entry.cached_tokens = 0
        sampling_params = sglang_api.sampling_params(o, entry.remaining(self.max_seq_len))
        if entry.tools is not None:
            # a turn ends at the tokens the torch engine ends it at (sglang's own EOS set stops it too)
            sampling_params["stop_token_ids"] = sorted(self.eos_token_ids)
        input_ids = [*entry.request.prompt_ids, *entry.output_ids]
        entry.input_len = len(input_ids)
        entry.task = self._loop.create_task(self._consume(entry, input_ids, sampling_params))
        self._live[entry.key] = entry

    async def _consume(self, entry: _Request, input_ids: list[int], sampling_params: dict) -> None:
        try:
            routing = {}
            if entry.routes is not None:
                routing["return_routed_experts"] = True
                # Positions it has routes for are not sent back (those it has are kept anyway).
                if "routed_experts_start_len" in sglang_api.request_fields(self._new_request_type()):
                    routing["routed_experts_start_len"] = entry.routes_start = entry.routes.length
                else:
                    entry.routes_start = 0
            request = self._new_request(input_ids=input_ids, sampling_params=sampling_params, return_logprob=True,
                                        stream=True, rid=entry.rid, **routing)
            async for chunk in self._sgl.tokenizer_manager.generate_request(request, None):
                self._absorb(entry, chunk)
        except Exception as e:  # noqa: BLE001 - an aborted request may end in an error; kept on the entry
            entry.error = f"{type(e).__name__}: {e}"
        if entry.finish is None:
            entry.finish = FinishReason.ABORTED

    def _absorb(self, entry: _Request, chunk: Mapping) -> None:
        """Append the chunk's new tokens, record its routes and its end."""
        read = sglang_api.read_chunk(chunk, entry.new_tokens)
        for token_id, logprob in read.tokens:
            entry.output_ids.append(token_id)
            entry.output_logprobs.append(logprob)
            entry.output_versions.append(entry.version)
            if entry.tool_mask is not None:
                entry.tool_mask.append(False)
        if read.cached_tokens is not None:
            entry.cached_tokens = read.cached_tokens
        entry.new_tokens += len(read.tokens)
        self._throughput.record(time.monotonic(), len(read.tokens))
        if entry.routes is not None and read.routed_experts is not None and len(read.routed_experts):
            assert self.moe is not None
            rows = entry.input_len + entry.new_tokens - 1 - entry.routes_start
            entry.routes.record(entry.routes_start, sglang_api.sglang_routes(
                read.routed_experts, positions=rows, num_hidden_layers=self.num_hidden_layers,
                moe_layers=self.moe.moe_layers, top_k=self.moe.top_k))
        if read.finish is not None:
            entry.finish = read.finish
            if entry.continues_trajectory:
                self.tool_continuation_input_tokens += entry.input_len
                self.tool_continuation_cached_tokens += entry.cached_tokens
                if entry.cached_tokens < entry.history_len - 1:
                    self.num_tool_evictions += 1

    def drain(self, stream: int | None = None) -> list[SequenceResult]:
        """Abort every live request (of `stream`, or all) and return what each generated."""
        entries = [e for e in self._live.values() if stream is None or e.request.stream == stream]
        self._abort(entries)
        for e in entries:
            if self._turns.cancel(e):  # a drained call runs again where the partial is continued
                e.finish = FinishReason.ABORTED
            elif e.finish == FinishReason.STOP and self._turn_ended_with_calls(e):
                e.finish = FinishReason.ABORTED  # the partial ends with its calls; they run where it continues
        return [self._result(e, e.finish or FinishReason.ABORTED) for e in entries]

    def _abort(self, entries: list[_Request]) -> None:
        self._loop.abort(self._sgl.tokenizer_manager, {e.task: e.rid for e in entries if e.task is not None})
        for e in entries:
            del self._live[e.key]

    # -- weights ----------------------------------------------------------------------------------------

    def update_weights(self, named_tensors: Mapping[str, torch.Tensor], version: int, *,
                       may_keep: bool = False) -> int:
        """Swap weights through `update_weights_from_tensor` (always a copy: `may_keep` is not used); running
        requests continue under the new ones."""
        num_bytes = sum(t.numel() * t.element_size() for t in named_tensors.values())
        owned = [(name, cuda_ipc.owned(t)) for name, t in named_tensors.items()]  # sglang re-shares them
        self._swap(lambda: self._loop.sync(lambda: self._sgl.update_weights_from_tensor(named_tensors=owned,
                                                                                    flush_cache=True)), version)
        return num_bytes

    def init_weights_update_group(self, *, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str = "everstep", backend: str = "nccl") -> None:
        """Join a torch.distributed group with the trainer (which is rank 0) for broadcast weight updates."""
        sglang_api.check_result(self._loop.sync(lambda: self._sgl.init_weights_update_group(
            master_address=master_address, master_port=master_port, rank_offset=rank_offset,
            world_size=world_size, group_name=group_name, backend=backend,
        )), "init_weights_update_group")

    def update_weights_from_distributed(self, *, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        version: int, group_name: str = "everstep") -> None:
        """Receive the named tensors the trainer broadcasts on the group (it must broadcast them meanwhile)."""
        self._swap(lambda: self._loop.sync(lambda: self._sgl.update_weights_from_distributed(
            names=names, dtypes=dtypes, shapes=shapes, group_name=group_name, flush_cache=True)), version)

    def _swap(self, update, version: int) -> None:
        entries = [e for e in self._live.values() if not e.paused]  # paused ones have no request in sglang
        self._abort(entries)
        sglang_api.check_result(update(), "weight update")
        self.version = version
        for e in entries:
            if self._trim_to_routes(e):
                e.finish = None  # continued from the tokens it has routes for
            if e.finish == FinishReason.STOP and self._pause_for_tools(e):
                self._live[e.key] = e
                continue
            if e.finish == FinishReason.ABORTED or e.finish is None:
                if e.remaining(self.max_seq_len) > 0:
                    self._submit(e)  # continues from prompt + output so far, under the new weights
                    continue
                e.finish = FinishReason.LENGTH
            self._finished_on_add.append(self._result(e, e.finish))

    # -- the step ---------------------------------------------------------------------------------------

    def step(self) -> list[SequenceResult]:
        """Let sglang run for a moment; return the sequences that finished meanwhile."""
        start = time.perf_counter()
        finished, self._finished_on_add = self._finished_on_add, []
        finished += self._take_tool_replies()
        before = sum(len(e.output_ids) for e in self._live.values())
        tasks = [e.task for e in self._live.values() if e.task is not None]
        if tasks:
            self._loop.run(asyncio.wait(tasks, timeout=_POLL_SECONDS, return_when=asyncio.FIRST_COMPLETED))
        else:
            self._turns.wait(self._live.values())  # nothing in sglang until a tool replies
        generated = sum(len(e.output_ids) for e in self._live.values()) - before
        reasons: dict[FinishReason, int] = {}
        for e in [e for e in self._live.values() if e.task is not None and e.task.done()]:
            reason = e.finish or FinishReason.ABORTED
            if reason == FinishReason.STOP and self._pause_for_tools(e):
                continue  # its tools run; its next turn is submitted when they reply
            del self._live[e.key]
            if reason == FinishReason.ABORTED:
                log.warning("sglang request %s (%s) ended without finishing: %s", e.rid, e.request.id,
                            e.error or "aborted")
            finished.append(self._result(e, reason))
            reasons[reason] = reasons.get(reason, 0) + 1
        seconds = time.perf_counter() - start
        self.last_step = StepStats(num_decoded=generated, num_prefilled=0, decode_seconds=seconds,
                                   step_seconds=seconds, finished=reasons,
                                   num_paused=sum(1 for e in self._live.values() if e.paused),
                                   num_tool_evictions=self.num_tool_evictions)
        return finished

    # -- tools ------------------------------------------------------------------------------------------

    def _pause_for_tools(self, e: _Request) -> bool:
        """A request that stopped: when it ended a model turn with tool calls, its calls are submitted and it
        waits for them (True; it has no request in sglang until they reply)."""
        if not self._turns.end_turn(e):
            return False
        e.task = None
        return True

    def _turn_ended_with_calls(self, e: _Request) -> bool:
        """A drained request that stopped at the end of a turn with tool calls (counted as a turn, as the torch
        engine counts a turn paused when drained); its calls are not run here."""
        if not self._turns.at_end_of_turn(e):
            return False
        assert e.tools is not None
        ended = e.tools.end_turn(e.output_ids, lambda *_: concurrent.futures.Future())
        e.tools.pending = None
        return ended

    def _take_tool_replies(self) -> list[SequenceResult]:
        """Sequences whose tool calls replied: the reply's tokens are appended and the next turn is submitted
        (input = the whole trajectory; sglang's radix cache holds its history). Returns those that finished (the
        environment ended the episode, or the reply would not fit), as the torch engine does."""
        finished = []
        for reply in self._turns.replies(self._live.values(), self.max_seq_len):
            e, reply_ids = reply.seq, reply.reply_ids
            if reply.finish is not None:
                del self._live[e.key]
                finished.append(self._result(e, reply.finish))
                continue
            assert e.tool_mask is not None
            e.history_len = len(e.request.prompt_ids) + len(e.output_ids)
            e.output_ids.extend(reply_ids)
            e.output_logprobs.extend([0.0] * len(reply_ids))
            e.output_versions.extend([-1] * len(reply_ids))
            e.tool_mask.extend([True] * len(reply_ids))
            e.continues_trajectory = True
            self._submit(e)
        return finished

    def _result(self, e: _Request, reason: FinishReason) -> SequenceResult:
        if self._trim_to_routes(e):
            reason = FinishReason.ABORTED  # no longer finished: it continues from the kept tokens
        self._turns.close(e, reason)
        return e.result(reason, self.tokenizer)

    def _trim_to_routes(self, e: _Request) -> bool:
        """Keep output tokens only with the routes of the input each was sampled from (output i: position
        len(prompt) + i - 1). sglang returns routes when a request ends; one that ended without them (an abort)
        gives back the tokens it generated beyond them. True when tokens were dropped."""
        if e.routes is None or not e.rid:  # not asked, or never sent to sglang (its routes are what it came with)
            return False
        keep = max(len(e.request.prompt_ids) - 1, e.routes.length) - len(e.request.prompt_ids) + 1
        if e.tool_mask:  # tool tokens, like the prompt's, take their routes from whichever prefill computes them
            keep = max(keep, max((i + 1 for i, is_tool in enumerate(e.tool_mask) if is_tool), default=0))
        if keep >= len(e.output_ids):
            return False
        log.warning("sequence %s: sglang returned no routes for its last %d output tokens; they are dropped",
                    e.request.id, len(e.output_ids) - keep)
        del e.output_ids[keep:], e.output_logprobs[keep:], e.output_versions[keep:]
        if e.tool_mask is not None:
            del e.tool_mask[keep:]
        return True

    def shutdown(self) -> None:
        """Abort what runs, stop sglang's processes (and free the GPU memory they hold), close the loop."""
        try:
            if self._live:
                self._abort(list(self._live.values()))
        finally:
            self._turns.shutdown()
            self._sgl.shutdown()
            self._loop.close()
