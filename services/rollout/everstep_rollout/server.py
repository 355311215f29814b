"""The gRPC `everstep.v1.Rollout` service over an EngineLoop."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from everstep.model_config import position_limit
from everstep.settings import tools as tool_settings
from everstep.settings.quantization import Quantization, quantization_from_proto, quantization_to_proto
from everstep.transport.channels import bind, new_server
from everstep.v1 import rollout_pb2, rollout_pb2_grpc
from everstep_rollout import metrics
from everstep_rollout.config import EngineConfig, resolve_max_seq_len
from everstep_rollout.engine import (
    EngineFailed,
    EngineLoop,
    EngineStatus,
    EngineUnavailableError,
    GenerationEngine,
    QueueFullError,
    Withdrawn,
    build_engine,
)
from everstep_rollout.model_files import read_config
from everstep_rollout.proto_convert import request_from_proto, result_to_proto, sampling_from_proto
from everstep_rollout.sequence import SequenceResult
from everstep_rollout.weights import AdapterMerger, SegmentCache, WeightGroupMember, WeightUpdate, receiver_info

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 256 * 2**20
_POLL_SECONDS = 0.5


@dataclass(frozen=True)
class _ClientDone:
    pass


@dataclass(frozen=True)
class _Refused:
    code: grpc.StatusCode
    message: str


class RolloutServicer(rollout_pb2_grpc.RolloutServicer):
    """Holds at most one engine; `Load` replaces it."""

    def __init__(self, engine_defaults: EngineConfig) -> None:
        self._defaults = engine_defaults
        self._lock = threading.Lock()
        self._loop: EngineLoop | None = None
        self._model_path = ""
        self._adapters: AdapterMerger | None = None
        self._weight_group: WeightGroupMember | None = None
        self._segment_cache = SegmentCache()  # the trainer's shm segments, mapped once (weights/receiver.py)
        self._receiver_info = receiver_info(engine_defaults.device)

    # -- engine lifecycle -------------------------------------------------------------------------------

    def load(self, model_path: str, *, dtype: str = "", version: int = 0, max_running: int | None = None,
             seed: int | None = None, max_seq_len: int | None = None,
             quantization: Quantization | None = None) -> GenerationEngine:
        """Stop the current engine, then build one. A setting given (not None; dtype not "") replaces the
        server's own; one the engine cannot honour is a ValueError naming it, never a silent change."""
        config = replace(
            self._defaults, dtype=dtype or self._defaults.dtype, version=version,
            quantization=self._defaults.quantization if quantization is None else quantization,
            max_running=self._defaults.max_running if max_running is None else max_running,
            seed=self._defaults.seed if seed is None else seed,
            max_seq_len=self._defaults.max_seq_len if max_seq_len is None else max_seq_len,
        )
        # Settings the model refuses fail here, with the engine before still serving.
        resolve_max_seq_len(config.max_seq_len, position_limit(read_config(Path(model_path))))
        # The old engine stops first: two engines at once would not fit one GPU (sglang takes most of it).
        with self._lock:
            old, self._loop, self._model_path = self._loop, None, ""
        if old is not None:
            old.stop("engine reset by Load")
        engine = build_engine(model_path, config)
        loop = EngineLoop(engine, on_step=metrics.observe_step).start()
        metrics.set_quantization(config.quantization.value)
        with self._lock:
            self._loop, self._model_path = loop, model_path
            self._adapters = AdapterMerger(model_path, config.device)
        return engine

    def status(self) -> EngineStatus | None:
        loop = self._loop
        return loop.status() if loop is not None else None

    def shutdown(self) -> None:
        with self._lock:
            loop, self._loop = self._loop, None
        if loop is not None:
            loop.stop("server shutting down")

    def _current(self, context: grpc.ServicerContext) -> EngineLoop:
        loop = self._loop
        if loop is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "no model loaded: call Load first")
        return loop

    # -- RPCs -------------------------------------------------------------------------------------------

    def Load(self, request, context):
        try:
            engine = self.load(
                request.model_path, dtype=request.dtype, version=request.version,
                max_running=request.max_running if request.HasField("max_running") else None,
                seed=request.seed if request.HasField("seed") else None,
                max_seq_len=request.max_seq_len if request.HasField("max_seq_len") else None,
                quantization=_requested_quantization(request.quantization))
        except FileNotFoundError as e:
            context.abort(grpc.StatusCode.NOT_FOUND, f"cannot load {request.model_path!r}: {e}")
        except EngineUnavailableError as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"cannot load {request.model_path!r}: {e}")
        except (NotImplementedError, ValueError, OSError) as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"cannot load {request.model_path!r}: {e}")
        c = engine.config
        return rollout_pb2.LoadModelResponse(
            version=engine.version, num_parameters=engine.num_parameters, max_seq_len=engine.max_seq_len,
            max_running=c.max_running, dtype=c.dtype, seed=c.seed, max_position_embeddings=engine.position_limit,
            executor=engine.executor_name, quantization=quantization_to_proto(c.quantization),
            architecture=engine.architecture)

    def Generate(self, request_iterator, context) -> Iterator[rollout_pb2.GenerateResponse]:
        loop = self._current(context)
        stream_id, events = loop.open_stream()
        outstanding: set[str] = set()
        lock = threading.Lock()

        def read_requests() -> None:
            try:
                for message in request_iterator:
                    if message.sequences:
                        try:
                            sampling = sampling_from_proto(message.sampling)
                            tools = tool_settings.from_proto(message.tools) if message.HasField("tools") else None
                            sandbox, call_format = message.tools.sandbox_address, message.tools.call_format
                            requests = [request_from_proto(s, sampling, stream_id, tools, sandbox, call_format)
                                        for s in message.sequences]
                            with lock:
                                outstanding.update(r.id for r in requests)
                            loop.submit(requests)
                        except QueueFullError as e:
                            events.put(_Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)))
                            return
                        except ValueError as e:
                            events.put(_Refused(grpc.StatusCode.INVALID_ARGUMENT, str(e)))
                            return
                    if message.drain:
                        metrics.observe_partials(loop.drain_stream(stream_id))
            except Exception as e:  # the client went away, or the engine stopped
                log.debug("generate stream %d: request reader ended: %s", stream_id, e)
            finally:
                events.put(_ClientDone())

        threading.Thread(target=read_requests, name=f"generate-reader-{stream_id}", daemon=True).start()
        client_done = False
        try:
            while True:
                with lock:
                    if client_done and not outstanding:
                        return
                try:
                    batch = [events.get(timeout=_POLL_SECONDS)]
                except queue.Empty:
                    if not context.is_active():
                        return
                    continue
                while True:
                    try:
                        batch.append(events.get_nowait())
                    except queue.Empty:
                        break
                done: list[SequenceResult] = []
                for event in batch:
                    if isinstance(event, SequenceResult):
                        with lock:
                            if event.id in outstanding:
                                outstanding.discard(event.id)
                                done.append(event)
                    elif isinstance(event, Withdrawn):
                        with lock:
                            outstanding.difference_update(event.ids)
                    elif isinstance(event, _ClientDone):
                        client_done = True
                    elif isinstance(event, _Refused):
                        context.abort(event.code, event.message)
                    elif isinstance(event, EngineFailed):
                        context.abort(grpc.StatusCode.ABORTED, event.message)
                if done:
                    metrics.observe_tool_trajectories(done)
                    yield rollout_pb2.GenerateResponse(sequences=[result_to_proto(r) for r in done])
        finally:
            loop.close_stream(stream_id)

    def Drain(self, request, context):
        partials = self._current(context).drain_all()
        metrics.observe_partials(len(partials))
        return rollout_pb2.DrainResponse(partials=[result_to_proto(p) for p in partials])

    def UpdateWeights(self, request_iterator, context):
        loop = self._current(context)
        update = WeightUpdate(engine_device=self._defaults.device, group=self._weight_group,
                              segments=self._segment_cache)
        start: float | None = None
        try:
            for bucket in request_iterator:
                start = start or time.perf_counter()
                try:
                    update.add(bucket)
                    if bucket.last:
                        copied = loop.update_weights(self._weights_of(update), update.version,
                                                     may_keep=update.engine_may_keep and update.lora is None)
                        kept = update.engine_may_keep and update.lora is None and copied == 0 < update.num_bytes
                except ValueError as e:
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"weight update rejected: {e}")
                except RuntimeError as e:  # a broadcast that failed or timed out: the group is unusable
                    self._drop_weight_group(update.group)
                    context.abort(grpc.StatusCode.ABORTED, f"weight update failed: {e}")
                if bucket.last:
                    seconds = time.perf_counter() - start
                    metrics.observe_weight_update(update.transport, seconds, update.num_bytes)
                    log.info("weights updated to version %d over %s: %d tensors, %.1f MiB in %.3fs%s", update.version,
                             update.transport, len(update.tensors), update.num_bytes / 2**20, seconds,
                             " (kept in the segment, no copy)" if kept else "")
                    return rollout_pb2.UpdateWeightsResponse(version=update.version, num_bytes=update.num_bytes,
                                                             seconds=seconds, kept_in_place=kept)
        finally:
            update.close()
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, "weight stream ended without a bucket with last=true")

    def _weights_of(self, update: WeightUpdate) -> Mapping[str, torch.Tensor]:
        """The full weights an update sets: its tensors, or an adapter's merge onto the kept base."""
        adapters = self._adapters
        assert adapters is not None, "an engine is loaded"
        if update.lora is None:
            adapters.full_update(update.tensors)
            return update.tensors
        return adapters.merged(update.tensors, rank=update.lora.rank, alpha=update.lora.alpha)

    def JoinWeightGroup(self, request, context):
        old = self._weight_group
        self._weight_group = None
        if old is not None:
            old.shutdown()
        # Forming the group blocks until every rank joined; it runs in a daemon thread so that a trainer
        # that gives up (cancels this call) does not leave a handler, and a shutdown, waiting for the timeout.
        outcome: queue.Queue = queue.Queue()

        def join() -> None:
            try:
                outcome.put(WeightGroupMember.join(request, self._defaults.device))
            except Exception as e:  # noqa: BLE001 - handed to the handler
                outcome.put(e)

        threading.Thread(target=join, name=f"join-{request.group}", daemon=True).start()
        while True:
            try:
                result = outcome.get(timeout=_POLL_SECONDS)
                break
            except queue.Empty:
                if not context.is_active():
                    return rollout_pb2.JoinWeightGroupResponse()  # cancelled: nobody reads this
        if isinstance(result, ValueError):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"cannot join weight group: {result}")
        if isinstance(result, Exception):  # the store or a rank could not be reached in time
            context.abort(grpc.StatusCode.UNAVAILABLE, f"cannot join weight group {request.group!r}: {result}")
        self._weight_group = result
        return rollout_pb2.JoinWeightGroupResponse()

    def _drop_weight_group(self, group: WeightGroupMember | None) -> None:
        if group is not None and self._weight_group is group:
            self._weight_group = None
            group.shutdown()

    def GetStatus(self, request, context):
        status = self.status()
        if status is None:
            return rollout_pb2.RolloutStatus(weight_receiver=self._receiver_info)
        return rollout_pb2.RolloutStatus(
            version=status.version, running=status.running, queued=status.queued,
            tokens_per_second=status.tokens_per_second, model_path=self._model_path,
            weight_receiver=self._receiver_info, max_seq_len=status.max_seq_len, max_running=status.max_running,
            dtype=status.dtype, quantization=quantization_to_proto(status.quantization),
            executor=status.executor, architecture=status.architecture,
        )


def _requested_quantization(value: int) -> Quantization | None:
    """The quantization a LoadModelRequest asks for (None: unset, the server's own); ValueError for an unknown value."""
    if value == rollout_pb2.QUANTIZATION_UNSPECIFIED:
        return None
    quantization = quantization_from_proto(value)
    if quantization is None:
        raise ValueError(f"quantization: unknown enum value {value}")
    return quantization


def build_server(servicer: RolloutServicer, host: str, grpc_port: int, *, max_workers: int = 32) -> tuple[
    grpc.Server, health.HealthServicer
]:
    """A started gRPC server with the Rollout and health services (health not yet SERVING)."""
    server = new_server(max_workers, MAX_MESSAGE_BYTES)
    rollout_pb2_grpc.add_RolloutServicer_to_server(servicer, server)
    health_servicer = health.HealthServicer()
    # HealthServicer reports "" as SERVING from the start; readiness waits for set_serving().
    for service in ("", "everstep.v1.Rollout"):
        health_servicer.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    bind(server, f"{host}:{grpc_port}")
    server.start()
    return server, health_servicer


def set_serving(health_servicer: health.HealthServicer) -> None:
    for service in ("", "everstep.v1.Rollout"):
        health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
