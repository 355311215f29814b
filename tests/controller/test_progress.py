"""What a restarted controller continues from: the scheduler and prompt order rebuilt from their saved
state decide exactly as the originals would have; per-step commits and checkpoints in a real Redis,
fenced by the job's owner."""

from __future__ import annotations

import json
import random

import pytest
import redis
from pydantic import ValidationError
from step_rows import eval_row, step_row

from everstep.rest.job_record import JobState
from everstep.rest.job_spec import JobSpec
from everstep.settings.training import SchedulerMode
from everstep.v1 import common_pb2
from everstep_controller.algo.scheduler import C3POScheduler, SchedulerConfig
from everstep_controller.data.prompt_order import PromptOrder
from everstep_controller.store.job_store import InvalidJobUpdate, JobStore, LostOwnership
from everstep_controller.store.progress_store import JobProgress, ProgressStore, ScoredSample


def _drive(scheduler: C3POScheduler, iterations: int, rng: random.Random, lengths: dict[str, int],
           done: dict[str, int], next_group: list[int]) -> list[tuple]:
    """Runs a simulated engine; returns every decision the scheduler made."""
    decisions = []
    for _ in range(iterations):
        while not scheduler.iteration_done():
            for _ in range(scheduler.groups_to_start()):
                ids = [f"g{next_group[0]}-{k}" for k in range(scheduler.config.group_size)]
                scheduler.start_group(f"g{next_group[0]}", next_group[0], ids)
                next_group[0] += 1
                for sample_id in ids:
                    lengths[sample_id], done[sample_id] = rng.randint(1, 60), 0
            for sample_id in sorted(scheduler.active_samples):
                done[sample_id] += 1
                if done[sample_id] >= lengths[sample_id]:
                    scheduler.on_finished(sample_id, done[sample_id])
        outcome = scheduler.end_iteration({s: done[s] for s in scheduler.active_samples})
        decisions.append((outcome.trainable_groups, outcome.dropped_groups, outcome.purged_samples,
                          outcome.carried_samples, outcome.finished_tokens))
    return decisions


def test_a_restored_scheduler_decides_as_the_original() -> None:
    config = SchedulerConfig(mode=SchedulerMode.c3po, group_size=4, token_budget=150, retention=1, pool_capacity=16,
                             prompts_per_iteration=4)
    original = C3POScheduler(config)
    state: dict[str, dict] = {"lengths": {}, "done": {}}
    rng, next_group = random.Random(0), [0]
    _drive(original, 5, rng, state["lengths"], state["done"], next_group)
    saved = json.loads(json.dumps(original.to_state()))  # through JSON, as Redis holds it
    rng_state = rng.getstate()

    copy = C3POScheduler.from_state(config, saved)
    restored_rng = random.Random()
    restored_rng.setstate(rng_state)
    expected = _drive(original, 5, rng, dict(state["lengths"]), dict(state["done"]), list(next_group))
    got = _drive(copy, 5, restored_rng, dict(state["lengths"]), dict(state["done"]), list(next_group))
    assert got == expected
    assert copy.counters == original.counters
    assert any(d[3] for d in expected), "rollouts were carried over across the save"


def test_scheduler_state_is_only_taken_between_iterations() -> None:
    config = SchedulerConfig(mode=SchedulerMode.c3po, group_size=2, token_budget=10, retention=1, pool_capacity=4,
                             prompts_per_iteration=1)
    scheduler = C3POScheduler(config)
    scheduler.start_group("g0", 0, ["a", "b"])
    with pytest.raises(ValueError, match="between iterations"):
        scheduler.to_state()


def test_prompt_order_continues_from_epoch_and_cursor() -> None:
    order = PromptOrder(num_rows=7, seed=3)
    drawn = [order.next() for _ in range(10)]
    resumed = PromptOrder(num_rows=7, seed=3, epoch=order.epoch, cursor=order.cursor)
    assert [order.next() for _ in range(12)] == [resumed.next() for _ in range(12)]
    assert sorted(drawn[:7]) == list(range(7)), "an epoch draws every row once"
    other_seed = PromptOrder(num_rows=7, seed=4)
    assert drawn[:7] != [other_seed.next() for _ in range(7)], "the seed matters"


@pytest.fixture
def stores(redis_url: str) -> tuple[JobStore, ProgressStore, str]:
    store = JobStore(redis.Redis.from_url(redis_url))
    job_id = store.create(JobSpec(model_path="/m", dataset={"train_path": "/d.jsonl"})).id
    store.claim(job_id, "controller-a")
    return store, ProgressStore(store), job_id


def _progress(step: int) -> JobProgress:
    return JobProgress(step=step, version=step, prompt_epoch=0, prompt_cursor=step * 2, group_counter=step * 2,
                       scheduler={"iteration": step}, num_trained_samples=step * 8)


def _commit(progress: ProgressStore, job_id: str, step: int, owner: str = "controller-a", **kw) -> None:
    progress.commit_step(job_id, owner, progress=_progress(step),
                         carried=kw.get("carried", []), closed_sample_ids=kw.get("closed", []),
                         metrics=step_row(step), record_changes={"step": step})


def test_commit_is_atomic_and_fenced_by_the_owner(stores: tuple[JobStore, ProgressStore, str]) -> None:
    store, progress, job_id = stores
    progress.store_scored(job_id, "g0-0", ScoredSample(sequence=b"", reward=1.0))
    progress.store_scored(job_id, "g1-0", ScoredSample(sequence=b"", reward=0.0))
    progress.mark_training(job_id, "controller-a", 1)
    carried = [common_pb2.Sequence(id="g2-0", output_ids=[5, 6], output_versions=[0, 0])]
    _commit(progress, job_id, 1, carried=carried, closed=["g0-0"])
    assert progress.load(job_id) == _progress(1)
    assert progress.carried(job_id)["g2-0"].output_ids == [5, 6]
    assert progress.missing_scores(job_id, ["g0-0", "g1-0"]) == ["g0-0"], "trained scores are dropped"
    assert progress.training_marker(job_id) is None
    assert store.get(job_id).step == 1 and [m.step for m in store.metrics(job_id)] == [1]

    store.claim(job_id, "controller-b")  # another controller took the job over
    with pytest.raises(LostOwnership):
        _commit(progress, job_id, 2)
    with pytest.raises(LostOwnership):
        store.update(job_id, fence="controller-a", error="late write")
    assert progress.load(job_id).step == 1 and [m.step for m in store.metrics(job_id)] == [1]
    assert store.get(job_id).error is None


def test_an_update_is_validated_before_it_is_written(stores: tuple[JobStore, ProgressStore, str]) -> None:
    store, _, job_id = stores
    stored = store.redis.hget(store.key(job_id), "record")
    with pytest.raises(InvalidJobUpdate, match=r"\['stat'\]"):
        store.update(job_id, stat=JobState.RUNNING)  # misspelled: not dropped
    with pytest.raises(InvalidJobUpdate, match=r"\['id', 'spec'\]"):
        store.update(job_id, id="other", spec=None)  # set once, at create
    with pytest.raises(ValidationError, match="state"):
        store.update(job_id, state="BOGUS")
    with pytest.raises(ValidationError, match="step"):
        store.record_update(store.redis.pipeline(), store.get(job_id), step="two")
    assert store.redis.hget(store.key(job_id), "record") == stored, "nothing was written"
    assert store.get(job_id).state == JobState.PENDING, "the job stays readable"

    updated = store.update(job_id, state="RUNNING", error="e")
    assert updated.state is JobState.RUNNING and store.get(job_id) == updated


def test_checkpoint_restore_forgets_later_work(stores: tuple[JobStore, ProgressStore, str]) -> None:
    store, progress, job_id = stores
    _commit(progress, job_id, 1, carried=[common_pb2.Sequence(id="a", output_ids=[1])])
    progress.store_scored(job_id, "open", ScoredSample(sequence=b"", reward=1.0))
    _commit(progress, job_id, 2, carried=[common_pb2.Sequence(id="a", output_ids=[1, 2])])
    progress.save_checkpoint(job_id, "controller-a", "/ckpt/step-2")
    store.update(job_id, evaluation={"0": eval_row(0), "2": eval_row(2)})
    _commit(progress, job_id, 3, carried=[common_pb2.Sequence(id="b", output_ids=[7])], closed=["open"])
    progress.store_scored(job_id, "late", ScoredSample(sequence=b"", reward=0.0))
    store.update(job_id, evaluation={"0": eval_row(0), "2": eval_row(2), "3": eval_row(3)})

    assert progress.load_checkpoint(job_id).checkpoint_path == "/ckpt/step-2"
    restored = progress.restore_checkpoint(job_id, "controller-a")
    assert restored.step == 2 and restored.last_checkpoint_step == 2 and restored.checkpoint_path is None
    assert progress.load(job_id) == restored
    assert {k: list(v.output_ids) for k, v in progress.carried(job_id).items()} == {"a": [1, 2]}
    assert progress.missing_scores(job_id, ["open", "late"]) == ["late"]
    assert [m.step for m in store.metrics(job_id)] == [1, 2]
    record = store.get(job_id)
    assert record.step == 2 and set(record.evaluation) == {"0", "2"}


def test_a_checkpoint_is_named_in_the_job_record(stores: tuple[JobStore, ProgressStore, str]) -> None:
    store, progress, job_id = stores
    assert store.get(job_id).checkpoints == [] and store.get(job_id).latest_weights is None
    _commit(progress, job_id, 1)
    progress.save_checkpoint(job_id, "controller-a", "/ckpt/step-1")
    _commit(progress, job_id, 2)
    progress.save_checkpoint(job_id, "controller-a", "/ckpt/step-2")
    progress.save_checkpoint(job_id, "controller-a", "/ckpt/step-2")  # saved again (a resumed job): one entry
    record = store.get(job_id)
    assert [(c.step, c.path) for c in record.checkpoints] == [(1, "/ckpt/step-1"), (2, "/ckpt/step-2")]
    assert record.latest_weights == "/ckpt/step-2"
