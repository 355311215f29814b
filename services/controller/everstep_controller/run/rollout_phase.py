"""One iteration's rollout phase: decode until the scheduler ends the iteration.

The carried rollouts go back to the engine of the pool that decoded them, new groups start as the scheduler makes
room (`C3POScheduler.schedule`), each on the least-loaded engine (`engine_pool.PoolStream`), every finished rollout
goes to the scorers at once, and at the end every engine is drained (C3PO++: its unfinished rollouts come back as
partials) or closed (sync). The budget and the capacity are the whole pool's.

With signal-aware sampling (`algorithm.min_signal_groups`), an iteration the scheduler would end
first waits for the scores of its complete groups; while fewer than `min_signal_groups` of them
have rewards that differ, it takes another round of sampling (`C3POScheduler.extend`), up to
`algorithm.max_sampling_rounds` rounds.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field

from everstep.rest.job_spec import JobSpec
from everstep.settings.training import SchedulerMode
from everstep.v1 import common_pb2
from everstep_controller.algo.scheduler import GroupToStart
from everstep_controller.algo.training_batch import has_signal
from everstep_controller.data.dataset import PromptRow
from everstep_controller.data.trajectories import new_sequence, num_model_tokens
from everstep_controller.run.engine_pool import PoolStream
from everstep_controller.run.run_state import RunState, SampleInFlight
from everstep_controller.run.scoring import ScorerPool

__all__ = ["RolloutPhase", "RolloutResult", "sample_seed"]

ABORTED = common_pb2.FINISH_REASON_ABORTED


def sample_seed(job_seed: int, sample_id: str) -> int:
    """Deterministic mode: the sampling seed of one sample, from the job's seed and the sample's id
    (non-zero: 0 means "no seed of its own" to the engine)."""
    digest = hashlib.sha256(f"{job_seed}/{sample_id}".encode()).digest()
    return (int.from_bytes(digest[:8], "little") >> 1) or 1


@dataclass(frozen=True)
class RolloutResult:
    finished_ids: list[str]
    partials: list[common_pb2.Sequence]  # unfinished, drained from the engine
    generated_tokens: int  # output tokens the model decoded in this phase (a carried rollout's earlier ones and
    # tool replies not counted)
    rounds: int = 1  # rounds of sampling (signal-aware sampling may take more than one)
    engine_tokens: dict[str, int] = field(default_factory=dict)
    """Output tokens the model decoded on each engine of the pool in this phase (counted as `generated_tokens`)."""


@dataclass
class RolloutPhase:
    spec: JobSpec
    state: RunState
    train_rows: list[PromptRow]
    scorers: ScorerPool
    should_stop: Callable[[], bool]
    """Asked after each finished rollout: True ends the phase early (cancel, shutdown)."""
    scoring_timeout_seconds: float = 600.0
    """How long signal-aware sampling waits for the scores of the complete groups."""

    def run(self, stream: PoolStream, sampling: common_pb2.SamplingParams) -> RolloutResult:
        scheduler = self.state.scheduler
        carried = self.state.carried
        tokens_before = {s.id: num_model_tokens(s) for s in carried}
        for seq in carried:
            seq.finish_reason = common_pb2.FINISH_REASON_UNSPECIFIED
        stream.send_carried(carried, sampling, {s.id: self.state.samples[s.id].engine for s in carried})
        tokens_before.update(self._start_groups(stream, sampling))
        engine_tokens = dict.fromkeys(stream.addresses, 0)
        finished: list[common_pb2.Sequence] = []
        partials: list[common_pb2.Sequence] = []
        closing = False
        if scheduler.iteration_done():
            stream.close()
            closing = True
        try:
            for engine, seq in stream.results():
                sample = self.state.samples[seq.id]
                sample.sequence, sample.engine = seq, engine
                engine_tokens[engine] = (engine_tokens.get(engine, 0) + num_model_tokens(seq)
                                         - tokens_before.get(seq.id, 0))
                if seq.finish_reason == ABORTED:
                    partials.append(seq)
                    continue
                finished.append(seq)
                scheduler.on_finished(seq.id, num_model_tokens(seq))  # the budget counts the model's tokens
                self.scorers.submit(seq.id, sample.row.index, seq)
                if closing:
                    continue
                if self.should_stop() or self._done():
                    stream.drain_and_close() if scheduler.config.mode == SchedulerMode.c3po else stream.close()
                    closing = True
                else:
                    tokens_before.update(self._start_groups(stream, sampling))
        except BaseException:
            stream.cancel()
            raise
        generated = sum(num_model_tokens(s) - tokens_before.get(s.id, 0) for s in finished + partials)
        return RolloutResult([s.id for s in finished], partials, generated, scheduler.rounds, engine_tokens)

    def _done(self) -> bool:
        """The scheduler ends the iteration and, with signal-aware sampling, the step holds enough groups
        with a signal or took its last round; else the iteration takes another round."""
        scheduler, algorithm = self.state.scheduler, self.spec.algorithm
        if not scheduler.iteration_done():
            return False
        if not algorithm.min_signal_groups or scheduler.rounds >= algorithm.max_sampling_rounds:
            return True
        if self._signal_groups(scheduler.complete_open_groups()) >= algorithm.min_signal_groups:
            return True
        scheduler.extend()
        return False

    def _signal_groups(self, groups: list[GroupToStart]) -> int:
        """Groups whose members all have a reward and whose rewards differ (waits for their scores)."""
        members = [s for g in groups for s in g.sample_ids]
        self.scorers.wait_scored(members, self.scoring_timeout_seconds)
        scored = self.scorers.scored(members)
        return sum(has_signal([scored[s] for s in group.sample_ids]) for group in groups)

    def _start_groups(self, stream: PoolStream, sampling: common_pb2.SamplingParams) -> dict[str, int]:
        """Starts the groups the scheduler has room for, each whole on the least-loaded engine; their sample ids,
        with no tokens yet."""
        rows = {}

        def next_prompt() -> int:
            row = self.train_rows[self.state.order.next()]
            rows[row.index] = row
            return row.index

        groups = []
        for group in self.state.scheduler.schedule(next_prompt):
            row = rows[group.prompt_index]
            sequences = []
            for sample_id in group.sample_ids:
                self.state.samples[sample_id] = SampleInFlight(row, group.group_id)
                seed = sample_seed(self.spec.seed, sample_id) if self.spec.deterministic else 0
                sequence = new_sequence(sample_id, row, self.spec.tools is not None)
                sequence.seed = seed
                sequences.append(sequence)
            groups.append(sequences)
        stream.send_groups(groups, sampling)
        return {s.id: 0 for group in groups for s in group}
