"""Shared memory segments of the weight push: names exist only while a live owner holds them.

These use the real /dev/shm; every name checked carries this test process's pid (or the pid of a
child it started), so parallel test runs of other people do not interfere.
"""

from __future__ import annotations

import dataclasses
import os
import signal
from pathlib import Path

import pytest
import torch

from everstep_rollout.weights import WeightUpdate
from everstep_trainer.weight_push.base import layout_tensors
from everstep_trainer.weight_push.shm import SEGMENT_PREFIX, SHM_DIR, SharedMemorySegment, sweep_stale_segments

pytestmark = pytest.mark.skipif(not SHM_DIR.is_dir(), reason="no /dev/shm on this system")


def segments_of(pid: int) -> list[str]:
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(f"{SEGMENT_PREFIX}{pid}-"))


def test_a_segment_is_named_while_held_and_gone_after_release() -> None:
    segment = SharedMemorySegment(1 << 16)
    try:
        assert segments_of(os.getpid()) == [segment.name]
        assert (SHM_DIR / segment.name).stat().st_size == 1 << 16
        assert segment.name not in sweep_stale_segments()  # held: never swept
        assert (SHM_DIR / segment.name).exists()
    finally:
        segment.release()
    assert segments_of(os.getpid()) == [] and segment.released
    segment.release()  # idempotent
    with pytest.raises(ValueError, match="num_bytes"):
        SharedMemorySegment(0)


def test_the_segment_of_a_killed_owner_is_swept_by_the_next_one() -> None:
    read_end, write_end = os.pipe()
    pid = os.fork()  # a child owner, without the cost of a fresh interpreter importing torch
    if pid == 0:
        try:
            os.close(read_end)
            segment = SharedMemorySegment(1 << 16)
            os.write(write_end, segment.name.encode() + b"\n")
            signal.pause()
        finally:
            os._exit(1)
    os.close(write_end)
    try:
        with os.fdopen(read_end) as pipe:
            name = pipe.readline().strip()
        assert name.startswith(f"{SEGMENT_PREFIX}{pid}-") and (SHM_DIR / name).exists()
        mine = SharedMemorySegment(1 << 16)  # sweeps, but the child still holds its lock
        assert (SHM_DIR / name).exists()
    finally:
        os.kill(pid, signal.SIGKILL)  # no chance to clean up
        os.waitpid(pid, 0)
    try:
        assert (SHM_DIR / name).exists()  # leaked by the kill...
        assert name in sweep_stale_segments()  # ...until the next sweep
        assert not (SHM_DIR / name).exists() and (SHM_DIR / mine.name).exists()
    finally:
        mine.release()


def test_the_engine_reads_tensors_in_place_from_the_trainers_segment() -> None:
    """Trainer-side segment writing and engine-side mapping, in one process (the cross-process push is
    in test_weight_push_engine.py)."""
    torch.manual_seed(0)
    weights = [("a", torch.randn(33, 7)), ("b", torch.randn(5).to(torch.bfloat16)), ("c", torch.tensor(2.5)),
               ("d", torch.zeros(0, 4)), ("e", torch.randn(6, 4)[:, ::2]), ("f", torch.arange(3))]
    placements, total = layout_tensors(weights)
    assert all(p.offset % 64 == 0 for p in placements)
    segment = SharedMemorySegment(total)
    update = WeightUpdate()
    try:
        for p in placements:
            segment.write(p)
        from everstep.v1 import rollout_pb2

        update.add(rollout_pb2.WeightBucket(version=3, last=True, shared_memory=rollout_pb2.SharedMemoryWeights(
            segment=segment.name, segment_bytes=segment.num_bytes, tensors=[p.slot() for p in placements])))
        assert update.complete and update.transport == "shm" and update.version == 3
        for name, tensor in weights:
            assert update.tensors[name].dtype == tensor.dtype and torch.equal(update.tensors[name], tensor), name
        # Views, not copies: what the trainer writes next is what the engine's tensor shows.
        segment.buffer[placements[0].offset : placements[0].offset + 4].view(torch.float32).fill_(42.0)
        assert update.tensors["a"][0, 0].item() == 42.0
        assert update.num_bytes == sum(t.numel() * t.element_size() for _, t in weights)
    finally:
        update.close()
        segment.release()
    assert segments_of(os.getpid()) == []


def test_the_engine_refuses_segments_that_are_not_weight_segments(tmp_path: Path) -> None:
    from everstep.v1 import rollout_pb2

    def attempt(segment: str, segment_bytes: int = 4096, slot: rollout_pb2.TensorSlot | None = None) -> None:
        update = WeightUpdate()
        try:
            update.add(rollout_pb2.WeightBucket(version=1, shared_memory=rollout_pb2.SharedMemoryWeights(
                segment=segment, segment_bytes=segment_bytes, tensors=[slot] if slot else [])))
        finally:
            update.close()

    for bad in ("../etc/passwd", "everstep-weights-1/../../x", "other-file", ""):
        with pytest.raises(ValueError, match="shared_memory.segment"):
            attempt(bad)
    with pytest.raises(ValueError, match="does not exist .* same /dev/shm"):
        attempt(f"{SEGMENT_PREFIX}0-gone")
    segment = SharedMemorySegment(4096)
    try:
        with pytest.raises(ValueError, match="segment_bytes"):
            attempt(segment.name, segment_bytes=8192)
        with pytest.raises(ValueError, match=r"tensor 'w': offset 4092 \(\+16 bytes\)"):
            attempt(segment.name, slot=rollout_pb2.TensorSlot(name="w", dtype="float32", shape=[4], offset=4092))
        with pytest.raises(ValueError, match="offset 2"):
            attempt(segment.name, slot=rollout_pb2.TensorSlot(name="w", dtype="float32", shape=[1], offset=2))
        with pytest.raises(ValueError, match="unknown dtype"):
            attempt(segment.name, slot=rollout_pb2.TensorSlot(name="w", dtype="float99", shape=[1]))
    finally:
        segment.release()


def test_the_parallel_copy_into_a_segment_writes_every_byte() -> None:
    from everstep_trainer.weight_push.shm import SharedMemoryWeightTransport

    torch.manual_seed(1)
    weights = [("big", torch.randn(2_300_000)),                    # 9.2 MB: two copy slices
               ("bf16", torch.randn(1000).to(torch.bfloat16)), ("strided", torch.randn(40, 8)[:, ::3]),
               ("scalar", torch.tensor(7, dtype=torch.int64)), ("empty", torch.zeros(0))]
    placements, total = layout_tensors(weights)
    transport = SharedMemoryWeightTransport(copy_threads=2)
    segment = SharedMemorySegment(total)
    try:
        assert len(segment.copy_tasks(placements[0])) == 2
        transport._write(segment, placements)
        for p in placements:
            written = segment.buffer[p.offset : p.offset + p.num_bytes].view(p.tensor.dtype).view(p.tensor.shape)
            assert torch.equal(written, p.tensor), p.name
    finally:
        segment.release()
        transport.close()


def test_the_engine_keeps_its_mappings_of_the_trainers_latest_segments() -> None:
    """`SegmentCache`: a segment that comes back (the trainer alternates two) is the same mapping, page tables
    filled once, and it shows what the trainer wrote since; an update's close leaves cached mappings alone; the
    oldest falls out past the cache's size."""
    from everstep.v1 import rollout_pb2
    from everstep_rollout.weights import SegmentCache

    placements, total = layout_tensors([("w", torch.zeros(256))])
    segments = [SharedMemorySegment(total) for _ in range(3)]
    cache = SegmentCache(size=2)

    def message(segment: SharedMemorySegment) -> rollout_pb2.SharedMemoryWeights:
        return rollout_pb2.SharedMemoryWeights(segment=segment.name, segment_bytes=segment.num_bytes,
                                               tensors=[p.slot() for p in placements])

    try:
        for value, segment in ((1.0, segments[0]), (2.0, segments[1])):
            segment.write(dataclasses.replace(placements[0], tensor=torch.full((256,), value)))
        first = WeightUpdate(segments=cache)
        first.add(rollout_pb2.WeightBucket(version=1, last=True, shared_memory=message(segments[0])))
        assert torch.equal(first.tensors["w"], torch.full((256,), 1.0))
        first.close()
        mapped = cache.get(message(segments[0]), SHM_DIR)
        assert mapped.buffer.numel() == segments[0].num_bytes  # still mapped after the update's close
        segments[0].write(dataclasses.replace(placements[0], tensor=torch.full((256,), 3.0)))  # the next version
        again = WeightUpdate(segments=cache)
        again.add(rollout_pb2.WeightBucket(version=3, last=True, shared_memory=message(segments[0])))
        assert torch.equal(again.tensors["w"], torch.full((256,), 3.0)) and cache.get(message(segments[0]),
                                                                                    SHM_DIR) is mapped
        again.close()
        cache.get(message(segments[1]), SHM_DIR)
        cache.get(message(segments[2]), SHM_DIR)  # three segments in a cache of two: the oldest goes
        assert mapped.buffer.numel() == 0 and cache.get(message(segments[0]), SHM_DIR) is not mapped
        with pytest.raises(ValueError, match="shared_memory.segment"):
            cache.get(rollout_pb2.SharedMemoryWeights(segment="../etc/passwd", segment_bytes=4096), SHM_DIR)
    finally:
        cache.close()
        for segment in segments:
            segment.release()
    assert segments_of(os.getpid()) == []


def test_a_kept_segment_keeps_its_views_per_layout() -> None:
    """A push that sends the layout it sent before gets the same views back (no slot parsed again), showing what
    the trainer wrote since; another layout gets views of its own; a name twice is refused either way; closing the
    cache unmaps the segment although views of it were kept."""
    from everstep.v1 import rollout_pb2
    from everstep_rollout.weights import SegmentCache

    placements, total = layout_tensors([("w", torch.zeros(64)), ("b", torch.zeros(8))])
    segment = SharedMemorySegment(total)
    cache = SegmentCache()

    def update(version: int, slots: list[rollout_pb2.TensorSlot]) -> WeightUpdate:
        received = WeightUpdate(segments=cache)
        received.add(rollout_pb2.WeightBucket(version=version, last=True, shared_memory=rollout_pb2.SharedMemoryWeights(
            segment=segment.name, segment_bytes=segment.num_bytes, tensors=slots)))
        return received

    try:
        slots = [p.slot() for p in placements]
        segment.write(dataclasses.replace(placements[0], tensor=torch.full((64,), 1.0)))
        first = update(1, slots)
        w = first.tensors["w"]
        assert torch.equal(w, torch.full((64,), 1.0)) and first.num_bytes == 64 * 4 + 8 * 4
        first.close()
        segment.write(dataclasses.replace(placements[0], tensor=torch.full((64,), 2.0)))
        again = update(2, slots)
        assert again.tensors["w"] is w and torch.equal(w, torch.full((64,), 2.0)) and again.num_bytes == first.num_bytes
        again.close()
        other = update(3, slots[:1])  # another layout: views of its own
        assert list(other.tensors) == ["w"] and other.tensors["w"] is not w and other.num_bytes == 64 * 4
        other.close()
        for twice in ([slots[0], slots[0]], [slots[1], slots[0], slots[1]]):
            with pytest.raises(ValueError, match="sent twice"):
                update(4, twice)
        mapped = cache.get(rollout_pb2.SharedMemoryWeights(segment=segment.name, segment_bytes=segment.num_bytes),
                           SHM_DIR)
        del w
        cache.close()
        assert mapped.buffer.numel() == 0 and mapped._mapping.closed  # the kept views did not pin the mapping
    finally:
        cache.close()
        segment.release()
    assert segments_of(os.getpid()) == []
