"""Prometheus metrics of the rollout service (process-wide default registry)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import Counter, Gauge, Histogram

from everstep.tools.error_kind import TOOL_ERROR_KIND_NAMES, tool_error_kind_name
from everstep_rollout.engine.interface import StepStats
from everstep_rollout.engine.loop import EngineStatus
from everstep_rollout.sequence import FinishReason, SequenceResult

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

TOOL_CALLS = Counter(
    "everstep_rollout_tool_calls_total",
    "Tool calls of finished trajectories, by error kind (none: ran as asked; malformed, unknown_tool, bad_arguments, "
    "timeout, unavailable, limit, environment).", ["kind"])
for _kind in TOOL_ERROR_KIND_NAMES:  # every kind exported from the start (dashboards rate() them)
    TOOL_CALLS.labels(kind=_kind)
TOOL_CALL_SECONDS = Histogram("everstep_rollout_tool_call_seconds", "From a tool call to its reply.",
                              buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0))
TOOL_TURNS = Histogram("everstep_rollout_tool_turns", "Model turns per finished tool-using trajectory.",
                       buckets=(1, 2, 3, 4, 6, 8, 12, 16))
PAUSED_SEQUENCES = Gauge("everstep_rollout_paused_sequences",
                         "Sequences waiting for their tool calls, their KV cache kept.")
TOOL_EVICTIONS = Counter("everstep_rollout_tool_evictions_total",
                         "Paused sequences that gave up their KV cache slot to a queued one (prefilled again later).")
PREFILL_TOKENS = Counter("everstep_rollout_prefill_tokens_total",
                         "Token positions prefilled (each prefilled sequence's tokens but its last, which its first "
                         "decode step takes).")
PREFILL_TOKENS_SHARED = Counter("everstep_rollout_prefill_tokens_shared_total",
                                "Prompt token positions not prefilled because a copy of the same prompt admitted in "
                                "the same step was (their keys and values copied).")
_evictions_seen = 0


def observe_step(stats: StepStats) -> None:
    global _evictions_seen
    PAUSED_SEQUENCES.set(stats.num_paused)
    if stats.num_tool_evictions > _evictions_seen:
        TOOL_EVICTIONS.inc(stats.num_tool_evictions - _evictions_seen)
    _evictions_seen = stats.num_tool_evictions
    GENERATED_TOKENS.inc(stats.num_decoded)
    PREFILL_TOKENS.inc(stats.num_prefill_tokens)
    PREFILL_TOKENS_SHARED.inc(stats.num_prefill_tokens_shared)
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


def observe_tool_trajectories(results: list[SequenceResult]) -> None:
    """Calls, their latency and the turns of the finished trajectories (a partial is counted once it finishes)."""
    for r in results:
        if r.tool_trajectory is None or r.finish_reason == FinishReason.ABORTED:
            continue
        TOOL_TURNS.observe(r.tool_trajectory.num_turns)
        for call in r.tool_trajectory.calls:
            TOOL_CALLS.labels(kind=tool_error_kind_name(call.error)).inc()
            TOOL_CALL_SECONDS.observe(call.seconds)


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
