"""The C3PO++ scheduler alone against a simulated inference engine at the paper's scale.

The scheduler is the controller's own (`everstep_controller.algo.scheduler`); only the engine and the
trainer are modelled. The engine decodes one token of every active rollout per step; a step costs

    step_seconds = base + per_sequence * active + per_kv_token * (context tokens of the active rollouts)

(a fixed cost for reading the weights, compute that grows with batch occupancy, and attention
reading the KV cache), prompts and continued partials are prefilled at `prefill_per_token` seconds
a token, and a train step costs `train_per_token` seconds per trained token plus `weight_push`
seconds. Response lengths are drawn long-tailed (log-normal, capped at `max_tokens`; a capped
response finishes by length). The simulation jumps from one finishing rollout to the next, with the
step cost integrated in closed form in between, so thousands of concurrent rollouts of up to 64K
tokens run in seconds.

Both modes use the same engine (capacity Omega = prompts_per_iteration x group_size rollouts) and
run until the same number of samples is trained; every quantity is reported per trained sample.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import asdict, dataclass, field
from typing import Any

from everstep.settings.training import SchedulerMode
from everstep_controller.algo.scheduler import C3POScheduler, SchedulerConfig


@dataclass(frozen=True, kw_only=True)
class CostModel:
    """The defaults are assumptions at the paper's scale (a GPU engine whose decode step costs nearly the same
    at any batch); `benchmarks.decode_cost` measures the decode and prefill constants of a real engine and
    model."""

    base_seconds: float = 0.030  # per decode step, whatever the batch
    per_sequence_seconds: float = 2.0e-5  # per active rollout per step
    per_kv_token_seconds: float = 5.0e-10  # per context token of the active rollouts per step
    prefill_per_token_seconds: float = 2.0e-7  # prompts, and partials continued under a new policy
    train_per_token_seconds: float = 2.5e-5  # forward + backward of one trained token
    weight_push_seconds: float = 5.0
    decode_seconds_by_batch: tuple[tuple[int, float], ...] = ()
    """Measured (active sequences, decode step seconds without the KV part) points; when given, they replace
    base + per_sequence * active, interpolated linearly between points and extended along the last segment
    (a measured engine's cost is not linear in the batch: on a CPU it flattens as the batch grows)."""

    def __post_init__(self) -> None:
        points = tuple((int(b), float(s)) for b, s in self.decode_seconds_by_batch)  # JSON gives lists
        object.__setattr__(self, "decode_seconds_by_batch", points)
        if points and (len(points) < 2 or any(b <= a for (a, _), (b, _) in zip(points, points[1:], strict=False))):
            raise ValueError(f"decode_seconds_by_batch needs two or more points in increasing batch, got {points}")

    def decode_seconds(self, active: int) -> float:
        """One decode step's cost for `active` sequences, without the KV-cache part."""
        points = self.decode_seconds_by_batch
        if not points:
            return self.base_seconds + self.per_sequence_seconds * active
        for (b0, s0), (b1, s1) in zip(points, points[1:], strict=False):
            if active <= b1 or (b1, s1) == points[-1]:
                return max(0.0, s0 + (s1 - s0) * (active - b0) / (b1 - b0))
        raise AssertionError("unreachable")


@dataclass(frozen=True, kw_only=True)
class SimConfig:
    group_size: int = 16
    prompts_per_iteration: int = 256  # sync batch; Omega = this x group_size
    trained_samples: int = 40_960
    token_budget: int = 0  # Phi; 0: Omega x the mean response length (a sync iteration's tokens, on average)
    retention: int = 2  # sigma
    prompt_tokens: int = 512
    median_tokens: int = 6000
    length_sigma: float = 1.0  # log-normal shape: larger means a heavier tail
    max_tokens: int = 65_536
    seed: int = 0
    cost: CostModel = field(default_factory=CostModel)

    @property
    def pool_capacity(self) -> int:
        return self.prompts_per_iteration * self.group_size

    def mean_response_tokens(self, num_draws: int = 100_000) -> float:
        """Estimated from draws of the length distribution (a fixed seed: both modes get the same)."""
        rng = random.Random(self.seed + 1)
        return sum(self.draw_length(rng) for _ in range(num_draws)) / num_draws

    def budget(self) -> int:
        return self.token_budget or int(self.pool_capacity * self.mean_response_tokens())

    def draw_length(self, rng: random.Random) -> int:
        return max(1, min(self.max_tokens, int(rng.lognormvariate(math.log(self.median_tokens), self.length_sigma))))


class SimulatedEngine:
    """Active rollouts in a heap by the decode step at which they finish."""

    def __init__(self, cost: CostModel) -> None:
        self.cost = cost
        self.step = 0  # global decode step
        self.seconds = 0.0
        self.heap: list[tuple[int, str]] = []
        self.active: dict[str, tuple[int, int]] = {}  # id -> (finish step, context offset: ctx = offset + step)
        self.kv_offset_sum = 0  # sum of context offsets: total context = this + active * step
        self.generated_tokens = 0

    def add(self, sample_id: str, prompt_tokens: int, done_tokens: int, total_tokens: int) -> None:
        """Starts (or continues) a rollout; its prompt and earlier output are prefilled first."""
        self.seconds += self.cost.prefill_per_token_seconds * (prompt_tokens + done_tokens)
        finish = self.step + total_tokens - done_tokens
        offset = prompt_tokens + done_tokens - self.step
        self.active[sample_id] = (finish, offset)
        self.kv_offset_sum += offset
        heapq.heappush(self.heap, (finish, sample_id))

    def remove(self, sample_id: str) -> int:
        """Stops a rollout (drained or purged); returns its context length."""
        finish, offset = self.active.pop(sample_id)
        self.kv_offset_sum -= offset
        return offset + self.step

    def advance(self) -> list[str]:
        """Decodes until the next rollouts finish; returns them."""
        while self.heap:  # drop stale entries: of rollouts removed, or re-added with a new finish step
            finish, sample_id = self.heap[0]
            if self.active.get(sample_id, (None,))[0] == finish:
                break
            heapq.heappop(self.heap)
        if not self.heap:
            return []
        target = self.heap[0][0]
        steps, active = target - self.step, len(self.active)
        c = self.cost
        # sum over the steps s = step .. target-1 of: base + per_seq * active + per_kv * (offsets + active * s)
        kv_tokens = steps * self.kv_offset_sum + active * steps * (self.step + target - 1) / 2
        self.seconds += steps * c.decode_seconds(active) + c.per_kv_token_seconds * kv_tokens
        self.generated_tokens += steps * active
        self.step = target
        finished = []
        while self.heap and self.heap[0][0] == target:
            _, sample_id = heapq.heappop(self.heap)
            if self.active.get(sample_id, (None,))[0] == target:
                self.remove(sample_id)
                finished.append(sample_id)
        return finished


@dataclass
class SimResult:
    mode: str
    iterations: int = 0
    trained_samples: int = 0
    trained_tokens: int = 0
    rollout_seconds: float = 0.0
    train_seconds: float = 0.0
    generated_tokens: int = 0
    purged_samples: int = 0
    dropped_groups: int = 0
    mean_occupancy: float = 0.0

    @property
    def e2e_seconds(self) -> float:
        return self.rollout_seconds + self.train_seconds


def simulate(config: SimConfig, mode: SchedulerMode, budget: int) -> SimResult:
    scheduler = C3POScheduler(SchedulerConfig(
        mode=mode, group_size=config.group_size, token_budget=budget, retention=config.retention,
        pool_capacity=config.pool_capacity, prompts_per_iteration=config.prompts_per_iteration,
    ))
    engine = SimulatedEngine(config.cost)
    rng = random.Random(config.seed)
    lengths: dict[str, int] = {}
    done: dict[str, int] = {}  # tokens generated when a rollout was drained
    result = SimResult(mode.value)
    next_group = 0
    occupancy_steps = 0
    while result.trained_samples < config.trained_samples:
        started_seconds, started_steps, started_tokens = engine.seconds, engine.step, engine.generated_tokens
        for sample_id in scheduler.active_samples:  # carried over: continued under the new policy
            engine.add(sample_id, config.prompt_tokens, done[sample_id], lengths[sample_id])
        while not scheduler.iteration_done():
            for _ in range(scheduler.groups_to_start()):
                ids = [f"g{next_group}-{k}" for k in range(config.group_size)]
                scheduler.start_group(f"g{next_group}", next_group, ids)
                next_group += 1
                for sample_id in ids:
                    lengths[sample_id], done[sample_id] = config.draw_length(rng), 0
                    engine.add(sample_id, config.prompt_tokens, 0, lengths[sample_id])
            finished = engine.advance()
            if not finished:
                raise RuntimeError("the engine ran dry before the iteration ended")
            for sample_id in finished:
                scheduler.on_finished(sample_id, lengths[sample_id])
        partials = {}
        for sample_id in scheduler.active_samples:  # drained
            done[sample_id] = engine.remove(sample_id) - config.prompt_tokens
            partials[sample_id] = done[sample_id]
        outcome = scheduler.end_iteration(partials)
        trained = [s for g in outcome.trainable_groups for s in scheduler.surviving_samples(g)]
        trained_tokens = sum(config.prompt_tokens + lengths[s] for s in trained)
        result.iterations += 1
        result.trained_samples += len(trained)
        result.trained_tokens += trained_tokens
        result.rollout_seconds += engine.seconds - started_seconds
        result.generated_tokens += engine.generated_tokens - started_tokens
        occupancy_steps += engine.step - started_steps
        result.purged_samples += len(outcome.purged_samples)
        result.dropped_groups += len(outcome.dropped_groups)
        if trained:
            cost = config.cost
            result.train_seconds += cost.train_per_token_seconds * trained_tokens + cost.weight_push_seconds
        for group_id in outcome.trainable_groups + outcome.dropped_groups:
            for sample_id in scheduler.groups[group_id].sample_ids:
                lengths.pop(sample_id, None)
                done.pop(sample_id, None)
    result.mean_occupancy = result.generated_tokens / occupancy_steps if occupancy_steps else 0.0
    return result


def run_simulation(config: SimConfig) -> dict[str, Any]:
    budget = config.budget()
    sync, c3po = simulate(config, SchedulerMode.sync, budget), simulate(config, SchedulerMode.c3po, budget)

    def per_sample(r: SimResult, seconds: float) -> float:
        return seconds / r.trained_samples

    summary: dict[str, Any] = {
        "benchmark": "c3po", "simulate": True,
        "rollout_speedup": round(per_sample(sync, sync.rollout_seconds) / per_sample(c3po, c3po.rollout_seconds), 3),
        "e2e_speedup": round(per_sample(sync, sync.e2e_seconds) / per_sample(c3po, c3po.e2e_seconds), 3),
        "token_budget": budget,
        "pool_capacity": config.pool_capacity,
        "config": {k: v for k, v in asdict(config).items() if k != "cost"}, "cost_model": asdict(config.cost),
    }
    for r in (sync, c3po):
        summary[r.mode] = {**asdict(r), "e2e_seconds": round(r.e2e_seconds, 1),
                           "rollout_seconds": round(r.rollout_seconds, 1), "train_seconds": round(r.train_seconds, 1),
                           "mean_occupancy": round(r.mean_occupancy, 1),
                           "mean_trained_tokens": round(r.trained_tokens / max(1, r.trained_samples), 1)}
    return summary
