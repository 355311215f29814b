"""The shared-memory transport, for engines on the trainer's host: bytes through /dev/shm, metadata over gRPC.

The trainer copies the tensors once into a segment under /dev/shm and sends, over
`Rollout.UpdateWeights`, only where each tensor lies in it; the engine maps the segment and copies
from it straight into its parameters. Two copies in all, against gRPC's serialise / send / parse /
copy.

Lifecycle of a segment (`SharedMemorySegment`):
- It is created as an anonymous tmpfs file (O_TMPFILE), locked with flock and fully allocated
  (posix_fallocate, so a full /dev/shm is an ENOSPC error here instead of a SIGBUS on a later
  write) before its name is linked; a segment visible by name is always locked by a live owner.
- The owner unlinks it on `release()`, at interpreter exit (weakref.finalize), and on any failed
  push (an engine that timed out may still be reading it; its mapping keeps the memory until it
  is done). The engine never creates or removes names; an engine that dies leaves nothing.
- An owner killed with SIGKILL cannot clean up; its lock dies with it, and the next segment
  created in the same directory removes every unlocked `everstep-weights-*` segment
  (`sweep_stale_segments`).

By default (`keep_segment=True`) segments outlive a successful push and are reused by later ones:
the pages of a fresh tmpfs file cost several times a copy to allocate and fault in (measured here:
0.84 s to allocate and map 500 MB against 0.13 s to copy it into warm pages). `keep_segment=False`
frees each after its push (an engine that kept views into it keeps the memory until it lets go).

One copy (`one_copy=True`, the default): the buckets say `engine_may_keep`, and an engine that can
(same dtype, unquantized) keeps its parameters as views into the segment instead of copying out of
it, so the trainer's write is the push's only copy. The trainer then never writes a segment that an
engine may still read: it remembers, per endpoint, the segment of its last successful push, and
writes the next version into one no endpoint holds (in steady state two segments alternate: the one
the engines run on and the one being written). A segment held only by endpoints a push leaves out is
released (unlinked, never written again) at that push, so engines that are gone pin nothing. A
failed push releases every segment (unlinked, never written again; an engine keeps what it maps) and
forgets the endpoints. `one_copy=False`: one
segment, rewritten by every push, and the engine copies out of it (two copies).

Messages: once the segment is written, each engine gets the whole layout in one `UpdateWeights` message, over a
channel kept from push to push (`connections.py`): a push to N engines of a host writes the segment once and sends
N small messages, so that an engine costs the trainer little more than that message. An engine that has not mapped
the segment yet (its first push through it: a new segment, or an engine new to it) gets the layout in buckets of
`bucket_bytes` instead, each sent as soon as its tensors are written, so that it maps the segment and fills its page
tables while the rest is written.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import secrets
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from everstep.v1 import rollout_pb2
from everstep_trainer.weight_push.base import (
    DEFAULT_BUCKET_BYTES,
    EndpointOutcome,
    EndpointStream,
    PushResult,
    TensorPlacement,
    Transport,
    WeightTransport,
    grpc_channel_options,
    layout_tensors,
    raise_for_failures,
    run_endpoint_streams,
    send_to_each,
)
from everstep_trainer.weight_push.connections import EngineConnections

__all__ = ["SEGMENT_PREFIX", "SHM_DIR", "SharedMemorySegment", "SharedMemoryWeightTransport",
           "sweep_stale_segments"]

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
SEGMENT_PREFIX = "everstep-weights-"
_SIZE_GRANULE = 1 << 20  # segments are sized in MiB so that small changes of the state dict reuse them
_COPY_SLICE_BYTES = 8 << 20  # unit of work of the parallel copy into the segment


def default_copy_threads() -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(4, cores))


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def sweep_stale_segments(directory: Path = SHM_DIR) -> list[str]:
    """Remove the `everstep-weights-*` segments no live owner holds locked; returns their names."""
    removed = []
    try:
        names = [n for n in os.listdir(directory) if n.startswith(SEGMENT_PREFIX)]
    except OSError:
        return removed
    for name in names:
        path = directory / name
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue  # removed meanwhile
        try:
            if _try_lock(fd) and os.fstat(fd).st_ino == os.stat(path).st_ino:
                os.unlink(path)
                removed.append(name)
        except OSError:
            pass
        finally:
            os.close(fd)
    if removed:
        log.warning("removed %d stale weight segment(s) of dead trainers from %s: %s", len(removed), directory,
                    removed[:5])
    return removed


def _create_locked_file(directory: Path, name: str, num_bytes: int) -> int:
    """An allocated, flock-ed tmpfs file linked as directory/name; returns its descriptor."""
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fd = os.open(directory, os.O_TMPFILE | os.O_RDWR, 0o600)
        except (AttributeError, OSError):
            fd = -1  # no O_TMPFILE here: create by name and lock at once (a sweeper may race us)
        if fd >= 0:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                os.posix_fallocate(fd, 0, num_bytes)
                os.link(f"/proc/self/fd/{fd}", name, dst_dir_fd=dir_fd, follow_symlinks=True)
                return fd
            except OSError as e:
                os.close(fd)
                if not isinstance(e, FileNotFoundError | NotImplementedError | PermissionError):
                    raise  # ENOSPC and the like are real; no /proc or no linkat falls through
        fd = os.open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600, dir_fd=dir_fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.posix_fallocate(fd, 0, num_bytes)
        except OSError:
            os.unlink(name, dir_fd=dir_fd)
            os.close(fd)
            raise
        return fd
    finally:
        os.close(dir_fd)


def _release(path: Path, fd: int, mapping: mmap.mmap) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    with contextlib.suppress(BufferError):  # views still alive: unmapped when the last one goes
        mapping.close()
    with contextlib.suppress(OSError):
        os.close(fd)


class SharedMemorySegment:
    """A named, locked, allocated segment under `directory`, mapped read-write as `buffer` (uint8)."""

    def __init__(self, num_bytes: int, *, directory: Path = SHM_DIR) -> None:
        if num_bytes <= 0:
            raise ValueError(f"num_bytes: must be > 0, got {num_bytes}")
        sweep_stale_segments(directory)
        self.name = f"{SEGMENT_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
        self.path = directory / self.name
        self.num_bytes = num_bytes
        try:
            fd = _create_locked_file(directory, self.name, num_bytes)
        except OSError as e:
            raise OSError(e.errno, f"cannot create a {num_bytes}-byte weight segment in {directory} "
                                   f"(is it large enough? a container's /dev/shm is 64 MiB by default): "
                                   f"{e.strerror}") from e
        mapping = mmap.mmap(fd, num_bytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self.buffer = torch.frombuffer(mapping, dtype=torch.uint8)
        self.array = np.frombuffer(mapping, dtype=np.uint8)  # the same bytes, for memcpy without torch threads
        self._finalizer = weakref.finalize(self, _release, self.path, fd, mapping)

    @property
    def released(self) -> bool:
        return not self._finalizer.alive

    def release(self) -> None:
        """Unlink the name, unmap (once no view is left) and drop the lock. Idempotent."""
        self.buffer = torch.empty(0, dtype=torch.uint8)
        self.array = np.empty(0, dtype=np.uint8)
        self._finalizer()

    def write(self, placement: TensorPlacement) -> None:
        if placement.num_bytes == 0:
            return
        target = self.buffer[placement.offset : placement.offset + placement.num_bytes]
        target.view(placement.tensor.dtype).view(placement.tensor.shape).copy_(placement.tensor.detach())

    def copy_tasks(self, placement: TensorPlacement) -> list[Callable[[], object]]:
        """Independent pieces of writing one tensor: memcpy of slices for a contiguous CPU tensor (numpy
        releases the GIL, and no OpenMP pool spins on a busy machine), else one torch copy."""
        source = placement.tensor.detach()
        if placement.num_bytes == 0:
            return []
        if source.device.type != "cpu" or not source.is_contiguous():
            return [partial(self.write, placement)]
        raw = source.reshape(-1).view(torch.uint8).numpy()
        target = self.array[placement.offset : placement.offset + placement.num_bytes]
        return [partial(np.copyto, target[start : start + _COPY_SLICE_BYTES], raw[start : start + _COPY_SLICE_BYTES])
                for start in range(0, placement.num_bytes, _COPY_SLICE_BYTES)]


class SharedMemoryWeightTransport(WeightTransport):
    """Tensors through a /dev/shm segment on this host; only their layout travels over gRPC.

    Every endpoint must see the same /dev/shm (same host, same IPC namespace); `plan`
    checks that before choosing this transport. The segment is written once per push, whatever the number of
    engines; each engine then gets one message naming it (`send_to_each`) over a kept channel. Only an engine
    that has not mapped the segment yet gets the layout in buckets as the segment is written, so that it maps the
    segment and fills its page tables meanwhile (`_seen`).
    """

    kind = Transport.SHM

    def __init__(self, *, timeout_seconds: float = 600.0, keep_segment: bool = True,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, directory: Path = SHM_DIR,
                 copy_threads: int | None = None, one_copy: bool = True,
                 connections: EngineConnections | None = None) -> None:
        """`bucket_bytes`: tensors written between two metadata messages of a push to an engine that maps the
        segment for the first time (it maps while later ones are written; an engine that mapped it before gets
        one message). `keep_segment`: reuse segments across pushes. `copy_threads`: threads copying into the
        segment (default: the cores, at most 4). `one_copy`: let engines keep their parameters in the segment
        (see the module's doc). `connections`: the engines' kept channels (None: this transport keeps its own)."""
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes: must be > 0, got {bucket_bytes}")
        copy_threads = copy_threads or default_copy_threads()
        if copy_threads < 1:
            raise ValueError(f"copy_threads: must be >= 1, got {copy_threads}")
        self.copy_threads = copy_threads
        self._pool: ThreadPoolExecutor | None = None
        self.timeout_seconds = timeout_seconds
        self.keep_segment = keep_segment
        self.bucket_bytes = bucket_bytes
        self.directory = Path(directory)
        self.one_copy = one_copy
        self._owns_connections = connections is None
        self.connections = connections if connections is not None else EngineConnections(
            channel_options=grpc_channel_options())
        self._segments: list[SharedMemorySegment] = []
        """Every live segment this transport owns (one without one_copy)."""
        self._held: dict[str, SharedMemorySegment] = {}
        """one_copy: endpoint -> the segment of its last successful push (it may run on views into it)."""
        self._seen: dict[str, set[str]] = {}
        """endpoint -> the names of the live segments it was pushed through successfully (it has them mapped)."""

    @property
    def segment(self) -> SharedMemorySegment | None:
        """The segment of the last push, if kept."""
        return self._segments[-1] if self._segments else None

    @property
    def segments(self) -> list[SharedMemorySegment]:
        """Every segment kept, oldest first."""
        return list(self._segments)

    def _drop(self, segment: SharedMemorySegment) -> None:
        """Release a segment (never written again) and forget it."""
        self._segments.remove(segment)
        segment.release()
        for names in self._seen.values():
            names.discard(segment.name)

    def _segment_for(self, num_bytes: int) -> SharedMemorySegment:
        """A segment of the right size that no endpoint may still read from (one_copy), else a new one."""
        size = max(_SIZE_GRANULE, -(-num_bytes // _SIZE_GRANULE) * _SIZE_GRANULE)
        held = {id(s) for s in self._held.values()}
        for segment in list(self._segments):
            if id(segment) in held:
                continue
            if size <= segment.num_bytes <= 2 * size:
                self._segments.remove(segment)  # moved to the end: the newest
                self._segments.append(segment)
                return segment
            self._drop(segment)
        segment = SharedMemorySegment(size, directory=self.directory)
        self._segments.append(segment)
        return segment

    def _forget_others(self, endpoints: Sequence[str]) -> None:
        """Release the segments held only by endpoints this push leaves out (gone, or pushed to apart): never
        written again, so no stopped engine pins one forever; a live one keeps its mapping until its next update."""
        holders: dict[int, list[str]] = {}
        for endpoint, segment in self._held.items():
            holders.setdefault(id(segment), []).append(endpoint)
        for segment in list(self._segments):
            held_by = holders.get(id(segment), [])
            if held_by and set(held_by).isdisjoint(endpoints):  # one holder in this push keeps every hold
                for endpoint in held_by:
                    del self._held[endpoint]
                self._drop(segment)

    def _release_all(self) -> None:
        for segment in self._segments:
            segment.release()
        self._segments = []
        self._held = {}
        self._seen = {}

    def _bucket(self, segment: SharedMemorySegment, items: list[TensorPlacement], version: int,
                last: bool) -> rollout_pb2.WeightBucket:
        return rollout_pb2.WeightBucket(version=version, last=last, shared_memory=rollout_pb2.SharedMemoryWeights(
            segment=segment.name, segment_bytes=segment.num_bytes, tensors=[p.slot() for p in items],
            engine_may_keep=self.one_copy))

    def _buckets(self, segment: SharedMemorySegment, placements: list[TensorPlacement],
                 version: int) -> Iterator[rollout_pb2.WeightBucket]:
        """The layout in buckets of about `bucket_bytes`, each sent once its tensors are written."""
        group: list[TensorPlacement] = []
        group_bytes = 0
        for placement in placements:
            if group and group_bytes + placement.num_bytes > self.bucket_bytes:
                self._write(segment, group)
                yield self._bucket(segment, group, version, last=False)
                group, group_bytes = [], 0
            group.append(placement)
            group_bytes += placement.num_bytes
        self._write(segment, group)
        yield self._bucket(segment, group, version, last=True)

    def _write(self, segment: SharedMemorySegment, placements: list[TensorPlacement]) -> None:
        tasks = [task for p in placements for task in segment.copy_tasks(p)]
        if self.copy_threads == 1 or len(tasks) < 2:
            for task in tasks:
                task()
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.copy_threads, thread_name_prefix="weight-shm-copy")
        for future in [self._pool.submit(task) for task in tasks]:
            future.result()

    def push(self, named_tensors: Iterable[tuple[str, Tensor]], *, version: int,
             endpoints: Sequence[str], adapter: rollout_pb2.LoraAdapter | None = None) -> PushResult:
        if not endpoints:
            raise ValueError("endpoints: at least one endpoint is required")
        start = time.perf_counter()
        placements, total = layout_tensors(named_tensors)
        self._forget_others(endpoints)
        segment = self._segment_for(total)
        succeeded = False
        try:
            if all(segment.name in self._seen.get(e, ()) for e in endpoints):
                # Every engine has this segment mapped: write it whole, then one message each.
                self._write(segment, placements)
                outcomes: Sequence[EndpointOutcome | EndpointStream] = send_to_each(
                    self._bucket(segment, placements, version, last=True), endpoints, connections=self.connections,
                    timeout_seconds=self.timeout_seconds, adapter=adapter)
            else:
                outcomes = run_endpoint_streams(self._buckets(segment, placements, version), endpoints,
                                                timeout_seconds=self.timeout_seconds, adapter=adapter,
                                                connections=self.connections)
            raise_for_failures(outcomes)
            succeeded = True
        finally:
            if not succeeded:
                # An engine may still be reading (or running on) any of them: never write them again.
                self._release_all()
        for endpoint in endpoints:
            self._seen.setdefault(endpoint, set()).add(segment.name)
        if self.one_copy:
            self._held.update(dict.fromkeys(endpoints, segment))
        if not self.keep_segment:
            self._drop(segment)
        num_bytes = sum(p.num_bytes for p in placements)
        kept = sum(1 for s in outcomes if s.response is not None and s.response.kept_in_place)
        return PushResult(version=version, num_bytes=num_bytes * len(endpoints), seconds=time.perf_counter() - start,
                          num_endpoints=len(endpoints), transport=self.kind, num_kept_in_place=kept)

    def close(self) -> None:
        self._release_all()
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        if self._owns_connections:
            self.connections.close()
