"""Prometheus metrics of the rollout service (process-wide default registry)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import Counter, Gauge, Histogram

from everstep_rollout.engine.interface import StepStats
from everstep_rollout.engine.loop import EngineStatus

GENERATED_TOKENS = Counter("everstep_rollout_generated_tokens_total", "Output tokens generated.")
RUNNING_SEQUENCES = Gauge("everstep_rollout_running_sequences", "Sequences holding a KV cache slot.")
QUEUED_SEQUENCES = Gauge("everstep_rollout_queued_sequences", "Sequences waiting for a KV cache slot.")
DECODE_STEP_SECONDS = Histogram(
    "everstep_rollout_decode_step_seconds",
    "One decode step: the forward pass generating a token for every running sequence (joining sequences' prefill "
    "fused into it) and sampling.",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
)
WEIGHT_UPDATE_SECONDS = Histogram(
    "everstep_rollout_weight_update_seconds", "From the first weight bucket received to the weights swapped.",
    ["transport"], buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
)
WEIGHT_UPDATE_BYTES = Counter("everstep_rollout_weight_update_bytes", "Tensor bytes of applied weight updates.",
                              ["transport"])
POLICY_VERSION = Gauge("everstep_rollout_policy_version", "Policy version of the loaded weights.")
QUANTIZATION = Gauge(
    "everstep_rollout_quantization_info",
    "1 for the loaded engine's weight quantization (label: none, int8, int8-tensor, fp8, int4), absent before a load.",
    ["quantization"],
)
FINISHED_SEQUENCES = Counter(
    "everstep_rollout_finished_sequences_total", "Sequences returned, by finish reason.", ["reason"]
)


def observe_step(stats: StepStats) -> None:
    GENERATED_TOKENS.inc(stats.num_decoded)
    if stats.num_decoded:
        DECODE_STEP_SECONDS.observe(stats.decode_seconds)
    for reason, count in stats.finished.items():
        FINISHED_SEQUENCES.labels(reason=reason.name.lower()).inc(count)


def bind_status(get_status: Callable[[], EngineStatus | None]) -> None:
    """Read the gauges from the current engine status at scrape time."""

    def read(field: str) -> float:
        status = get_status()
        return float(getattr(status, field)) if status is not None else 0.0

    RUNNING_SEQUENCES.set_function(lambda: read("running"))
    QUEUED_SEQUENCES.set_function(lambda: read("queued"))
    POLICY_VERSION.set_function(lambda: read("version"))


def observe_partials(count: int) -> None:
    if count:
        FINISHED_SEQUENCES.labels(reason="aborted").inc(count)


def observe_weight_update(transport: str, seconds: float, num_bytes: int) -> None:
    WEIGHT_UPDATE_SECONDS.labels(transport=transport).observe(seconds)
    WEIGHT_UPDATE_BYTES.labels(transport=transport).inc(num_bytes)


def set_quantization(quantization: str) -> None:
    """Label the loaded engine's weight quantization (one series at a time)."""
    QUANTIZATION.clear()
    QUANTIZATION.labels(quantization=quantization).set(1)
