"""Scores reward items: each verifier part in turn, reward = sum(weight * score) over the parts.

A part that cannot be scored (unknown verifier, missing or unusable field or param, a weight that
is not a finite number, timeout, sandbox down) scores 0 with `RewardPart.error` and `error_kind`
set, and the item's `ScoreResult.error` lists those parts, so a consumer can tell a wrong answer
from an unscored one. Every such part is counted in everstep_reward_errors_total. Nothing here
raises for a bad item.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor, as_completed
from dataclasses import dataclass

from everstep.reward_error_kind import error_kind_label
from everstep.reward_functions import FUNCTION_VERIFIER, part_name
from everstep.v1 import reward_pb2
from everstep_reward import metrics
from everstep_reward.functions import FunctionVerifier
from everstep_reward.verifiers import SpecError, VerifierRegistry, VerifierResult
from everstep_reward.verifiers.params import ParamsError

__all__ = ["RewardScorer"]

log = logging.getLogger(__name__)
_UNKNOWN_LABEL = "unknown"
_NO_VERIFIER_LABEL = "none"
_SANDBOX_KINDS = (reward_pb2.REWARD_ERROR_KIND_SANDBOX_ERROR, reward_pb2.REWARD_ERROR_KIND_SANDBOX_UNAVAILABLE)


@dataclass(frozen=True)
class _BatchedPart:
    """A part scored in a call with other items' parts: that call, and this part's row in it."""

    call: Future[list[VerifierResult]]
    row: int

    def result(self) -> VerifierResult:
        return self.call.result()[self.row]


class RewardScorer:
    """Thread-safe; items of every request share `max_concurrent_items` scoring threads."""

    def __init__(self, registry: VerifierRegistry, *, max_concurrent_items: int,
                 functions: FunctionVerifier | None = None) -> None:
        """functions: scores the parts named "function" (the job's own reward functions); None: such a part is
        an unknown verifier."""
        self._registry = registry
        self._functions = functions
        self._executor = ThreadPoolExecutor(max_concurrent_items, thread_name_prefix="score-item")

    def score_item(self, item: reward_pb2.RewardItem,
                   batched: Mapping[int, _BatchedPart] | None = None) -> reward_pb2.ScoreResult:
        """batched: the parts (by index in `item.verifiers`) scored with other items' (`score_batch`)."""
        metrics.INFLIGHT_ITEMS.inc()
        try:
            parts = [self._score_part(item, spec, (batched or {}).get(index))
                     for index, spec in enumerate(item.verifiers)]
        finally:
            metrics.INFLIGHT_ITEMS.dec()
        errors = [f"{p.verifier}: {p.error}" for p in parts if p.error]
        if not parts:
            errors.append("`verifiers` is empty: the item names no verifier")
            metrics.ITEMS.labels(_NO_VERIFIER_LABEL, "error").inc()
            metrics.ERRORS.labels(_NO_VERIFIER_LABEL, error_kind_label(reward_pb2.REWARD_ERROR_KIND_INVALID_SPEC)).inc()
        return reward_pb2.ScoreResult(id=item.id, reward=sum(p.weight * p.score for p in parts), parts=parts,
                                      error="; ".join(errors))

    def score_batch(self, items: Iterable[reward_pb2.RewardItem]) -> Iterator[reward_pb2.ScoreResult]:
        """Yields each item's result as soon as it is ready (completion order).

        The parts of these items that run the same TRL reward function are scored together, in one call of it
        (docs/reward.md, "Reward functions"): those calls are queued before the items, so that an item's thread
        only ever waits for a call that a thread already runs (the executor starts its work in order)."""
        items = list(items)
        batched, calls = self._function_calls(items)
        futures: list[Future[reward_pb2.ScoreResult]] = [
            self._executor.submit(self.score_item, item, batched.get(index)) for index, item in enumerate(items)]
        try:
            for future in as_completed(futures):
                yield future.result()
        finally:  # the caller went away: do not score what nobody will read
            for future in futures:
                future.cancel()
            for call in calls:
                call.cancel()

    def _function_calls(self, items: list[reward_pb2.RewardItem]) -> tuple[
            dict[int, dict[int, _BatchedPart]], list[Future[list[VerifierResult]]]]:
        """Starts one call per TRL function that parts of two or more of `items` run; what each item's parts
        read their result from ({item index: {part index: (call, row)}}), and the calls."""
        functions = self._functions
        if functions is None:
            return {}, []
        groups: dict[str, list[tuple[int, int]]] = {}
        for item_index, item in enumerate(items):
            for part_index, spec in enumerate(item.verifiers):
                key = functions.batch_key(spec)
                if key is not None:
                    groups.setdefault(key, []).append((item_index, part_index))
        batched: dict[int, dict[int, _BatchedPart]] = {}
        calls: list[Future[list[VerifierResult]]] = []
        for group in groups.values():
            if len(group) < 2:
                continue
            rows = [(items[i], items[i].verifiers[p]) for i, p in group]
            call = self._executor.submit(functions.score_rows, rows[0][1].function, rows)
            calls.append(call)
            for row, (item_index, part_index) in enumerate(group):
                batched.setdefault(item_index, {})[part_index] = _BatchedPart(call, row)
        return batched, calls

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _score_part(self, item: reward_pb2.RewardItem, spec: reward_pb2.VerifierSpec,
                    batched: _BatchedPart | None = None) -> reward_pb2.RewardPart:
        verifier = self._functions if spec.name == FUNCTION_VERIFIER else self._registry.get(spec.name)
        label = spec.name if verifier is not None else _UNKNOWN_LABEL
        start = time.monotonic()
        if verifier is None:
            result = VerifierResult.failure(
                reward_pb2.REWARD_ERROR_KIND_UNKNOWN_VERIFIER,
                f"unknown verifier {spec.name!r}; known: {', '.join(self._registry.names)}")
        elif not math.isfinite(spec.weight):
            result = VerifierResult.failure(reward_pb2.REWARD_ERROR_KIND_INVALID_SPEC,
                                            f"weight must be a finite number, not {spec.weight}")
        else:
            try:
                result = batched.result() if batched is not None else verifier.score(item, spec)
            except CancelledError:
                result = VerifierResult.failure(reward_pb2.REWARD_ERROR_KIND_INTERNAL, "cancelled: the service is "
                                                                                       "stopping")
            except ParamsError as e:
                result = VerifierResult.failure(reward_pb2.REWARD_ERROR_KIND_INVALID_PARAMS, str(e))
            except SpecError as e:
                result = VerifierResult.failure(reward_pb2.REWARD_ERROR_KIND_INVALID_SPEC, str(e))
            except Exception as e:  # a bug in a verifier must cost one part, not the batch
                log.exception("verifier %s raised", spec.name)
                result = VerifierResult.failure(reward_pb2.REWARD_ERROR_KIND_INTERNAL, f"internal error: {e}")
        metrics.ITEM_SECONDS.labels(label).observe(time.monotonic() - start)
        metrics.ITEMS.labels(label, result.metric_outcome().value).inc()
        if not result.ok:
            kind = error_kind_label(result.error_kind)
            metrics.ERRORS.labels(label, kind).inc()
            if result.error_kind == reward_pb2.REWARD_ERROR_KIND_TIMEOUT:
                metrics.TIMEOUTS.labels(label).inc()
            elif result.error_kind in _SANDBOX_KINDS:
                metrics.SANDBOX_ERRORS.labels(kind).inc()
        weight = spec.weight if math.isfinite(spec.weight) else 0.0  # a NaN must not poison the item's reward
        name = part_name(spec.function.path, spec.function.name) if spec.name == FUNCTION_VERIFIER else spec.name
        return reward_pb2.RewardPart(verifier=name, score=result.score, weight=weight, error=result.error,
                                     error_kind=result.error_kind, metrics=result.metrics)
