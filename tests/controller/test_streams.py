"""Redis streams as the durable spine, against a real Redis and a real reward service: entries are
acknowledged only after their work is stored, entries of a dead consumer are reclaimed, and a
redelivered entry whose work is already stored is not done twice."""

from __future__ import annotations

import time

import pytest
import redis

from everstep.v1 import common_pb2, reward_pb2
from everstep_controller import metrics
from everstep_controller.clients import RewardClient
from everstep_controller.job_store import JobStore
from everstep_controller.progress_store import ProgressStore, ScoredSample
from everstep_controller.scoring import ScorerPool
from everstep_controller.spec import JobSpec
from everstep_controller.streams import WorkStream

JOB = "job1"
ANSWERS = {0: "7", 1: "12"}


@pytest.fixture
def client(redis_url: str) -> redis.Redis:
    return redis.Redis.from_url(redis_url)


@pytest.fixture
def progress(client: redis.Redis) -> ProgressStore:
    store = JobStore(client)
    store.create(JobSpec(model_path="/m", dataset={"train_path": "/d.jsonl"}))
    return ProgressStore(store)


def _item(sample_id: str, prompt_index: int, sequence: common_pb2.Sequence) -> reward_pb2.RewardItem:
    spec = reward_pb2.VerifierSpec(name="math", weight=1.0, answer=ANSWERS[prompt_index])
    return reward_pb2.RewardItem(id=sample_id, response=sequence.output_text, verifiers=[spec])


def _sequence(sample_id: str, text: str) -> common_pb2.Sequence:
    return common_pb2.Sequence(id=sample_id, prompt_ids=[1, 2], output_ids=[3, 4], output_text=text)


def _pool(progress: ProgressStore, reward_address: str, prefix: str, reclaim_idle_seconds: float = 60.0) -> ScorerPool:
    return ScorerPool(JOB, progress, RewardClient(reward_address, timeout_seconds=30), _item, consumer_prefix=prefix,
                      num_workers=1, reclaim_idle_seconds=reclaim_idle_seconds)


def test_a_held_entry_is_reclaimed_only_after_its_lease_lapses(client: redis.Redis) -> None:
    queue = WorkStream(client, "everstep:test", "workers")
    entry_id = queue.publish({"n": "1"})
    assert [e.id for e in queue.read("a", 10)] == [entry_id]
    for _ in range(3):  # "a" keeps renewing: nobody takes its entry
        time.sleep(0.1)
        queue.renew("a", [entry_id])
        assert queue.reclaim("b", min_idle_ms=150, count=10) == []
    time.sleep(0.2)  # "a" died: its lease lapses
    assert [e.id for e in queue.reclaim("b", min_idle_ms=150, count=10)] == [entry_id]
    assert queue.owner(entry_id) == "b"
    queue.renew("a", [entry_id])  # a late renewal of the old owner does not take it back
    assert queue.owner(entry_id) == "b"
    queue.ack(entry_id)
    assert queue.depth().pending == 0 and queue.owner(entry_id) is None


def test_scores_are_acknowledged_only_once_stored_and_a_dead_scorers_entries_are_reclaimed(
        progress: ProgressStore, reward_address: str, free_port: int) -> None:
    stream = progress.rollouts(JOB)
    # a scorer whose reward service is unreachable: it reads the entries but can store nothing
    broken = ScorerPool(JOB, progress, RewardClient(f"127.0.0.1:{free_port}", timeout_seconds=1), _item,
                        consumer_prefix="dead", num_workers=1)
    broken.submit("s0", 0, _sequence("s0", "\\boxed{7}"))
    broken.submit("s1", 1, _sequence("s1", "\\boxed{5}"))
    broken.start()
    deadline = time.monotonic() + 20
    while broken.last_error is None:
        assert time.monotonic() < deadline, "the scorer never tried"
        time.sleep(0.05)
    broken.stop()  # the scorer "dies" holding both entries
    assert stream.depth().pending == 2, "nothing was acknowledged"
    assert progress.missing_scores(JOB, ["s0", "s1"]) == ["s0", "s1"], "nothing was stored"

    reclaimed_before = metrics.RECLAIMED.labels(queue="rollouts")._value.get()
    alive = _pool(progress, reward_address, "alive", reclaim_idle_seconds=0.2).start()
    try:
        alive.wait_scored(["s0", "s1"], timeout_seconds=60)
    finally:
        alive.stop()
    scores = progress.scored(JOB, ["s0", "s1"])
    assert scores["s0"].reward == 1.0 and scores["s1"].reward == 0.0
    assert scores["s0"].proto().output_text == "\\boxed{7}"
    assert stream.depth() == stream.depth().__class__(undelivered=0, pending=0)
    assert metrics.RECLAIMED.labels(queue="rollouts")._value.get() - reclaimed_before == 2


def test_a_redelivered_rollout_is_not_scored_again(progress: ProgressStore, reward_address: str) -> None:
    stream = progress.rollouts(JOB)
    pool = _pool(progress, reward_address, "p")
    pool.submit("s0", 0, _sequence("s0", "\\boxed{7}"))
    # a scorer stored its score and died before acknowledging: the entry is still pending
    entries = stream.read("died", 10)
    stored = ScoredSample(sequence=_sequence("s0", "\\boxed{7}").SerializeToString(), reward=0.25)
    assert progress.store_scored(JOB, "s0", stored)
    duplicates_before = metrics.DUPLICATE_DELIVERIES.labels(queue="rollouts")._value.get()

    pool.handle(entries)  # the redelivery
    assert progress.scored(JOB, ["s0"])["s0"].reward == 0.25, "the stored score was not replaced or recomputed"
    assert metrics.DUPLICATE_DELIVERIES.labels(queue="rollouts")._value.get() - duplicates_before == 1
    assert stream.depth().pending == 0, "the redelivered entry was acknowledged"
    assert not progress.store_scored(JOB, "s0", stored), "a score is stored at most once"
