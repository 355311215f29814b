"""Scores items with the user's reward functions (VerifierSpec name "function"; docs/reward.md, "Reward functions").

Each function (its source, name and network grant) gets a pool of worker processes of its own, started at its
first item and loaded once per worker, so that one job's code never shares a process with another's; pools left
idle beyond `max_pools` are closed, least recently used first. Each call has the pool's per-call limit.

A verl function is called once per row. A TRL function is called once per batch, as TRL does: the scorer
gathers the parts of one Score call that run the same TRL function (`batch_key`) and scores them together
(`score_rows`): one call in one worker, under one per-call limit. A batch that passes the limit, or whose worker
dies twice, fails every row of it with that text; its rows are not retried alone (that could take N times the
limit, and a function written for batches may score a row alone differently).

What a function does wrong is the row's: it raised, passed its time limit, returned no number, imported a
module the operator did not allow inside the function, or its worker died — a FUNCTION_ERROR part with the
text, which the controller reports as an unscorable row. A function that cannot load at all (a disallowed
import at the top of its file, a missing name) fails every row: INVALID_PARAMS, which fails the job with the
cause, as does a job that asks for network where the operator does not allow it.
"""

from __future__ import annotations

import functools
import hashlib
import shutil
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from everstep.reward_functions import (
    FUNCTION_VERIFIER,
    FunctionConvention,
    FunctionSourceError,
    check_function_source,
)
from everstep.v1 import reward_pb2
from everstep_reward.functions.isolation import WorkerLimits, enter_isolation
from everstep_reward.functions.running import (
    FunctionRow,
    FunctionScore,
    LoadedFunction,
    call_loaded_batch,
    load,
    load_function,
)
from everstep_reward.verifiers.base import Outcome, VerifierResult
from everstep_reward.verifiers.params import SpecError, VerifierParams
from everstep_reward.worker_pool import ProcessWorkerPool, WorkerCrashed, WorkerTimeout

__all__ = ["FunctionSettings", "FunctionVerifier"]

_FUNCTION_ERROR = reward_pb2.REWARD_ERROR_KIND_FUNCTION_ERROR
_FILE_BYTES = 64 * 1024 * 1024
_CONVENTIONS_KEPT = 256


@dataclass(frozen=True, kw_only=True)
class FunctionSettings:
    """The operator's settings of reward functions (RewardConfig.function_*)."""

    isolated: bool = True
    """False: run them in the service's own process, with no isolation and no time limit (trusted code only)."""
    workers: int = 2
    timeout_seconds: float = 10.0
    memory_bytes: int = 2 * 1024**3
    cpu_seconds: int = 600
    allowed_imports: tuple[str, ...] = ()
    allow_network: bool = False
    max_pools: int = 4
    start_method: str = "spawn"


class FunctionParams(VerifierParams):
    """Functions take no params: what they read is the item's."""


class FunctionVerifier:
    name = FUNCTION_VERIFIER
    params_model = FunctionParams

    def __init__(self, settings: FunctionSettings) -> None:
        self._settings = settings
        self._lock = threading.Lock()
        self._pools: OrderedDict[str, _Pool] = OrderedDict()
        self._in_process: dict[str, LoadedFunction] = {}
        self._conventions: OrderedDict[str, FunctionConvention | None] = OrderedDict()
        self._scratch_root = tempfile.mkdtemp(prefix="everstep-reward-functions-")
        self._closed = False

    def score(self, item: reward_pb2.RewardItem, spec: reward_pb2.VerifierSpec) -> VerifierResult:
        return self.score_rows(spec.function, [(item, spec)])[0]

    def batch_key(self, spec: reward_pb2.VerifierSpec) -> str | None:
        """The key under which the parts of a Score call that run this spec's function are scored together
        (`score_rows`): a TRL function's; None for one that is called per row (verl's), or that the source check
        cannot place (its per-row call then says what is wrong)."""
        function = spec.function
        if spec.name != FUNCTION_VERIFIER or not function.source or not function.name:
            return None
        key = _key(function)
        with self._lock:
            known = key in self._conventions
            convention = self._conventions.get(key)
        if not known:
            try:
                convention = check_function_source(function.source, function.name, _path(function))
            except FunctionSourceError:
                convention = None
            with self._lock:
                self._conventions[key] = convention
                while len(self._conventions) > _CONVENTIONS_KEPT:
                    self._conventions.popitem(last=False)
        return key if convention == FunctionConvention.TRL else None

    def score_rows(self, function: reward_pb2.RewardFunction,
                   rows: Sequence[tuple[reward_pb2.RewardItem, reward_pb2.VerifierSpec]]) -> list[VerifierResult]:
        """Scores the parts of several items that run `function`, in one call of one worker under one per-call
        limit: a TRL function is called once with lists of all the rows, verl's once per row. One result per row,
        in order; a timeout or a worker that died fails every row of the call."""
        if not function.source or not function.name:
            raise SpecError("`function.source` and `function.name` are required (the controller fills them)")
        if function.allow_network and not self._settings.allow_network:
            return [VerifierResult.failure(
                reward_pb2.REWARD_ERROR_KIND_INVALID_PARAMS,
                f"{function.name} asks for network (allow_network), which this reward service does not allow "
                "(its operator's --function-allow-network)")] * len(rows)
        batch = [FunctionRow(prompt=item.prompt, response=item.response, ground_truth=spec.answer)
                 for item, spec in rows]
        key = _key(function)
        if not self._settings.isolated:
            scores = self._loaded_here(key, function).call_batch(batch)
        else:
            pool = self._acquire(key, function)
            which = "this row" if len(batch) == 1 else f"this batch of {len(batch)} rows (one call)"
            try:
                scores = pool.workers.call(call_loaded_batch, batch, timeout_seconds=self._settings.timeout_seconds)
            except WorkerTimeout:
                return [VerifierResult.failure(
                    _FUNCTION_ERROR, f"{function.name}: no result within {self._settings.timeout_seconds:g}s on "
                                     f"{which} (--function-timeout-seconds)")] * len(batch)
            except WorkerCrashed:
                return [VerifierResult.failure(
                    _FUNCTION_ERROR, f"{function.name}: its worker died twice on {which} (the memory or CPU limit, "
                                     "or the function ended its process)")] * len(batch)
            finally:
                self._release(pool)
        if len(scores) != len(batch):  # call_batch returns one per row; anything else is a bug here
            raise RuntimeError(f"{len(scores)} results for {len(batch)} rows of {function.name}")
        return [_result(function.name, score) for score in scores]

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pools = list(self._pools.values())
            self._pools.clear()
        for pool in pools:
            pool.workers.close()
        shutil.rmtree(self._scratch_root, ignore_errors=True)

    def _loaded_here(self, key: str, function: reward_pb2.RewardFunction) -> LoadedFunction:
        with self._lock:
            loaded = self._in_process.get(key)
            if loaded is None:
                loaded = load_function(function.source, function.name, _path(function),
                                       self._settings.allowed_imports)
                self._in_process[key] = loaded
            return loaded

    def _acquire(self, key: str, function: reward_pb2.RewardFunction) -> _Pool:
        settings = self._settings
        with self._lock:
            if self._closed:
                raise RuntimeError("the reward service is stopping")
            pool = self._pools.get(key)
            if pool is None:
                limits = WorkerLimits(memory_bytes=settings.memory_bytes, cpu_seconds=settings.cpu_seconds,
                                      file_bytes=_FILE_BYTES, scratch_root=self._scratch_root,
                                      network=function.allow_network)
                initializer = functools.partial(load, function.source, function.name, _path(function),
                                                settings.allowed_imports)
                pool = _Pool(ProcessWorkerPool(settings.workers, start_method=settings.start_method,
                                               setup=functools.partial(enter_isolation, limits),
                                               initializer=initializer, name="function", depth=1))
                self._pools[key] = pool
            self._pools.move_to_end(key)
            pool.in_flight += 1
            idle = [k for k, p in self._pools.items() if p.in_flight == 0]
            evicted = [self._pools.pop(k) for k in idle[:max(0, len(self._pools) - settings.max_pools)]]
        for old in evicted:
            old.workers.close()
        return pool

    def _release(self, pool: _Pool) -> None:
        with self._lock:
            pool.in_flight -= 1


@dataclass(eq=False)
class _Pool:
    workers: ProcessWorkerPool
    in_flight: int = 0


def _path(function: reward_pb2.RewardFunction) -> str:
    return function.path or "<reward function>"


def _key(function: reward_pb2.RewardFunction) -> str:
    digest = hashlib.sha256(function.source.encode())
    digest.update(f"\0{function.name}\0{function.path}\0{function.allow_network}".encode())
    return digest.hexdigest()


def _result(name: str, score: FunctionScore) -> VerifierResult:
    if score.load_error:
        return VerifierResult.failure(reward_pb2.REWARD_ERROR_KIND_INVALID_PARAMS, score.load_error)
    if score.error:
        return VerifierResult.failure(_FUNCTION_ERROR, f"{name}: {score.error}")
    return VerifierResult(score.score or 0.0, outcome=Outcome.SCORED, metrics=score.metrics)
