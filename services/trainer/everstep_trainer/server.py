"""gRPC `everstep.v1.Trainer` service around one `PolicyTrainer`, plus the process wiring."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from dataclasses import fields
from pathlib import Path

import grpc
import torch
from google.protobuf.unknown_fields import UnknownFieldSet
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import start_http_server

from everstep.settings.codec import TRAINER_CONFIG
from everstep.settings.training import TrainerConfig
from everstep.transport.channels import bind, new_server
from everstep.v1 import trainer_pb2, trainer_pb2_grpc
from everstep_trainer import metrics
from everstep_trainer.batch.samples import TrainSample
from everstep_trainer.model.checkpoint import read_checkpoint_meta
from everstep_trainer.model.distributed import init_distributed_from_env, rank_device
from everstep_trainer.rank_commands import CommandRunner, follow
from everstep_trainer.sample_log import SampleLog
from everstep_trainer.step.stats import TrainStats
from everstep_trainer.step.trainer import PolicyTrainer
from everstep_trainer.weight_push import GRPC_MAX_MESSAGE_BYTES, Transport, WeightPusher, WeightPushError
from everstep_trainer.weight_push.base import lora_adapter_proto

__all__ = ["TrainerService", "config_from_proto", "serve",
           "serve_distributed", "stats_to_proto"]

log = logging.getLogger(__name__)


def config_from_proto(message: trainer_pb2.TrainerConfig) -> TrainerConfig:
    """The trainer's config a Load or LoadCheckpoint carries: `everstep.settings.codec.TRAINER_CONFIG` (a field
    left unset takes its default, a field set to 0 is 0, a field this trainer does not know is an error: fields
    5 and 11 were the strings correction and aggregation of a sender built before trainer.proto's enums)."""
    return TRAINER_CONFIG.from_proto(message)


def _transport_from_proto(request: trainer_pb2.PushWeightsRequest) -> Transport | None:
    """The request's transport; None: the trainer's --weight-transport. The string field 3 of a sender built
    before WeightTransport is an error, never a silent push over the default."""
    if any(f.field_number == 3 for f in UnknownFieldSet(request)):
        raise ValueError("transport: field 3 is unknown to this trainer (the string transport of a sender built "
                         "before trainer.proto's WeightTransport)")
    return Transport.from_proto(request.transport)


def stats_to_proto(stats: TrainStats) -> trainer_pb2.TrainStats:
    proto_fields = {f.name for f in trainer_pb2.TrainStats.DESCRIPTOR.fields}
    return trainer_pb2.TrainStats(**{f.name: getattr(stats, f.name) for f in fields(stats)
                                     if f.name in proto_fields})


def _samples_from_proto(request: trainer_pb2.TrainStepRequest | trainer_pb2.ReferenceKlRequest) -> list[TrainSample]:
    """The request's samples; their fields are checked by `PolicyTrainer.check_samples`."""
    return [TrainSample(prompt_ids=list(s.prompt_ids), output_ids=list(s.output_ids),
                        rollout_logprobs=list(s.rollout_logprobs), advantage=s.advantage,
                        output_versions=list(s.output_versions), routed_experts=bytes(s.routed_experts),
                        output_tool_mask=list(s.output_tool_mask))
            for s in request.samples]


class TrainerService(trainer_pb2_grpc.TrainerServicer):
    """Serialises every call on one lock: steps, pushes and saves must see consistent weights, and
    with several ranks the commands must reach every rank in one order."""

    def __init__(self, runner: CommandRunner | None = None, pusher: WeightPusher | None = None,
                 sample_log: SampleLog | None = None) -> None:
        self._lock = threading.Lock()
        self._runner = runner if runner is not None else CommandRunner()
        self._pusher = pusher or WeightPusher()
        self._sample_log = sample_log

    def close(self, timeout_seconds: float | None = None) -> bool:
        """Release what the weight pusher keeps between pushes (shared memory, broadcast groups), once the call
        in flight (a train step, a push) has ended; with `timeout_seconds`, at the latest then. Returns whether
        the call in flight had ended (False: the pusher was closed under it, which fails a push in flight; the
        engines keep their weights)."""
        ended = self._lock.acquire(timeout=-1 if timeout_seconds is None else max(0.0, timeout_seconds))
        try:
            self._pusher.close()
        finally:
            if ended:
                self._lock.release()
        return ended

    def _require_trainer(self, context: grpc.ServicerContext) -> PolicyTrainer:
        if self._runner.trainer is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "no model loaded: call Load first")
        return self._runner.trainer

    def Load(self, request: trainer_pb2.TrainerLoadRequest, context: grpc.ServicerContext):  # noqa: N802
        if not request.model_path:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "model_path: must not be empty")
        if request.version < 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"version: must be >= 0, got {request.version}")
        try:
            config = config_from_proto(request.config)
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if not (Path(request.model_path) / "config.json").is_file():
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"model_path: {request.model_path} is not a Hugging Face model directory (no config.json)")
        with self._lock:
            try:
                trainer = self._runner.load(request.model_path, config, request.version)
            except ValueError as e:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            metrics.POLICY_VERSION.set(trainer.version)
            log.info("loaded %s (%d parameters) at version %d on %s, %d rank(s)", request.model_path,
                     trainer.num_parameters, trainer.version, trainer.device, trainer.ranks.world_size)
            return trainer_pb2.TrainerLoadResponse(version=trainer.version, num_parameters=trainer.num_parameters)

    def LoadCheckpoint(self, request: trainer_pb2.LoadCheckpointRequest, context: grpc.ServicerContext):  # noqa: N802
        if not request.path:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "path: must not be empty")
        config = None
        if request.HasField("config"):
            try:
                config = config_from_proto(request.config)
            except ValueError as e:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        try:
            read_checkpoint_meta(request.path)  # fails here, on rank 0 alone, before any rank loads
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        with self._lock:
            try:
                meta = self._runner.resume(request.path, config)
            except ValueError as e:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            trainer = self._runner.trainer
            metrics.POLICY_VERSION.set(trainer.version)
            log.info("resumed %s at version %d, train step %d, %d rank(s)", request.path, trainer.version,
                     trainer.num_train_steps, trainer.ranks.world_size)
            return trainer_pb2.LoadCheckpointResponse(version=trainer.version, num_parameters=trainer.num_parameters,
                                                      train_step=trainer.num_train_steps,
                                                      data_position=meta.data_position)

    def TrainStep(self, request: trainer_pb2.TrainStepRequest, context: grpc.ServicerContext):  # noqa: N802
        with self._lock:
            trainer = self._require_trainer(context)
            try:
                samples = _samples_from_proto(request)
                trainer.check_samples(samples)  # on rank 0 alone, before any rank starts the step
                version, stats = self._runner.train_step(samples)
            except ValueError as e:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            metrics.observe_train_step(stats, version)
            log.info("train step -> version %d: loss=%.5f grad_norm=%.4f masked_fraction=%.4f tokens=%d",
                     version, stats.loss, stats.grad_norm, stats.masked_fraction, stats.num_tokens)
            reply = trainer_pb2.TrainStepResponse(version=version, stats=stats_to_proto(stats))
            if self._sample_log is not None:
                self._sample_log.append(version, reply.stats, request)
            return reply

    def ReferenceKl(self, request: trainer_pb2.ReferenceKlRequest, context: grpc.ServicerContext):  # noqa: N802
        with self._lock:
            trainer = self._require_trainer(context)
            try:
                samples = _samples_from_proto(request)
                trainer.check_samples(samples, training=False)  # on rank 0 alone, before any rank scores them
                result = self._runner.reference_kl(samples)
            except ValueError as e:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            metrics.observe_reward_kl(result.kl_mean, result.kl_coef)
            log.info("reference KL of %d samples: %.5f per token, coefficient %g", len(samples), result.kl_mean,
                     result.kl_coef)
            return trainer_pb2.ReferenceKlResponse(kl_sums=result.kl_sums, kl_coef=result.kl_coef,
                                                   kl_mean=result.kl_mean, num_tokens=result.num_tokens)

    def PushWeights(self, request: trainer_pb2.PushWeightsRequest, context: grpc.ServicerContext):  # noqa: N802
        if not request.endpoints:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "endpoints: at least one endpoint is required")
        if request.bucket_bytes < 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bucket_bytes: must be >= 0, got {request.bucket_bytes}")
        try:
            setting = _transport_from_proto(request)
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if len(set(request.endpoints)) != len(request.endpoints):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"endpoints: duplicates in {list(request.endpoints)}")
        with self._lock:
            trainer = self._require_trainer(context)
            start = time.perf_counter()
            weights = self._runner.gather_weights()
            try:
                report = self._pusher.push(weights.tensors.items(), version=trainer.version,
                                           endpoints=list(request.endpoints), setting=setting,
                                           bucket_bytes=request.bucket_bytes or None,
                                           adapter=lora_adapter_proto(weights.adapter))
            except WeightPushError as e:
                context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
            seconds = time.perf_counter() - start  # the gather (several ranks) counts as part of the push
            metrics.observe_weight_push(seconds, [(r.transport, r.num_bytes, r.seconds) for r in report.results])
            log.info("pushed version %d to %d endpoint(s) (%s): %d bytes in %.3fs", report.version,
                     len(report.transports), ", ".join(sorted(set(report.transports.values()))), report.num_bytes,
                     seconds)
            return trainer_pb2.PushWeightsResponse(
                version=report.version, num_bytes=report.num_bytes, seconds=seconds, transports=report.transports,
                num_kept_in_place=sum(r.num_kept_in_place for r in report.results))

    def SaveCheckpoint(self, request: trainer_pb2.SaveCheckpointRequest, context: grpc.ServicerContext):  # noqa: N802
        if not request.path:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "path: must not be empty")
        with self._lock:
            trainer = self._require_trainer(context)
            start = time.perf_counter()
            path = self._runner.save_checkpoint(request.path, request.data_position)
            metrics.observe_checkpoint(time.perf_counter() - start)
            log.info("saved version %d (train step %d) to %s", trainer.version, trainer.num_train_steps, path)
            return trainer_pb2.SaveCheckpointResponse(path=str(path), version=trainer.version,
                                                      train_step=trainer.num_train_steps)


STOP_GRACE_SECONDS = 5.0
"""After SIGTERM/SIGINT: how long the call in flight may take before the trainer exits without it (well within
Kubernetes' default 30 s termination grace period)."""


def _serve_grpc(runner: CommandRunner, *, host: str, port: int, grpc_port: int, max_workers: int,
                weight_transport: str, weight_group_host: str, sample_log: str = "",
                shm_one_copy: bool = True) -> None:
    """Prometheus on `port`, gRPC (Trainer + health) on `grpc_port`, until SIGTERM/SIGINT.

    `weight_transport`: default transport of PushWeights ("auto" or a name, see weight_push).
    `weight_group_host`: address engines reach this trainer at for a nccl/gloo weight group ("": the
    bind address if it is a specific one, else 127.0.0.1 for engines on this host's loopback and an
    error naming group_host for remote ones; see weight_push/collective.py).
    `sample_log`: path of the record of trained samples ("": none; see sample_log.py).
    `shm_one_copy`: full shm pushes let engines run on the segment (see weight_push/shm.py).
    """
    if not weight_group_host and host not in ("", "0.0.0.0", "::"):
        weight_group_host = host
    service = TrainerService(runner, WeightPusher(setting=weight_transport, group_host=weight_group_host,
                                                        shm_one_copy=shm_one_copy),
                             SampleLog(sample_log) if sample_log else None)
    start_http_server(port, addr=host)
    server = new_server(max_workers, GRPC_MAX_MESSAGE_BYTES)
    trainer_pb2_grpc.add_TrainerServicer_to_server(service, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    bind(server, f"{host}:{grpc_port}")
    server.start()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_servicer.set("everstep.v1.Trainer", health_pb2.HealthCheckResponse.SERVING)
    metrics.WORLD_SIZE.set(runner.ranks.world_size)
    log.info("trainer serving gRPC on %s:%d, metrics on %s:%d (%d rank(s))", host, grpc_port, host, port,
             runner.ranks.world_size)

    stopping = threading.Event()

    def _stop(signum: int, _frame: object) -> None:
        log.info("received signal %d, stopping", signum)
        stopping.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    stopping.wait()
    deadline = time.monotonic() + STOP_GRACE_SECONDS
    health_servicer.enter_graceful_shutdown()
    server.stop(grace=STOP_GRACE_SECONDS).wait(STOP_GRACE_SECONDS + 1)
    if not service.close(timeout_seconds=deadline - time.monotonic()):
        # A train step (minutes on a real model) or a push still runs on a gRPC thread, and Python would wait for
        # it at exit: past Kubernetes' grace period, SIGKILL. Its step is lost either way (the controller resumes
        # from the last checkpoint), so leave now.
        log.warning("a train step or weight push was still running %.0f s after the signal; exiting without it",
                    STOP_GRACE_SECONDS)
        logging.shutdown()
        os._exit(0)
    log.info("trainer stopped")


def serve(*, host: str, port: int, grpc_port: int, max_workers: int = 8, weight_transport: str = "auto",
          weight_group_host: str = "", sample_log: str = "", shm_one_copy: bool = True) -> None:
    """One rank, in this process."""
    _serve_grpc(CommandRunner(), host=host, port=port, grpc_port=grpc_port, max_workers=max_workers,
                weight_transport=weight_transport, weight_group_host=weight_group_host, sample_log=sample_log,
                shm_one_copy=shm_one_copy)


def _exit_with_launcher() -> None:
    """Linux: get SIGTERM when torchrun dies, even by SIGKILL (torchrun gives each rank its own
    process group, so stopping torchrun's group would otherwise leave the ranks running)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def serve_distributed(*, host: str, port: int, grpc_port: int, max_workers: int = 8, weight_transport: str = "auto",
                      weight_group_host: str = "", sample_log: str = "", shm_one_copy: bool = True) -> None:
    """Under torchrun: rank 0 serves (as `serve`) and broadcasts every operation; the other ranks
    follow. FSDP2 shards the model across all of them (gloo on CPU, nccl on CUDA)."""
    _exit_with_launcher()
    ranks, group = init_distributed_from_env()
    device = rank_device()
    try:
        if ranks.is_main:
            runner = CommandRunner(ranks, group=group, device=device)
            try:
                _serve_grpc(runner, host=host, port=port, grpc_port=grpc_port, max_workers=max_workers,
                            weight_transport=weight_transport, weight_group_host=weight_group_host,
                            sample_log=sample_log, shm_one_copy=shm_one_copy)
            finally:
                runner.shutdown()
        else:
            follow(ranks, group, device)
    finally:
        torch.distributed.destroy_process_group()
