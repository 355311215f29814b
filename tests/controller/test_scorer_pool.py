"""The scorers of a job, against a real Redis and real reward services: a finished rollout handed to
the pool in memory is scored once and its score stored in Redis (what a resumed job reads); a reward
service that cannot be reached keeps the rollouts waiting, nothing stored, until it is up; a score
stored before is kept, not computed again."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from everstep.processes import free_port, spawn, stop_processes, wait_grpc_serving
from everstep.rest.job_spec import JobSpec
from everstep.v1 import common_pb2, reward_pb2
from everstep_controller.run import metrics
from everstep_controller.run.backoff import Backoff
from everstep_controller.run.clients import RewardClient
from everstep_controller.run.scoring import ScorerPool, ScoringDepth, ScoringError
from everstep_controller.store.job_store import JobStore
from everstep_controller.store.progress_store import ProgressStore, ScoredSample

JOB = "job1"
ANSWERS = {0: "7", 1: "12"}


@pytest.fixture
def progress(redis_url: str) -> ProgressStore:
    store = JobStore(redis.Redis.from_url(redis_url))
    store.create(JobSpec(model_path="/m", dataset={"train_path": "/d.jsonl"}))
    return ProgressStore(store)


def _item(sample_id: str, prompt_index: int, sequence: common_pb2.Sequence) -> reward_pb2.RewardItem:
    spec = reward_pb2.VerifierSpec(name="math", weight=1.0, answer=ANSWERS[prompt_index])
    return reward_pb2.RewardItem(id=sample_id, response=sequence.output_text, verifiers=[spec])


def _sequence(sample_id: str, text: str) -> common_pb2.Sequence:
    return common_pb2.Sequence(id=sample_id, prompt_ids=[1, 2], output_ids=[3, 4], output_text=text)


def _pool(progress: ProgressStore, reward_address: str, **options: object) -> ScorerPool:
    return ScorerPool(JOB, progress, RewardClient(reward_address, timeout_seconds=30), _item, num_workers=1,
                      **options)


@pytest.fixture
def pool_on_free_port(progress: ProgressStore) -> Iterator[tuple[ScorerPool, int]]:
    port = free_port()
    pool = _pool(progress, f"127.0.0.1:{port}", backoff=Backoff(initial_seconds=0.1, max_seconds=0.3))
    try:
        yield pool, port
    finally:
        pool.stop()


def test_each_rollout_is_scored_once_and_its_score_kept_in_redis(progress: ProgressStore,
                                                                 reward_address: str) -> None:
    pool = _pool(progress, reward_address).start()
    try:
        pool.submit("s0", 0, _sequence("s0", "\\boxed{7}"))
        pool.submit("s1", 1, _sequence("s1", "\\boxed{5}"))
        pool.wait_scored(["s0", "s1"], timeout_seconds=60)
        assert pool.depth() == ScoringDepth(queued=0, in_flight=0)
        in_memory = pool.scored(["s0", "s1", "never"])
        assert sorted(in_memory) == ["s0", "s1"], "a sample never submitted has no score"
        assert in_memory["s0"].reward == 1.0 and in_memory["s1"].reward == 0.0
        stored = progress.scored(JOB, ["s0", "s1"])
        assert stored == in_memory, "every score is in Redis too, for a resumed job"
        assert stored["s0"].proto().output_text == "\\boxed{7}"

        pool.forget(["s0"])  # its group closed: the pool lets it go, Redis still answers for it
        assert pool.scored(["s0"])["s0"].reward == 1.0
    finally:
        pool.stop()


def test_an_unreachable_reward_service_keeps_the_rollouts_until_it_is_up(
        pool_on_free_port: tuple[ScorerPool, int], progress: ProgressStore, tmp_path: Path) -> None:
    pool, grpc_port = pool_on_free_port
    pool.submit("s0", 0, _sequence("s0", "\\boxed{7}"))
    pool.submit("s1", 1, _sequence("s1", "\\boxed{12}"))
    pool.start()
    deadline = time.monotonic() + 20
    while pool.last_error is None:
        assert time.monotonic() < deadline, "the scorer never tried"
        time.sleep(0.05)
    assert pool.depth() == ScoringDepth(queued=0, in_flight=2), "held by the scorer for its retry"
    assert progress.missing_scores(JOB, ["s0", "s1"]) == ["s0", "s1"], "nothing was stored"
    with pytest.raises(ScoringError, match=r"2 samples not scored after 0s .*last error: ServiceUnavailable"):
        pool.wait_scored(["s0", "s1"], timeout_seconds=0.2)

    http_port = free_port()
    reward = spawn("reward", ["-m", "everstep_reward", "--host", "127.0.0.1", "--port", str(http_port),
                              "--grpc-port", str(grpc_port), "--math-workers", "1"], tmp_path / "reward.log",
                   http_port=http_port, grpc_port=grpc_port)
    try:
        wait_grpc_serving(reward, 120)
        pool.wait_scored(["s0", "s1"], timeout_seconds=60)
    finally:
        stop_processes([reward])
    assert {s: v.reward for s, v in progress.scored(JOB, ["s0", "s1"]).items()} == {"s0": 1.0, "s1": 1.0}
    assert pool.depth() == ScoringDepth(queued=0, in_flight=0)


def test_a_score_stored_before_is_kept_not_computed_again(progress: ProgressStore, reward_address: str) -> None:
    stored = ScoredSample(sequence=_sequence("s0", "\\boxed{7}").SerializeToString(), reward=0.25)
    assert progress.store_scored(JOB, "s0", stored)
    duplicates = metrics.DUPLICATE_DELIVERIES.labels(queue="rollouts")
    before = duplicates._value.get()
    pool = _pool(progress, reward_address).start()
    try:
        pool.submit("s0", 0, _sequence("s0", "\\boxed{7}"))
        pool.wait_scored(["s0"], timeout_seconds=60)
        assert pool.scored(["s0"])["s0"].reward == 0.25, "the stored score, not a recomputed one"
    finally:
        pool.stop()
    assert progress.scored(JOB, ["s0"])["s0"].reward == 0.25
    assert duplicates._value.get() - before == 1
    assert not progress.store_scored(JOB, "s0", stored), "a score is stored at most once"

