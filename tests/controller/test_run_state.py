"""The runner's state between steps and its durable copy: a step's progress, written and read back,
gives the same state; stored partials or a dataset that no longer match it are refused, naming why."""

from __future__ import annotations

import pytest

from everstep.rest.job_spec import JobSpec
from everstep.v1 import common_pb2
from everstep_controller.data.dataset import PromptRow
from everstep_controller.run.run_state import IterationEnd, RunState, SampleInFlight

SPEC = JobSpec.model_validate({"model_path": "/m", "dataset": {"train_path": "/d.jsonl"},
                               "algorithm": {"group_size": 2},
                               "scheduler": {"mode": "c3po", "pool_capacity": 4, "token_budget": 10,
                                             "retention": 2}})
ROWS = {i: PromptRow(index=i, prompt=f"{i} + 1 =", answer=str(i + 1), prompt_ids=(i + 1,)) for i in range(5)}


def _after_one_step() -> tuple[RunState, IterationEnd]:
    state = RunState.fresh(SPEC, len(ROWS))
    rows = list(ROWS.values())
    started = state.scheduler.schedule(lambda: rows[state.order.next()].index)
    assert [g.group_id for g in started] == ["g0", "g1"]
    for sample_id in ("g0-0", "g0-1", "g1-0"):
        state.scheduler.on_finished(sample_id, 6)
    for sample_id in ("g0-0", "g0-1", "g1-0", "g1-1"):
        state.samples[sample_id] = SampleInFlight(ROWS[0], sample_id[:2])
    end = state.end_iteration([common_pb2.Sequence(id="g1-1", prompt_ids=[1], output_ids=[4, 5, 6],
                                                   finish_reason=common_pb2.FINISH_REASON_ABORTED)])
    state.step, state.version, state.num_trained_samples = 1, 1, 2
    return state, end


def test_an_iteration_end_is_a_snapshot_the_next_iteration_does_not_change() -> None:
    state, end = _after_one_step()
    assert end.outcome.trainable_groups == ["g0"] and end.train_ids == ["g0-0", "g0-1"]
    assert end.closed == ["g0-0", "g0-1"] and sorted(state.samples) == ["g1-0", "g1-1"], "closed samples let go"
    assert [s.id for s in state.carried] == [s.id for s in end.carried] == ["g1-1"]
    progress = state.progress(end)
    rows = list(ROWS.values())
    state.scheduler.schedule(lambda: rows[state.order.next()].index)  # the next iteration starts (overlap)
    state.carried[0].finish_reason = common_pb2.FINISH_REASON_UNSPECIFIED
    assert state.progress(end) == progress, "the step's commit still stores its own iteration's end"
    assert end.carried[0].finish_reason == common_pb2.FINISH_REASON_ABORTED, "a copy, not the engine's next input"


def test_a_steps_progress_read_back_gives_the_same_state() -> None:
    state, end = _after_one_step()
    progress = state.progress(end)
    assert (progress.step, progress.version, progress.group_counter, progress.prompt_cursor) == (1, 1, 2, 2)
    back = RunState.restored("j", SPEC, progress, {s.id: s for s in state.carried}, ROWS)
    assert back.scheduler.to_state() == progress.scheduler and back.step == 1 and back.version == 1
    assert [s.id for s in back.carried] == ["g1-1"] and list(back.carried[0].output_ids) == [4, 5, 6]
    assert sorted(back.samples) == ["g1-0", "g1-1"], "the open group's members"
    assert back.samples["g1-1"].sequence is not None and back.samples["g1-0"].sequence is None
    assert back.order.next() == state.order.next(), "the prompt order continues where it was"


def test_partials_or_a_dataset_that_no_longer_match_are_refused() -> None:
    state, end = _after_one_step()
    progress = state.progress(end)
    with pytest.raises(RuntimeError, match=r"stored partials do not match the scheduler \(0 stored, 1 expected\)"):
        RunState.restored("j", SPEC, progress, {}, ROWS)
    carried = {"g1-1": common_pb2.Sequence(id="g1-1")}
    group_row = RunState.restored("j", SPEC, progress, carried, ROWS).samples["g1-0"].row.index
    rows = {i: r for i, r in ROWS.items() if i != group_row}
    with pytest.raises(RuntimeError, match=rf"dataset row {group_row} is gone"):
        RunState.restored("j", SPEC, progress, carried, rows)
