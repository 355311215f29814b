"""Durable work queues on Redis streams with consumer groups.

A producer appends entries (XADD). The consumers of a group read them (XREADGROUP); a consumer
acknowledges an entry (XACK, and XDEL to keep the stream short) only after the result of its
work is stored, so an entry whose consumer dies first stays in the group's pending list. Another
consumer takes such entries over with `reclaim` (XAUTOCLAIM) once they have been idle longer
than a lease; a consumer that holds entries for long (a running job) renews its lease with
`renew`. An entry may thus be delivered more than once: handlers must be idempotent, which the
stores they write to make easy (they check whether the work is already stored).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import redis

FieldValue = str | bytes | int | float


@dataclass(frozen=True)
class StreamEntry:
    id: str
    fields: dict[str, bytes]

    def text(self, name: str) -> str:
        value = self.fields.get(name)
        if value is None:
            raise KeyError(f"stream entry {self.id} has no field {name!r}")
        return value.decode()


@dataclass(frozen=True)
class QueueDepth:
    undelivered: int  # entries no consumer has read yet
    pending: int  # read, not yet acknowledged


def _decode(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _entries(raw: list) -> list[StreamEntry]:
    entries = []
    for entry_id, fields in raw:
        if fields is None:  # an entry deleted while pending (Redis < 7 still lists it)
            fields = {}
        entries.append(StreamEntry(_decode(entry_id), {_decode(k): v for k, v in fields.items()}))
    return entries


class WorkStream:
    """One stream and one consumer group on it (created on first use)."""

    def __init__(self, client: redis.Redis, stream: str, group: str) -> None:
        self.redis, self.stream, self.group = client, stream, group
        self._group_ready = False

    def _ensure_group(self) -> None:
        if self._group_ready:
            return
        try:
            self.redis.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise
        self._group_ready = True

    def publish(self, fields: Mapping[str, FieldValue], pipe: redis.client.Pipeline | None = None) -> str | None:
        """Appends one entry; with a pipeline, as part of its transaction (returns None then)."""
        self._ensure_group()
        if pipe is not None:
            pipe.xadd(self.stream, dict(fields))
            return None
        return _decode(self.redis.xadd(self.stream, dict(fields)))

    def read(self, consumer: str, count: int, block_ms: int | None = None) -> list[StreamEntry]:
        """Entries no consumer of the group has read yet; they become pending on `consumer`."""
        return self._read(consumer, ">", count, block_ms)

    def read_own_pending(self, consumer: str, count: int) -> list[StreamEntry]:
        """Entries delivered to `consumer` earlier and not acknowledged (to retry them)."""
        return self._read(consumer, "0", count, None)

    def _read(self, consumer: str, start: str, count: int, block_ms: int | None) -> list[StreamEntry]:
        self._ensure_group()
        if count <= 0:
            return []
        try:
            reply = self.redis.xreadgroup(self.group, consumer, {self.stream: start}, count=count, block=block_ms)
        except redis.ResponseError as e:
            if "NOGROUP" not in str(e):  # the stream was deleted under us: recreate the group
                raise
            self._group_ready = False
            self._ensure_group()
            return []
        return _entries(reply[0][1]) if reply else []

    def reclaim(self, consumer: str, min_idle_ms: int, count: int) -> list[StreamEntry]:
        """Takes over up to `count` entries pending longer than `min_idle_ms` on any consumer (XAUTOCLAIM)."""
        self._ensure_group()
        claimed: list[StreamEntry] = []
        start = "0-0"
        while len(claimed) < count:
            reply = self.redis.xautoclaim(self.stream, self.group, consumer, min_idle_ms, start_id=start,
                                          count=count - len(claimed))
            start, entries = _decode(reply[0]), _entries(reply[1])
            claimed.extend(entries)
            if start == "0-0":
                break
        return claimed

    def renew(self, consumer: str, entry_ids: list[str]) -> None:
        """Resets the idle time of entries `consumer` holds, so `reclaim` leaves them alone.

        Only entries still pending on `consumer` are touched: one another consumer took over
        stays with it.
        """
        if not entry_ids:
            return
        mine = set(self.pending_ids(consumer))
        held = [i for i in entry_ids if i in mine]
        if held:
            self.redis.xclaim(self.stream, self.group, consumer, 0, held, justid=True)

    def ack(self, *entry_ids: str) -> None:
        """Acknowledges and deletes entries whose work is stored."""
        if not entry_ids:
            return
        pipe = self.redis.pipeline(transaction=True)
        pipe.xack(self.stream, self.group, *entry_ids)
        pipe.xdel(self.stream, *entry_ids)
        pipe.execute()

    def pending_ids(self, consumer: str | None = None, count: int = 10_000) -> list[str]:
        self._ensure_group()
        rows = self.redis.xpending_range(self.stream, self.group, min="-", max="+", count=count,
                                         consumername=consumer)
        return [_decode(row["message_id"]) for row in rows]

    def owner(self, entry_id: str) -> str | None:
        """The consumer an entry is pending on, or None when it is not pending."""
        rows = self.redis.xpending_range(self.stream, self.group, min=entry_id, max=entry_id, count=1)
        return _decode(rows[0]["consumer"]) if rows else None

    def depth(self) -> QueueDepth:
        self._ensure_group()
        group = next((g for g in self.redis.xinfo_groups(self.stream) if _decode(g["name"]) == self.group), None)
        if group is None:
            return QueueDepth(0, 0)
        last = _decode(group["last-delivered-id"])
        undelivered = len(self.redis.xrange(self.stream, min=f"({last}", max="+", count=100_000))
        return QueueDepth(undelivered, int(group["pending"]))

    def delete(self) -> None:
        """Removes the stream and its group (a finished job's queue)."""
        self.redis.delete(self.stream)
        self._group_ready = False
