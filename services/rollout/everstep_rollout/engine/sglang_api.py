"""sglang as the sglang engine meets it, apart from the engine's bookkeeping: the import (sglang lives in an
environment of its own), the fields its generate request has in this version, its routed-experts format, the
answers of its weight-update calls, the signal handler its launch installs, and the parameter count of a
checkpoint it loads. Written against sglang 0.5.3's source (the pinned version) and, for routed experts, its
source after; tested against stand-ins, not against sglang.

Routed experts (`return_routed_experts`), written against sglang's source after 0.5.3 (its PR #12162,
"Enable return routed experts", and the later `routed_experts_start_len`): 0.5.3, the pinned version, has no
such API, so the sglang engine refuses the option there (ValueError naming return_routed_experts and why), as it
does for a dense model. Where sglang has it (`ServerArgs.enable_return_routed_experts`,
`GenerateReqInput.return_routed_experts`), the engine is started with the capture on (for an MoE model) and
each request that asks sets `return_routed_experts=True` and `routed_experts_start_len` = the positions it
already has routes for. sglang answers once, when the request ends, with `meta_info["routed_experts"]`:
base64 of little-endian int32 ids [positions start..seqlen-2][every decoder layer][top_k]
(`routed_experts_capturer.extract_routed_experts_from_meta_info`); `sglang_routes` keeps the MoE layers and
converts them to uint8 [position][moe layer][k]. sglang collects routes for a finished request; an abort that
does not reach its scheduler's finish path has none.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import logging
import signal
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from everstep.model_config import MAX_ROUTED_EXPERTS
from everstep_rollout.engine.interface import EngineUnavailableError
from everstep_rollout.sequence import FinishReason

log = logging.getLogger(__name__)

_ABORT_TIMEOUT_SECONDS = 60.0
_ABORT_RETRY_SECONDS = 0.05
_FINISH_REASONS = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORTED}

GPU_EXTRA_HINT = ("sglang runs in an environment of its own on a CUDA machine: `make sglang-venv` (then run the "
                  "rollout server with .venv-sglang/bin/python), or the image deploy/docker/rollout-sglang.Dockerfile")


def import_sglang():
    """The sglang module, or EngineUnavailableError naming the extra that provides it."""
    try:
        import sglang
    except ImportError as e:
        raise EngineUnavailableError(f"engine 'sglang' needs the sglang package ({e}); {GPU_EXTRA_HINT}") from e
    return sglang


@dataclass(frozen=True)
class Chunk:
    """What one streamed chunk of a request brings."""

    tokens: list[tuple[int, float]]
    """The (token id, log-prob) pairs not seen in earlier chunks."""
    cached_tokens: int | None
    """The request's input tokens sglang found in its radix cache (when it says)."""
    routed_experts: object
    """`meta_info["routed_experts"]` as sglang sent it (`sglang_routes` reads it); None when absent."""
    finish: FinishReason | None
    """How the request ended; None while it runs."""


def read_chunk(chunk: Mapping, num_seen: int) -> Chunk:
    """A chunk of `tokenizer_manager.generate_request`, of a request whose earlier chunks brought `num_seen` tokens;
    chunks may be cumulative or incremental (a server setting).

    Tokens and log-probs come from `meta_info["output_token_logprobs"]` ((logprob, token_id, text) triples).
    sglang's default log-prob is log_softmax(logits / T) of the sampled token before top-k/top-p filtering
    (T = 1 when greedy), the same quantity the torch engine records; do not set SGLANG_RETURN_ORIGINAL_LOGPROB,
    which switches it to the untempered distribution."""
    meta = chunk["meta_info"]
    triples = meta.get("output_token_logprobs") or []
    total = meta.get("completion_tokens")
    new = max(0, (total if total is not None else len(triples)) - num_seen)
    fresh = triples[len(triples) - new :] if new else ()
    tokens = [(int(token_id), float(logprob)) for logprob, token_id, *_ in fresh]
    cached = meta.get("cached_tokens")
    reason, finish = meta.get("finish_reason"), None
    if reason is not None:
        kind = reason.get("type") if isinstance(reason, Mapping) else str(reason)
        finish = _FINISH_REASONS.get(kind, FinishReason.STOP)
    return Chunk(tokens=tokens, cached_tokens=None if cached is None else int(cached),
                 routed_experts=meta.get("routed_experts"), finish=finish)


def sglang_routes(value, *, positions: int, num_hidden_layers: int, moe_layers: tuple[int, ...],
                  top_k: int) -> np.ndarray:
    """sglang's `meta_info["routed_experts"]` as our layout: uint8 [positions, len(moe_layers), top_k].

    sglang sends base64 of little-endian int32 [positions][num_hidden_layers][top_k] (every decoder layer; a
    dense layer's rows hold nothing routed); a tensor or array (skip_tokenizer_init) of the same ids is taken
    too, as is one that holds the MoE layers only. ValueError when the size fits neither."""
    if isinstance(value, str):
        value = base64.b64decode(value)
    if isinstance(value, bytes | bytearray | memoryview):
        ids = np.frombuffer(value, dtype="<i4")
    elif isinstance(value, torch.Tensor):
        ids = value.cpu().numpy().reshape(-1)
    else:
        ids = np.asarray(value).reshape(-1)
    per_layer = positions * top_k
    if per_layer and ids.size == per_layer * num_hidden_layers:
        ids = ids.reshape(positions, num_hidden_layers, top_k)[:, list(moe_layers)]
    elif ids.size == per_layer * len(moe_layers):
        ids = ids.reshape(positions, len(moe_layers), top_k)
    else:
        raise ValueError(f"sglang routed_experts has {ids.size} ids; {positions} positions x top-{top_k} x "
                         f"{num_hidden_layers} layers ({len(moe_layers)} MoE) expected")
    if ids.size and (ids.min() < 0 or ids.max() >= MAX_ROUTED_EXPERTS):
        raise ValueError(f"sglang routed_experts holds expert ids outside [0, {MAX_ROUTED_EXPERTS})")
    return ids.astype(np.uint8)


def request_fields(request_type) -> set[str]:
    if dataclasses.is_dataclass(request_type):
        return {f.name for f in dataclasses.fields(request_type)}
    return set(getattr(request_type, "__annotations__", {}))


def has_routed_experts(request_type) -> bool:
    """Whether sglang's generate request takes return_routed_experts (sglang after 0.5.3)."""
    return "return_routed_experts" in request_fields(request_type)


_SIGNAL_PATCH = threading.Lock()


@contextlib.contextmanager
def signal_handlers_skipped_off_main_thread():
    """Let sglang.Engine be built on a gRPC thread (a `Load` call), not only on the main thread.

    sglang 0.5.3's launch registers a SIGQUIT handler with `signal.signal`, which raises ValueError
    ("signal only works in main thread") anywhere else. Off the main thread, `signal.signal` is replaced
    for the duration of the build by one that skips the registration (with a warning) and returns the
    current handler; a failing sglang child then ends this process by SIGQUIT's default action instead of
    sglang's handler killing the process tree. On the main thread nothing changes.
    """
    if threading.current_thread() is threading.main_thread():
        yield
        return
    original = signal.signal

    def skip(signum, handler):
        log.warning("sglang's handler for %s not installed: the engine is built off the main thread",
                    signal.Signals(signum).name)
        return signal.getsignal(signum)

    with _SIGNAL_PATCH:
        signal.signal = skip
        try:
            yield
        finally:
            signal.signal = original


def check_result(result, what: str) -> None:
    """sglang's update calls answer (success, message) (older versions: a dict or None)."""
    if isinstance(result, tuple) and result and result[0] is False:
        raise RuntimeError(f"sglang {what} failed: {result[1] if len(result) > 1 else ''}")
    if isinstance(result, Mapping) and result.get("success") is False:
        raise RuntimeError(f"sglang {what} failed: {result.get('message', '')}")


def count_parameters(model_dir: Path) -> int:
    """Parameters in the checkpoint's safetensors headers (no tensor is loaded)."""
    from safetensors import safe_open

    total = 0
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 - safe_open is not iterable
                total += int(torch.Size(st.get_slice(name).get_shape()).numel())
    return total


class SglangLoop:
    """The one event loop every sglang call of an engine runs on.

    sglang's `Engine` has no loop of its own. Its sync methods run `asyncio.get_event_loop().run_until_complete(...)`
    on the calling thread's loop, and `TokenizerManager.abort_request` sends on a `zmq.asyncio` socket, whose `send`
    makes an `asyncio.Future` and so needs a current loop. The engine-loop thread that drives the engine has none, so
    the engine owns this loop, makes it the calling thread's current loop before every sync sglang call (`sync`),
    and sends aborts from a coroutine running on it (`abort`).
    """

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()

    def sync(self, call):
        """Run a sync sglang method: they all use `asyncio.get_event_loop()` of the calling thread."""
        asyncio.set_event_loop(self._loop)
        return call()

    def run(self, awaitable):
        asyncio.set_event_loop(self._loop)
        return self._loop.run_until_complete(awaitable)

    def create_task(self, coroutine) -> asyncio.Task:
        return self._loop.create_task(coroutine)

    def abort(self, tokenizer_manager, running: Mapping[asyncio.Task, str]) -> None:
        """Abort the requests of these tasks (task -> rid) and wait for the tasks to end (cancelled after a minute)."""

        async def abort_and_wait() -> None:
            # On the loop, in a coroutine: abort_request sends on a zmq.asyncio socket (see the class docstring).
            # sglang ignores an abort for a rid it has not registered yet (a request added just before, whose
            # task has not reached the scheduler), so the abort is repeated until every task has ended.
            pending = set(running)
            deadline = time.monotonic() + _ABORT_TIMEOUT_SECONDS
            while pending and time.monotonic() < deadline:
                for task in pending:
                    tokenizer_manager.abort_request(rid=running[task])
                _, pending = await asyncio.wait(pending, timeout=_ABORT_RETRY_SECONDS)
            for task in pending:
                task.cancel()

        self.run(abort_and_wait())

    def close(self) -> None:
        """Cancel what is left on the loop (sglang's output handler among it), then close it."""
        try:
            leftover = asyncio.all_tasks(self._loop)
            for task in leftover:
                task.cancel()
            if leftover:
                self.run(asyncio.wait(leftover, timeout=5.0))
        except Exception as e:  # noqa: BLE001 - best effort at shutdown
            log.debug("sglang engine loop: %s while cancelling its tasks", e)
        finally:
            self._loop.close()


def sampling_params(options, max_new_tokens: int) -> dict:
    """A request's sampling options (`sequence.SamplingOptions`) in sglang's names (its `SamplingParams`). Its
    penalizers count the tokens generated by this request only: a continued partial or a turn after a tool reply
    starts their counts afresh (the torch engine counts the whole output), and its log-probs come from the
    penalised logits (the torch engine's do not)."""
    o = options
    params: dict = {"temperature": o.temperature, "top_p": o.top_p if 0 < o.top_p < 1 else 1.0,
                    "top_k": o.top_k if o.top_k > 0 else -1, "max_new_tokens": max_new_tokens}
    if o.min_p > 0:
        params["min_p"] = o.min_p
    if o.penalized:
        params.update(repetition_penalty=o.repetition_penalty, presence_penalty=o.presence_penalty,
                      frequency_penalty=o.frequency_penalty)
    if o.stop:
        params["stop"] = list(o.stop)
    return params
