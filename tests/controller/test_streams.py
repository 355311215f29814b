"""Redis streams as the durable job queue, against a real Redis: entries are acknowledged only after
their work is stored, and entries of a dead consumer are reclaimed once its lease lapses."""

from __future__ import annotations

import time

import pytest
import redis

from everstep_controller.store.streams import WorkStream


@pytest.fixture
def client(redis_url: str) -> redis.Redis:
    return redis.Redis.from_url(redis_url)


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
