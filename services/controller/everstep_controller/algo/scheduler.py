"""C3PO++ and the synchronous baseline as pure bookkeeping: no I/O, no model.

The job runner asks the scheduler what to start, tells it what finished, asks whether the
iteration is over, hands it the partials it drained, and gets back which groups to train.

C3PO++ (Algorithm 1 of the Ring-1T paper): an inference pool of capacity Omega keeps decoding
and refilling from new prompts until the output tokens of rollouts finished in this iteration
reach the budget Phi. Finished rollouts are trained; unfinished ones carry over and continue
under the next policy version. A rollout already carried over sigma times and still
unfinished at the end of an iteration is purged (sigma = 0: no carry-over at all).

Group semantics (the paper leaves them open): a group is trained once every member is
finished or purged; purged members are left out of the advantage; a group with fewer than two
surviving members is dropped and counted.

Synchronous baseline: each iteration starts one batch of prompts, waits until every rollout
of it finished, and trains all of it: no budget, no refill, no carry-over.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from pydantic import ConfigDict, Field, model_validator

from everstep.settings.training import SchedulerMode, SchedulerSettings


class SchedulerConfig(SchedulerSettings):
    """The job's scheduler settings and the group size they schedule."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    group_size: int = Field(ge=2, description="Samples per prompt (the job's algorithm.group_size).")

    @model_validator(mode="after")
    def _pool_holds_a_group(self) -> SchedulerConfig:
        self.check_holds_a_group(self.group_size)
        return self


@dataclass
class RolloutState:
    sample_id: str
    group_id: str
    born_iteration: int
    num_tokens: int = 0  # output tokens so far
    finished: bool = False
    purged: bool = False


@dataclass
class GroupState:
    group_id: str
    prompt_index: int
    sample_ids: list[str]
    closed_in: int | None = None  # iteration whose end trained or dropped the group


@dataclass(frozen=True)
class GroupToStart:
    """A group the scheduler started: the runner sends its G rollouts to the engine."""

    group_id: str
    prompt_index: int
    sample_ids: tuple[str, ...]


@dataclass(frozen=True)
class IterationOutcome:
    """What the end of an iteration decided."""

    trainable_groups: list[str]  # complete, with at least two surviving members
    dropped_groups: list[str]  # complete, fewer than two surviving members
    purged_samples: list[str]
    carried_samples: list[str]  # unfinished, continue next iteration under the new policy
    finished_tokens: int  # output tokens of rollouts finished this iteration


@dataclass
class _Counters:
    started_groups: int = 0
    finished_samples: int = 0
    purged_samples: int = 0
    dropped_groups: int = 0
    trained_groups: int = 0


class C3POScheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.iteration = 0
        self.rollouts: dict[str, RolloutState] = {}
        self.groups: dict[str, GroupState] = {}
        self.counters = _Counters()
        self._finished_tokens = 0
        self._started_this_iteration = 0
        self._rounds = 1  # rounds of sampling this iteration (`extend`)
        # unfinished, unpurged rollouts in start order (a dict as an ordered set): kept up to date
        # so that the queries below cost O(1), as the runner asks them after every finished rollout
        self._active: dict[str, None] = {}

    # -- queries ---------------------------------------------------------------------------
    @property
    def active_samples(self) -> list[str]:
        """Rollouts the engine is (or should be) decoding."""
        return list(self._active)

    @property
    def num_active(self) -> int:
        return len(self._active)

    @property
    def rounds(self) -> int:
        """Rounds of sampling of the current iteration: 1, plus one per `extend`."""
        return self._rounds

    def groups_to_start(self) -> int:
        """How many new groups of G prompts the runner may start now."""
        c = self.config
        if c.mode == SchedulerMode.sync:
            if self._active:
                return 0
            return max(0, self._rounds * c.prompts_per_iteration - self._started_this_iteration)
        if self._finished_tokens >= c.token_budget * self._rounds:
            return 0
        free = c.pool_capacity - len(self._active)
        return max(0, free // c.group_size)

    def iteration_done(self) -> bool:
        """C3PO++: the budget of finished tokens (Phi per round) is reached. Sync: every rollout of every
        round's batch finished."""
        if self.config.mode == SchedulerMode.sync:
            return self._started_this_iteration > 0 and not self._active and self.groups_to_start() == 0
        return self._finished_tokens >= self.config.token_budget * self._rounds or (
            not self._active and self._started_this_iteration > 0 and self.groups_to_start() == 0
        )

    def complete_open_groups(self) -> list[GroupToStart]:
        """Open groups whose members all finished: the ones the iteration's end would train."""
        return [g for g in self.open_groups() if all(self.rollouts[s].finished for s in g.sample_ids)]

    def extend(self) -> None:
        """One more round of sampling for the current iteration (signal-aware sampling): C3PO++ may
        refill until another Phi of finished tokens, sync starts another batch of prompts."""
        self._rounds += 1

    def prompt_index(self, group_id: str) -> int:
        return self.groups[group_id].prompt_index

    def members(self, group_id: str) -> list[str]:
        """Every sample of a group, finished, purged or still decoding."""
        return list(self.groups[group_id].sample_ids)

    def open_groups(self) -> list[GroupToStart]:
        """Groups not trained or dropped yet (a resumed runner's samples in flight)."""
        return [GroupToStart(g.group_id, g.prompt_index, tuple(g.sample_ids)) for g in self.groups.values()
                if g.closed_in is None]

    def finished_open_samples(self) -> set[str]:
        """Finished members of open groups: their scores wait in the store for the rest of the group."""
        return {s for g in self.open_groups() for s in g.sample_ids if self.rollouts[s].finished}

    def trainable_samples(self, outcome: IterationOutcome) -> list[str]:
        """The surviving members of the groups an iteration closed for training."""
        return [s for g in outcome.trainable_groups for s in self.surviving_samples(g)]

    def closed_samples(self, outcome: IterationOutcome) -> list[str]:
        """Every member of the groups an iteration trained or dropped."""
        return [s for g in outcome.trainable_groups + outcome.dropped_groups for s in self.groups[g].sample_ids]

    # -- events ----------------------------------------------------------------------------
    def schedule(self, next_prompt: Callable[[], int]) -> list[GroupToStart]:
        """Starts the groups the pool has room for now (`groups_to_start`), each named `g<n>` by the
        groups started before it, with members `g<n>-<k>`; `next_prompt()` gives each group's prompt."""
        started = []
        for _ in range(self.groups_to_start()):
            group_id = f"g{self.counters.started_groups}"
            sample_ids = tuple(f"{group_id}-{k}" for k in range(self.config.group_size))
            prompt_index = next_prompt()
            self.start_group(group_id, prompt_index, list(sample_ids))
            started.append(GroupToStart(group_id, prompt_index, sample_ids))
        return started

    def start_group(self, group_id: str, prompt_index: int, sample_ids: list[str]) -> None:
        if len(sample_ids) != self.config.group_size:
            raise ValueError(f"group {group_id} has {len(sample_ids)} samples, expected {self.config.group_size}")
        if group_id in self.groups:
            raise ValueError(f"group {group_id} already started")
        self.groups[group_id] = GroupState(group_id, prompt_index, list(sample_ids))
        for sample_id in sample_ids:
            self.rollouts[sample_id] = RolloutState(sample_id, group_id, self.iteration)
            self._active[sample_id] = None
        self.counters.started_groups += 1
        self._started_this_iteration += 1

    def on_finished(self, sample_id: str, num_tokens: int) -> None:
        rollout = self.rollouts[sample_id]
        if rollout.finished or rollout.purged:
            raise ValueError(f"sample {sample_id} reported finished twice")
        rollout.finished = True
        rollout.num_tokens = num_tokens
        del self._active[sample_id]
        self._finished_tokens += num_tokens
        self.counters.finished_samples += 1

    def end_iteration(self, partial_tokens: dict[str, int]) -> IterationOutcome:
        """Close the iteration given the drained partials (sample id -> output tokens so far).

        Every active rollout must be among the partials: the runner drains the engine first.
        """
        active = set(self._active)
        if set(partial_tokens) != active:
            missing, unknown = active - set(partial_tokens), set(partial_tokens) - active
            raise ValueError(f"partials do not match active rollouts: missing {sorted(missing)[:5]}, "
                             f"unknown {sorted(unknown)[:5]}")
        self._forget_groups_closed_before(self.iteration)
        purged, carried = [], []
        for sample_id, num_tokens in partial_tokens.items():
            rollout = self.rollouts[sample_id]
            rollout.num_tokens = num_tokens
            if self.iteration - rollout.born_iteration >= self.config.retention:
                rollout.purged = True
                del self._active[sample_id]
                purged.append(sample_id)
            else:
                carried.append(sample_id)
        self.counters.purged_samples += len(purged)

        trainable, dropped = [], []
        for group in self.groups.values():
            members = [self.rollouts[s] for s in group.sample_ids]
            if group.closed_in is not None or not all(m.finished or m.purged for m in members):
                continue
            group.closed_in = self.iteration
            if sum(m.finished for m in members) >= 2:
                trainable.append(group.group_id)
            else:
                dropped.append(group.group_id)
        self.counters.dropped_groups += len(dropped)
        self.counters.trained_groups += len(trainable)

        outcome = IterationOutcome(trainable, dropped, purged, carried, self._finished_tokens)
        self.iteration += 1
        self._finished_tokens = 0
        self._started_this_iteration = 0
        self._rounds = 1
        return outcome

    def surviving_samples(self, group_id: str) -> list[str]:
        """Finished members of a group (purged ones are left out of the advantage)."""
        return [s for s in self.groups[group_id].sample_ids if self.rollouts[s].finished]

    def retention_age(self, sample_id: str) -> int:
        """Iterations a rollout has been carried over so far."""
        return self.iteration - self.rollouts[sample_id].born_iteration

    # -- persistence -----------------------------------------------------------------------
    def to_state(self) -> dict[str, Any]:
        """The bookkeeping between two iterations, as JSON-able data (see `from_state`).

        Only valid at an iteration boundary (after `end_iteration`, before anything starts).
        """
        if self._started_this_iteration or self._finished_tokens:
            raise ValueError("the scheduler can only be saved between iterations")
        return {
            "iteration": self.iteration,
            "rollouts": [asdict(r) for r in self.rollouts.values()],
            "groups": [asdict(g) for g in self.groups.values()],
            "counters": asdict(self.counters),
        }

    @classmethod
    def from_state(cls, config: SchedulerConfig, state: dict[str, Any]) -> C3POScheduler:
        scheduler = cls(config)
        scheduler.iteration = state["iteration"]
        scheduler.rollouts = {r["sample_id"]: RolloutState(**r) for r in state["rollouts"]}
        scheduler.groups = {g["group_id"]: GroupState(**g) for g in state["groups"]}
        scheduler.counters = _Counters(**state["counters"])
        scheduler._active = {s: None for s, r in scheduler.rollouts.items() if not (r.finished or r.purged)}
        for group in scheduler.groups.values():
            if len(group.sample_ids) != config.group_size:
                raise ValueError(f"saved group {group.group_id} has {len(group.sample_ids)} samples, "
                                 f"the job's group size is {config.group_size}")
        return scheduler

    # -- internals -------------------------------------------------------------------------
    def _forget_groups_closed_before(self, iteration: int) -> None:
        """Drop bookkeeping of groups closed in an earlier iteration (keeps memory flat).

        Groups closed by the latest end_iteration stay, so the runner can still look them up.
        """
        closed = [g for g in self.groups.values() if g.closed_in is not None and g.closed_in < iteration]
        for group in closed:
            for sample_id in group.sample_ids:
                del self.rollouts[sample_id]
            del self.groups[group.group_id]
