"""C3PO++ over a fleet of rollout engines, simulated: one global budget against a static split.

Pure Python, no model and no services; deterministic for a seed. Time runs in *ticks*: a lone sequence
decodes one token per tick.

The model:
- **Engines.** E engines, each decoding up to `slots_per_engine` = Omega / E sequences at once. Every running
  sequence of an engine gains `speed(b) = 1 / (1 + slowdown * b / slots_per_engine)` tokens per tick, where b
  is the number running there: a decode step gets slightly slower as its batch fills (slowdown 0.25: a full
  engine decodes each sequence at 0.8 tokens a tick, 0.8 * slots tokens a tick in all). Prefill, weight pushes
  and training are not modelled: the figures are the rollout phase alone.
- **Lengths.** Response lengths are log-normal (median `median_tokens`, shape `sigma`), cut at
  `max_new_tokens` (a cut response finishes by length). They are a function of (seed, prompt index, member):
  every policy sees the same prompts with the same lengths.
- **Groups.** A prompt's G samples start together on one engine and stay there, carried-over ones included
  (prompt sharing, and the KV cache of a carried-over sequence).
- **Budget.** Each iteration ends when its budget of *finished* rollouts is met (`budget_unit`): `samples`,
  Omega finished samples (what a synchronous batch that fills the pool trains); or `tokens`, Phi = Omega x the
  distribution's mean length, counted in the output tokens of finished rollouts as everstep's scheduler does. With
  `samples`, every policy trains exactly the same number of samples per iteration; with `tokens`, the same
  number of tokens (up to the last finish's overshoot). An unfinished rollout carries over on its engine; one
  already carried `retention` (sigma) times and still unfinished at an iteration's end is purged, as in
  `everstep_controller.algo.scheduler`.

The policies (`Policy`):
- `c3po_global`: one budget for the fleet. Whenever an engine has room for a group (G free slots), a new group
  goes to the least-loaded engine with room (`Placement`), until the budget is met; the iteration ends for every
  engine at once.
- `static_split`: engine e owns prompts e, e + E, e + 2E, ... and a budget of its own (budget / E). It refills
  its own slots until its budget is met, then pauses (drains, as the scheduler does at an iteration's end)
  until the last engine has met its budget, which ends the iteration.
- `static_split_keep_decoding`: a kinder static split. An engine that has met its budget starts nothing new but
  keeps decoding what it holds; a rollout it finishes then counts toward its next iteration (first, before any
  other), so every iteration still trains the same number of samples.
- `sync_batch`: the classic synchronous batch. Each engine starts slots / G groups of its own prompts, no refill
  and no carry-over; the iteration ends when every sequence has finished.

Placement (`Placement`) for `c3po_global`; outstanding tokens is what the controller balances:
- `residual`: the sum, over the engine's running sequences, of the expected remaining length given the tokens
  decoded so far (the mean residual length of the length distribution, estimated from draws). This is what a
  real controller can know: it sees each sequence's progress and past lengths, never a sequence's own length.
- `oracle`: the true remaining tokens (each sequence's length minus its progress), which no real controller knows.
- `round_robin`: the next engine with room, in turn; load-blind, to separate the placement from the budget.
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import math
import random
import statistics
from dataclasses import dataclass, field
from enum import StrEnum


class Policy(StrEnum):
    c3po_global = "c3po_global"
    static_split = "static_split"
    static_split_keep_decoding = "static_split_keep_decoding"
    sync_batch = "sync_batch"


class Placement(StrEnum):
    residual = "residual"
    oracle = "oracle"
    round_robin = "round_robin"


class BudgetUnit(StrEnum):
    samples = "samples"
    tokens = "tokens"


@dataclass(frozen=True, kw_only=True)
class LengthModel:
    """Response lengths: log-normal, cut at max_new_tokens."""

    median_tokens: int = 2000
    sigma: float = 1.0  # log-normal shape: larger means a heavier tail
    max_new_tokens: int = 16384

    def __post_init__(self) -> None:
        if self.median_tokens < 1 or self.max_new_tokens < self.median_tokens or self.sigma <= 0:
            raise ValueError(f"lengths need 1 <= median_tokens <= max_new_tokens and sigma > 0, got {self}")

    def draw(self, rng: random.Random) -> int:
        return max(1, min(self.max_new_tokens, round(rng.lognormvariate(math.log(self.median_tokens), self.sigma))))


class ResidualLength:
    """The mean remaining length of a response that has decoded `d` tokens so far: E[L - d | L > d].

    Estimated from sorted draws of the length distribution (a heavy tail makes it grow with d: a sequence that
    has run long is expected to run longer still)."""

    def __init__(self, lengths: LengthModel, *, num_draws: int = 20_000, seed: int = 12345) -> None:
        rng = random.Random(seed)
        self._sorted = sorted(lengths.draw(rng) for _ in range(num_draws))
        self._max = lengths.max_new_tokens
        suffix, total = [0.0] * (num_draws + 1), 0.0
        for i in range(num_draws - 1, -1, -1):
            total += self._sorted[i]
            suffix[i] = total / (num_draws - i)
        self._suffix_mean = suffix
        self.mean = suffix[0]

    def __call__(self, decoded: float) -> float:
        i = bisect.bisect_right(self._sorted, decoded)
        if i == len(self._sorted):  # past every draw: at most the cut is left
            return max(1.0, self._max - decoded)
        return self._suffix_mean[i] - decoded


@dataclass(frozen=True, kw_only=True)
class FleetConfig:
    num_engines: int = 256
    slots_per_engine: int = 64  # Omega / E: sequences one engine decodes at once
    group_size: int = 8  # G
    budget_unit: BudgetUnit = BudgetUnit.samples
    retention: int = 6  # sigma: carry-overs allowed (6: a full engine finishes even a max_new_tokens rollout)
    slowdown: float = 0.25  # a full engine decodes each sequence at 1 / (1 + slowdown) tokens a tick
    lengths: LengthModel = field(default_factory=LengthModel)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_engines < 1:
            raise ValueError(f"num_engines must be >= 1, got {self.num_engines}")
        if self.group_size < 1 or self.slots_per_engine % self.group_size:
            raise ValueError(f"slots_per_engine ({self.slots_per_engine}) must be a multiple of group_size "
                             f"({self.group_size})")
        if self.retention < 0 or self.slowdown < 0:
            raise ValueError(f"retention and slowdown must be >= 0, got {self.retention}, {self.slowdown}")

    @property
    def pool_capacity(self) -> int:
        """Omega: sequences the fleet decodes at once."""
        return self.num_engines * self.slots_per_engine

    @property
    def samples_per_iteration(self) -> int:
        """The `samples` budget: Omega finished samples, a synchronous batch that fills the pool."""
        return self.pool_capacity

    def budget(self, residual: ResidualLength) -> float:
        if self.budget_unit == BudgetUnit.samples:
            return float(self.samples_per_iteration)
        return self.samples_per_iteration * residual.mean  # Phi


class PromptLengths:
    """The G lengths of prompt p, drawn in prompt order from one generator whatever order prompts are asked in."""

    def __init__(self, lengths: LengthModel, group_size: int, seed: int) -> None:
        self._model, self._group_size = lengths, group_size
        self._rng = random.Random(seed)
        self._drawn: list[tuple[int, ...]] = []

    def __call__(self, prompt: int) -> tuple[int, ...]:
        while len(self._drawn) <= prompt:
            self._drawn.append(tuple(self._model.draw(self._rng) for _ in range(self._group_size)))
        return self._drawn[prompt]


class Sequence:
    """One rollout: it finishes when its engine's clock reaches `target` (clock at start + tokens left)."""

    __slots__ = ("sample_id", "group_id", "length", "target", "born_iteration")

    def __init__(self, sample_id: int, group_id: int, length: int, target: float, born_iteration: int) -> None:
        self.sample_id, self.group_id, self.length = sample_id, group_id, length
        self.target, self.born_iteration = target, born_iteration


class Engine:
    """One engine's running sequences. Its `clock` counts the tokens each of them has gained since it started
    (all of an engine's sequences decode at the same speed), so a sequence's progress is read off the clock."""

    def __init__(self, index: int, config: FleetConfig) -> None:
        self.index = index
        self.capacity = config.slots_per_engine
        self._slowdown = config.slowdown
        self.clock = 0.0
        self.updated_at = 0.0  # fleet time of the last `advance`
        self.paused = False  # static_split: stopped once its own budget is met, until the iteration ends
        self.budget_met = False  # static splits: its own budget is met this iteration
        self.banked: list[Sequence] = []  # static_split_keep_decoding: finished after budget_met, count next time
        self.running: dict[int, Sequence] = {}
        self._heap: list[tuple[float, int]] = []  # (target, sample id)
        self.tokens_generated = 0.0
        self.finished_this_iteration = 0.0  # in the budget's unit (static_split's per-engine budget)
        self.version = 0  # bumped whenever the next finish time changes; stale events carry an older one

    @property
    def free_slots(self) -> int:
        return self.capacity - len(self.running)

    def speed(self) -> float:
        """Tokens a tick of each running sequence."""
        return 1.0 / (1.0 + self._slowdown * len(self.running) / self.capacity)

    def advance(self, now: float) -> None:
        if not self.paused and self.running:
            gained = self.speed() * (now - self.updated_at)
            self.clock += gained
            self.tokens_generated += gained * len(self.running)
        self.updated_at = now

    def decoded(self, sequence: Sequence) -> float:
        """Output tokens of `sequence` so far (its earlier iterations included), as of the last `advance`."""
        return sequence.length - max(0.0, sequence.target - self.clock)

    def add(self, sequence_id: int, group_id: int, length: int, decoded: float, born_iteration: int) -> None:
        sequence = Sequence(sequence_id, group_id, length, self.clock + length - decoded, born_iteration)
        self.running[sequence_id] = sequence
        heapq.heappush(self._heap, (sequence.target, sequence_id))
        self.version += 1

    def pop_next(self) -> Sequence:
        _, sequence_id = heapq.heappop(self._heap)
        self.version += 1
        return self.running.pop(sequence_id)

    def remove(self, sequence_ids: list[int]) -> list[Sequence]:
        removed = [self.running.pop(s) for s in sequence_ids]
        self._heap = [(s.target, s.sample_id) for s in self.running.values()]
        heapq.heapify(self._heap)
        self.version += 1
        return removed

    def next_finish_time(self) -> float | None:
        """Fleet time of the next finish here, given the current batch; None when nothing runs or paused."""
        if self.paused or not self._heap:
            return None
        return self.updated_at + max(0.0, self._heap[0][0] - self.clock) / self.speed()

    def true_remaining_tokens(self) -> float:
        return sum(max(0.0, s.target - self.clock) for s in self.running.values())


@dataclass(frozen=True)
class IterationStats:
    """One iteration's rollout phase."""

    ticks: float
    tokens_generated: float  # every token decoded in the phase, carried-over and later purged ones included
    finished_samples: int  # trained samples
    finished_tokens: int  # their output tokens, earlier iterations' included
    purged_samples: int
    purged_tokens: float  # tokens decoded for purged rollouts, wasted
    groups_placed: int = 0  # c3po_global: new groups it placed
    groups_placed_with_a_choice: int = 0  # of them, those for which two or more engines had room

    @property
    def tokens_per_tick(self) -> float:
        return self.tokens_generated / self.ticks if self.ticks else 0.0


class FleetSimulator:
    """The fleet under one policy; `run_iteration` simulates one rollout phase and returns its stats."""

    def __init__(self, config: FleetConfig, policy: Policy, placement: Placement = Placement.residual) -> None:
        self.config, self.policy, self.placement = config, Policy(policy), Placement(placement)
        self.engines = [Engine(e, config) for e in range(config.num_engines)]
        self.residual = ResidualLength(config.lengths)
        self.budget = config.budget(self.residual)
        self.prompt_lengths = PromptLengths(config.lengths, config.group_size, config.seed)
        self.time = 0.0
        self.iteration = 0
        self.group_engine: dict[int, int] = {}  # group id (= prompt index) -> the engine that holds it
        self._events: list[tuple[float, int, int]] = []  # (time, engine, engine version)
        self._next_prompt = 0  # c3po_global's prompt stream
        self._next_own_prompt = [0] * config.num_engines  # static_split/sync_batch: engine e's k-th prompt
        self._round_robin_next = 0
        self._finished, self._finished_samples, self._finished_tokens = 0.0, 0, 0
        self._groups_placed, self._groups_placed_with_a_choice = 0, 0
        self._with_room = set(range(config.num_engines))  # engines with room for a group

    # -- placement ---------------------------------------------------------------------------
    def load(self, engine: Engine) -> float:
        """Outstanding tokens of `engine` as the placement sees them (advanced to now first)."""
        engine.advance(self.time)
        if self.placement == Placement.oracle:
            return engine.true_remaining_tokens()
        return sum(self.residual(engine.decoded(s)) for s in engine.running.values())

    def choose_engine(self, loads: dict[int, float] | None = None) -> Engine | None:
        """The engine for the next new group: among those with room for G more, the least loaded (lowest
        index on a tie), or the next in turn for round_robin; None when no engine has room. `loads` caches
        loads computed at the current time (the caller drops an engine's entry when its load changes)."""
        loads = {} if loads is None else loads
        if not self._with_room:
            return None
        if self.placement == Placement.round_robin:
            later = [e for e in self._with_room if e >= self._round_robin_next]
            index = min(later) if later else min(self._with_room)
            self._round_robin_next = index + 1
            return self.engines[index]
        best, best_load = None, math.inf
        for index in sorted(self._with_room):
            load = loads[index] if index in loads else loads.setdefault(index, self.load(self.engines[index]))
            if load < best_load:
                best, best_load = self.engines[index], load
        return best

    def start_group(self, engine: Engine, prompt: int) -> None:
        """Starts prompt `prompt`'s G samples, all on `engine`."""
        if engine.free_slots < self.config.group_size:
            raise ValueError(f"engine {engine.index} has {engine.free_slots} free slots, a group needs "
                             f"{self.config.group_size}")
        engine.advance(self.time)
        group_size = self.config.group_size
        for member, length in enumerate(self.prompt_lengths(prompt)):
            engine.add(prompt * group_size + member, prompt, length, 0.0, self.iteration)
        self.group_engine[prompt] = engine.index
        self._update_room(engine)
        self._schedule(engine)

    # -- the iteration -----------------------------------------------------------------------
    def run_iteration(self) -> IterationStats:
        start, tokens_before = self.time, self._tokens_generated()
        self._finished, self._finished_samples, self._finished_tokens = 0.0, 0, 0
        self._groups_placed, self._groups_placed_with_a_choice = 0, 0
        for engine in self.engines:
            engine.finished_this_iteration, engine.budget_met = 0.0, False
            banked, engine.banked = engine.banked, []
            for sequence in banked:  # finished after the engine's last budget was met: they count first now
                self._count_finished(engine, sequence)
        if self.policy == Policy.sync_batch:
            for engine in self.engines:
                for _ in range(engine.capacity // self.config.group_size):
                    self.start_group(engine, self._own_prompt(engine))
        else:
            self._refill_all()
        while not self._iteration_done():
            when, index, version = heapq.heappop(self._events)
            engine = self.engines[index]
            if version != engine.version:
                continue
            self.time = when
            engine.advance(when)
            sequence = engine.pop_next()
            self._update_room(engine)
            self._count_finished(engine, sequence)
            self._schedule(engine)
            if self.policy == Policy.c3po_global:
                self._refill_global()
            elif self.policy in (Policy.static_split, Policy.static_split_keep_decoding):
                self._refill_own(engine)
        purged_samples, purged_tokens = self._end_iteration()
        return IterationStats(self.time - start, self._tokens_generated() - tokens_before, self._finished_samples,
                              self._finished_tokens, purged_samples, purged_tokens, self._groups_placed,
                              self._groups_placed_with_a_choice)

    def _count_finished(self, engine: Engine, sequence: Sequence) -> None:
        """Counts a finished rollout toward the budgets, or banks it on an engine whose own budget is met."""
        if engine.budget_met:  # static_split_keep_decoding only: the others stop decoding or never get here
            engine.banked.append(sequence)
            return
        amount = 1.0 if self.config.budget_unit == BudgetUnit.samples else float(sequence.length)
        self._finished += amount
        self._finished_samples += 1
        self._finished_tokens += sequence.length
        engine.finished_this_iteration += amount
        split = self.policy in (Policy.static_split, Policy.static_split_keep_decoding)
        if split and engine.finished_this_iteration >= self._engine_budget():
            engine.budget_met = True
            if self.policy == Policy.static_split:
                engine.paused = True
                engine.version += 1

    def _iteration_done(self) -> bool:
        if self.policy == Policy.sync_batch:
            return not any(engine.running for engine in self.engines)
        if self.policy in (Policy.static_split, Policy.static_split_keep_decoding):
            return all(engine.budget_met for engine in self.engines)
        return self._finished >= self.budget

    def _engine_budget(self) -> float:
        return self.budget / self.config.num_engines

    def _refill_all(self) -> None:
        if self.policy == Policy.c3po_global:
            self._refill_global()
        else:
            for engine in self.engines:
                self._refill_own(engine)

    def _refill_global(self) -> None:
        loads: dict[int, float] = {}  # the time stands still while refilling: each load is computed once
        while self._finished < self.budget and (engine := self.choose_engine(loads)) is not None:
            self._groups_placed += 1
            self._groups_placed_with_a_choice += len(self._with_room) > 1
            self.start_group(engine, self._next_prompt)
            self._next_prompt += 1
            loads.pop(engine.index, None)

    def _refill_own(self, engine: Engine) -> None:
        while not engine.budget_met and engine.free_slots >= self.config.group_size:
            self.start_group(engine, self._own_prompt(engine))

    def _own_prompt(self, engine: Engine) -> int:
        prompt = self._next_own_prompt[engine.index] * self.config.num_engines + engine.index
        self._next_own_prompt[engine.index] += 1
        return prompt

    def _end_iteration(self) -> tuple[int, float]:
        """Carries unfinished rollouts over on their engines, purging those carried `retention` times already."""
        purged_samples, purged_tokens = 0, 0.0
        for engine in self.engines:
            engine.advance(self.time)
            expired = [s.sample_id for s in engine.running.values()
                       if self.iteration - s.born_iteration >= self.config.retention]
            if expired:
                for sequence in engine.remove(expired):
                    purged_tokens += engine.decoded(sequence)
                purged_samples += len(expired)
                self._update_room(engine)
            engine.paused = False
            engine.version += 1
            self._schedule(engine)
        self.iteration += 1
        return purged_samples, purged_tokens

    def _update_room(self, engine: Engine) -> None:
        if engine.free_slots >= self.config.group_size:
            self._with_room.add(engine.index)
        else:
            self._with_room.discard(engine.index)

    def _schedule(self, engine: Engine) -> None:
        when = engine.next_finish_time()
        if when is not None:
            heapq.heappush(self._events, (when, engine.index, engine.version))

    def _tokens_generated(self) -> float:
        total = 0.0
        for engine in self.engines:
            engine.advance(self.time)
            total += engine.tokens_generated
        return total


@dataclass(frozen=True, kw_only=True)
class Setting:
    """One point of the sweep: a fleet, a policy and (for c3po_global) a placement."""

    config: FleetConfig
    policy: Policy
    placement: Placement | None = None

    def __post_init__(self) -> None:
        if (self.placement is None) != (self.policy != Policy.c3po_global):
            raise ValueError(f"placement is for c3po_global only, got {self.policy} with {self.placement}")


@dataclass(frozen=True)
class SettingResult:
    """A setting over every seed's measured iterations."""

    setting: Setting
    iterations: list[IterationStats]

    @property
    def median_ticks(self) -> float:
        return statistics.median(i.ticks for i in self.iterations)

    def as_json(self) -> dict[str, object]:
        config, iterations = self.setting.config, self.iterations
        ticks, generated = sum(i.ticks for i in iterations), sum(i.tokens_generated for i in iterations)
        trained = sum(i.finished_samples for i in iterations)
        return {
            "engines": config.num_engines,
            "policy": str(self.setting.policy),
            "placement": None if self.setting.placement is None else str(self.setting.placement),
            "budget_unit": str(config.budget_unit),
            "retention": config.retention,
            "iterations_measured": len(iterations),
            "median_ticks": round(self.median_ticks, 1),
            "mean_ticks": round(ticks / len(iterations), 1),
            "max_ticks": round(max(i.ticks for i in iterations), 1),
            "tokens_per_tick": round(generated / ticks, 1),
            "utilization": round(generated / ticks / (config.pool_capacity / (1.0 + config.slowdown)), 4),
            "trained_samples_per_iteration": round(trained / len(iterations), 1),
            "trained_tokens_per_iteration": round(sum(i.finished_tokens for i in iterations) / len(iterations)),
            "ticks_per_trained_sample": round(ticks / trained, 5),
            "purged_samples_per_iteration": round(sum(i.purged_samples for i in iterations) / len(iterations), 1),
            "wasted_token_share": round(sum(i.purged_tokens for i in iterations) / generated, 4),
            "placement_choice_share": round(sum(i.groups_placed_with_a_choice for i in iterations)
                                            / max(1, sum(i.groups_placed for i in iterations)), 4),
        }


def simulate_setting(setting: Setting, *, seeds: list[int], warmup_iterations: int,
                     measured_iterations: int) -> SettingResult:
    """Runs warmup + measured iterations for each seed and keeps the measured ones (carry-over takes a few
    iterations to reach its steady state from an empty fleet)."""
    measured: list[IterationStats] = []
    for seed in seeds:
        config = dataclasses.replace(setting.config, seed=seed)
        simulator = FleetSimulator(config, setting.policy, setting.placement or Placement.residual)
        for iteration in range(warmup_iterations + measured_iterations):
            stats = simulator.run_iteration()
            if iteration >= warmup_iterations:
                measured.append(stats)
    return SettingResult(setting, measured)
