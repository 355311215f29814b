"""Wires one reward process: math worker pool, verifiers, the jobs' reward functions, scorer, gRPC (+ health),
/metrics."""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import start_http_server

from everstep.transport.channels import bind, new_server
from everstep.v1 import reward_pb2, reward_pb2_grpc
from everstep.verifiers import VERIFIER_PARAMS
from everstep_reward.config import RewardConfig
from everstep_reward.functions import FunctionSettings, FunctionVerifier
from everstep_reward.item_log import ItemLog
from everstep_reward.scoring import RewardScorer
from everstep_reward.verifiers import VerifierRegistry
from everstep_reward.verifiers.code import CodeParams, CodeVerifier
from everstep_reward.verifiers.format import FormatRules, FormatVerifier
from everstep_reward.verifiers.length import LengthParams, LengthVerifier
from everstep_reward.verifiers.math import MathVerifier, prepare_math_worker
from everstep_reward.verifiers.model import ModelVerifier, RewardModel, RewardModelSettings
from everstep_reward.verifiers.tool_use import ToolUseVerifier
from everstep_reward.worker_pool import ProcessWorkerPool

__all__ = ["RewardServicer", "function_settings", "serve"]

log = logging.getLogger(__name__)
_GRPC_GRACE_SECONDS = 5.0
SIGTERM_STOP_SECONDS = 12.0
"""The most the service takes from SIGTERM to exit, mid-scoring included: the gRPC grace, then the verifiers'
stop. The chart's terminationGracePeriodSeconds (30) is checked against it (tests/deploy); tests/reward measures
it."""
GRPC_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
"""Default limit of one gRPC message (a Score batch); EVERSTEP_GRPC_MAX_MESSAGE_BYTES overrides."""


class RewardServicer(reward_pb2_grpc.RewardServicer):
    def __init__(self, scorer: RewardScorer, item_log: ItemLog | None = None) -> None:
        self._scorer = scorer
        self._item_log = item_log

    def Score(self, request: reward_pb2.ScoreRequest, context: grpc.ServicerContext):
        problem = _id_problem(request.items)
        if problem:  # results are matched by id: refuse the batch before scoring any of it
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        results = self._scorer.score_batch(request.items)
        items = {item.id: item for item in request.items} if self._item_log is not None else {}
        try:
            for result in results:
                if not context.is_active():
                    break
                if self._item_log is not None:
                    self._item_log.append(items[result.id], result)
                yield result
        finally:
            results.close()


def _id_problem(items: Sequence[reward_pb2.RewardItem]) -> str:
    seen: set[str] = set()
    for index, item in enumerate(items):
        if not item.id:
            return f"items[{index}].id is empty"
        if item.id in seen:
            return f"items[{index}].id {item.id!r} is used by an earlier item"
        seen.add(item.id)
    return ""


def serve(config: RewardConfig) -> None:
    """Serves until SIGTERM/SIGINT, then stops gracefully."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())

    start_http_server(config.port, addr=config.host)
    grpc_server = new_server(config.grpc_threads, GRPC_MAX_MESSAGE_BYTES, balanced=True)
    health_servicer = health.HealthServicer()
    # HealthServicer starts out SERVING for "": hold that back until the math workers are warm.
    health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, grpc_server)

    pool = ProcessWorkerPool(config.math_workers, start_method=config.worker_start_method,
                             initializer=prepare_math_worker)
    code_verifier = CodeVerifier(config.sandbox_endpoint, timeout_seconds=config.code_timeout_seconds,
                                 defaults=CodeParams(reward_mode=config.code_reward_mode,
                                                     run_timeout_seconds=config.code_run_timeout_seconds,
                                                     compile_timeout_seconds=config.code_compile_timeout_seconds))
    # Loading (and importing torch) before SERVING: a bad --reward-model fails at startup, not per item.
    reward_model = RewardModel.load(_model_settings(config)) if config.reward_model else None
    model_verifier = ModelVerifier(reward_model, timeout_seconds=config.model_timeout_seconds,
                                   batch_size=config.reward_model_batch_size)
    registry = VerifierRegistry([
        MathVerifier(pool, timeout_seconds=config.timeout_seconds),
        FormatVerifier(FormatRules(require_think=config.format_require_think)),
        code_verifier,
        LengthVerifier(LengthParams(max_length=config.length_max, cache_length=config.length_cache,
                                    fallback_unit=config.length_unit)),
        model_verifier,
        ToolUseVerifier(),
    ])
    if registry.names != sorted(VERIFIER_PARAMS):  # callers let through every name the shared table lists
        raise RuntimeError(f"verifiers {registry.names} are not those of everstep.verifiers.VERIFIER_PARAMS "
                           f"{sorted(VERIFIER_PARAMS)}")
    functions = FunctionVerifier(function_settings(config))
    scorer = RewardScorer(registry, max_concurrent_items=config.max_concurrent_items, functions=functions)
    item_log = ItemLog(config.item_log) if config.item_log else None
    reward_pb2_grpc.add_RewardServicer_to_server(RewardServicer(scorer, item_log), grpc_server)
    bind(grpc_server, f"{config.host}:{config.grpc_port}")
    grpc_server.start()
    try:
        pool.start()
        health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        log.info("reward ready: grpc %s:%d metrics :%d verifiers %s math workers %d sandbox %s reward model %s",
                 config.host, config.grpc_port, config.port, ",".join(registry.names), config.math_workers,
                 config.sandbox_endpoint or "none", config.reward_model or "none")
        stop.wait()
    finally:
        health_servicer.enter_graceful_shutdown()
        grpc_server.stop(_GRPC_GRACE_SECONDS).wait()
        scorer.close()
        code_verifier.close()
        model_verifier.close()
        functions.close()
        pool.close()
        log.info("reward stopped")


def function_settings(config: RewardConfig) -> FunctionSettings:
    return FunctionSettings(isolated=config.function_isolation == "process", workers=config.function_workers,
                            timeout_seconds=config.function_timeout_seconds,
                            memory_bytes=config.function_memory_mb * 1024 * 1024,
                            cpu_seconds=config.function_cpu_seconds, allowed_imports=config.function_allowed_imports,
                            allow_network=config.function_allow_network, max_pools=config.function_max_pools,
                            start_method=config.worker_start_method)


def _model_settings(config: RewardConfig) -> RewardModelSettings:
    assert config.reward_model is not None
    return RewardModelSettings(path=config.reward_model, device=config.reward_model_device,
                               max_tokens=config.reward_model_max_tokens, batch_size=config.reward_model_batch_size,
                               num_threads=config.reward_model_threads)
