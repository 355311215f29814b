"""Turns one `Rollout.UpdateWeights` stream into named tensors for `Engine.update_weights`.

The buckets of an update carry the bytes themselves (gRPC: whole tensors, or chunks of one tensor
larger than a message, reassembled here; both decoded by `everstep.tensors.tensor_codec`, as the trainer
encoded them) or only where the bytes are: a /dev/shm segment the trainer wrote (mapped here and
viewed with torch.frombuffer: the engine then copies straight from the mapping into its
parameters, no other copy; or, when the trainer promises `engine_may_keep`, keeps its parameters as
those views, no copy at all), a broadcast of the trainer's weight group, or CUDA IPC handles. One
update uses one carrier. Nothing reaches the engine before the last bucket, so a stream that fails
halfway changes nothing.

Shared memory: the engine only opens segments named `everstep-weights-*` directly under /dev/shm,
for reading, and unmaps them when the update is done (a segment the engine's parameters were
kept in stays mapped until a later update replaces them); it never creates or removes a segment (the
trainer owns them), so an engine that dies leaks nothing.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from everstep.tensors import tensor_codec
from everstep.transport.peer_identity import SHM_DIR, boot_id, shm_domain
from everstep.v1 import rollout_pb2
from everstep_rollout.weights.group import WeightGroupMember, cuda_device_uuid, rebuild_cuda_ipc_tensor

__all__ = ["SHM_DIR", "SegmentCache", "WeightUpdate", "receiver_info"]

_SEGMENT_NAME = re.compile(r"everstep-weights-[A-Za-z0-9_-]+")
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux 5.14+; Python names it from 3.13
_LAYOUTS_KEPT = 4
"""Layouts whose views a mapped segment keeps (one in steady state: every push sends the same)."""


def receiver_info(device: str) -> rollout_pb2.WeightReceiverInfo:
    """What the trainer needs to pick a transport for an engine on `device`."""
    gpu_uuid = ""
    if device.startswith("cuda") and torch.cuda.is_available():
        gpu_uuid = cuda_device_uuid(torch.device(device).index or 0)
    return rollout_pb2.WeightReceiverInfo(shm_domain=shm_domain(), boot_id=boot_id(), device=device,
                                          gpu_uuid=gpu_uuid)


def _view(buffer: torch.Tensor, slot: rollout_pb2.TensorSlot, where: str) -> torch.Tensor:
    """The slot's tensor as a view into the flat uint8 `buffer`, after checking it lies inside."""
    dtype, shape = tensor_codec.dtype_from_name(slot.dtype, tensor=slot.name), tuple(slot.shape)
    num_bytes = tensor_codec.num_bytes(dtype, shape, tensor=slot.name)
    if slot.offset < 0 or slot.offset + num_bytes > buffer.numel() or slot.offset % dtype.itemsize:
        raise ValueError(f"tensor {slot.name!r}: offset {slot.offset} (+{num_bytes} bytes) is not an aligned range "
                         f"of the {buffer.numel()}-byte {where}")
    if num_bytes == 0:
        return torch.empty(shape, dtype=dtype)
    return buffer[slot.offset : slot.offset + num_bytes].view(dtype).view(shape)


@dataclass
class _PartialTensor:
    """A chunked tensor being reassembled."""

    name: str
    dtype: str
    """Its wire name."""
    shape: tuple[int, ...]
    data: np.ndarray
    received: int = 0


class _MappedSegment:
    """A trainer's segment, mapped privately; `buffer` views it.

    Private and writable only so that torch takes it as an ordinary buffer: nothing here writes to
    it, reads see the trainer's pages, and a stray write would copy one page for this process
    instead of touching the trainer's data. The page tables are filled at once (MADV_POPULATE_READ,
    which reads and never copies, or a read of every page) when the first bucket names the segment,
    while the trainer is still writing later buckets, so that the copy into the parameters after the
    last bucket does not stop at every page.
    """

    def __init__(self, message: rollout_pb2.SharedMemoryWeights, directory: Path) -> None:
        self._layouts: OrderedDict[bytes, tuple[dict[str, torch.Tensor], int]] = OrderedDict()
        if not _SEGMENT_NAME.fullmatch(message.segment):
            raise ValueError(f"shared_memory.segment: {message.segment!r} is not an everstep weight segment name")
        self.name = message.segment
        path = directory / message.segment
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise ValueError(f"shared_memory.segment: {path} does not exist (is the trainer on this host, "
                             f"with the same /dev/shm?)") from None
        try:
            size = os.fstat(fd).st_size
            if size != message.segment_bytes or size == 0:
                raise ValueError(f"shared_memory.segment_bytes: {message.segment_bytes}, but {path} has {size} bytes")
            self._mapping = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        # Through numpy, whose array holds a buffer export of the mapping (torch.frombuffer holds none): while
        # any view of it lives (parameters kept in the segment), `close` cannot unmap it under them; it is
        # unmapped when the last view goes.
        self.buffer = torch.from_numpy(np.frombuffer(self._mapping, dtype=np.uint8))
        try:
            self._mapping.madvise(_MADV_POPULATE_READ)
        except (OSError, ValueError):  # kernels before 5.14
            self.buffer[::mmap.PAGESIZE].sum()

    def views(self, message: rollout_pb2.SharedMemoryWeights) -> tuple[dict[str, torch.Tensor], int]:
        """name -> the view of each slot of `message`, and their bytes; ValueError naming the tensor on a slot that
        does not lie inside, or a name given twice. Kept per layout (the last `_LAYOUTS_KEPT`): a trainer sends the
        same layout push after push, and a view of a kept mapping shows whatever was written since."""
        key = message.SerializeToString(deterministic=True)
        cached = self._layouts.get(key)
        if cached is not None:
            self._layouts.move_to_end(key)
            return cached
        views: dict[str, torch.Tensor] = {}
        num_bytes = 0
        for slot in message.tensors:
            if slot.name in views:
                raise ValueError(f"tensor {slot.name!r}: sent twice in one update")
            view = views[slot.name] = _view(self.buffer, slot, f"segment {message.segment}")
            num_bytes += view.numel() * view.element_size()
        self._layouts[key] = (views, num_bytes)
        while len(self._layouts) > _LAYOUTS_KEPT:
            self._layouts.popitem(last=False)
        return views, num_bytes

    def close(self) -> None:
        self._layouts.clear()  # the views hold the mapping
        self.buffer = torch.empty(0, dtype=torch.uint8)
        with contextlib.suppress(BufferError):  # a view still alive: unmapped when the last one goes
            self._mapping.close()


class SegmentCache:
    """An engine's mappings of the trainer's latest segments, kept from one update to the next (at most `size`).

    In steady state the trainer alternates two segments (the one the engines run on and the one it writes; three
    when pushes go to different subsets of engines), so a segment comes back every other push. Mapped anew, its
    page tables are filled again, the main cost of a push on the engine's side and one that each engine of a host
    pays on its own; kept, a push only reads the new bytes through the same pages (the mapping is private and never
    written, so it sees the trainer's writes to the file). A segment is known by its name, inode and size: a new
    file under an old name is mapped anew. A segment the trainer released stays mapped until it falls out of the
    cache (at most `size` segments of memory held).
    """

    def __init__(self, size: int = 3) -> None:
        if size < 1:
            raise ValueError(f"size: at least 1, got {size}")
        self.size = size
        self._entries: OrderedDict[tuple[str, int, int], _MappedSegment] = OrderedDict()

    def get(self, message: rollout_pb2.SharedMemoryWeights, directory: Path) -> _MappedSegment:
        if not _SEGMENT_NAME.fullmatch(message.segment):
            raise ValueError(f"shared_memory.segment: {message.segment!r} is not an everstep weight segment name")
        try:
            stat = os.stat(directory / message.segment)
        except FileNotFoundError:
            stat = None  # _MappedSegment says why
        key = (message.segment, stat.st_ino, stat.st_size) if stat is not None else None
        segment = self._entries.pop(key, None) if key is not None else None
        if segment is None or segment.buffer.numel() != message.segment_bytes:
            segment = _MappedSegment(message, directory)
        if key is not None:
            self._entries[key] = segment
        while len(self._entries) > self.size:
            _, oldest = self._entries.popitem(last=False)
            oldest.close()
        return segment

    def __contains__(self, segment: _MappedSegment) -> bool:
        return any(s is segment for s in self._entries.values())

    def close(self) -> None:
        for segment in self._entries.values():
            segment.close()
        self._entries.clear()


class WeightUpdate:
    """Collects the buckets of one update; `tensors` is complete once a bucket with last=True was added.

    Raises ValueError, naming the field, on anything malformed. `close()` releases shared memory
    mappings and drops the tensors; call it when the update was applied or abandoned.
    """

    def __init__(self, *, engine_device: str = "cpu", group: WeightGroupMember | None = None,
                 shm_dir: Path = SHM_DIR, segments: SegmentCache | None = None) -> None:
        """`segments`: the engine's mappings kept between updates (None: each update maps and unmaps its own)."""
        self.engine_device = engine_device
        self.group = group
        self.shm_dir = shm_dir
        self.segment_cache = segments
        self.version: int | None = None
        self.transport: str | None = None
        self.tensors: dict[str, torch.Tensor] = {}
        self.num_bytes = 0
        self.complete = False
        self.engine_may_keep = False
        """Every bucket was shm with `engine_may_keep`: the engine may run on views into the segment."""
        self.lora: rollout_pb2.LoraAdapter | None = None
        """Set when the update is a LoRA adapter (its last bucket says so): `tensors` are its A and B."""
        self._partial: _PartialTensor | None = None
        self._segments: dict[str, _MappedSegment] = {}

    def add(self, bucket: rollout_pb2.WeightBucket) -> None:
        if self.complete:
            raise ValueError("bucket after the one with last=true")
        if self.version is None:
            self.version = bucket.version
        elif bucket.version != self.version:
            raise ValueError(f"version: bucket version {bucket.version} differs from this update's {self.version}")
        kind = self._carrier(bucket)
        if self._partial is not None and not bucket.HasField("chunk"):
            p = self._partial
            raise ValueError(f"chunk: tensor {p.name!r} stopped at byte {p.received} of {len(p.data)}")
        if bucket.tensors:
            for t in bucket.tensors:
                self._put(t.name, tensor_codec.from_proto(t))
        if bucket.HasField("chunk"):
            self._add_chunk(bucket.chunk)
        if bucket.HasField("shared_memory"):
            self._add_shared_memory(bucket.shared_memory)
        if bucket.HasField("collective"):
            self._add_collective(bucket.collective)
        for message in bucket.cuda_ipc:
            self._put(message.name, rebuild_cuda_ipc_tensor(message))
        if kind is not None:
            self.transport = kind
        if bucket.HasField("lora"):
            if not bucket.last:
                raise ValueError("lora: only the last bucket of an update says it is an adapter")
            self.lora = bucket.lora
        if bucket.last:
            self.complete = True
            self.transport = self.transport or "grpc"

    def close(self) -> None:
        self.tensors = {}
        self._partial = None
        for segment in self._segments.values():
            if self.segment_cache is None or segment not in self.segment_cache:
                segment.close()
        self._segments.clear()

    # -- carriers ---------------------------------------------------------------------------------------

    def _carrier(self, bucket: rollout_pb2.WeightBucket) -> str | None:
        kinds = [kind for kind, present in (
            ("grpc", bool(bucket.tensors) or bucket.HasField("chunk")),
            ("shm", bucket.HasField("shared_memory")),
            (self.group.backend if self.group else "collective", bucket.HasField("collective")),
            ("cuda_ipc", bool(bucket.cuda_ipc)),
        ) if present]
        if len(kinds) > 1:
            raise ValueError(f"bucket: carries data in several ways at once ({', '.join(kinds)})")
        kind = kinds[0] if kinds else None
        if kind is not None and self.transport is not None and kind != self.transport:
            raise ValueError(f"bucket: {kind} data in an update that started as {self.transport}")
        return kind

    def _put(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.tensors:
            raise ValueError(f"tensor {name!r}: sent twice in one update")
        self.tensors[name] = tensor
        self.num_bytes += tensor.numel() * tensor.element_size()

    def _add_chunk(self, chunk: rollout_pb2.TensorChunk) -> None:
        if self._partial is None:
            if chunk.offset != 0:
                raise ValueError(f"chunk: tensor {chunk.name!r} starts at byte {chunk.offset}, not 0")
            dtype, shape = tensor_codec.dtype_from_name(chunk.dtype, tensor=chunk.name), tuple(chunk.shape)
            size = tensor_codec.num_bytes(dtype, shape, tensor=chunk.name)
            self._partial = _PartialTensor(chunk.name, chunk.dtype, shape, np.empty(size, dtype=np.uint8))
        p = self._partial
        if (chunk.name, chunk.dtype, tuple(chunk.shape)) != (p.name, p.dtype, p.shape):
            raise ValueError(f"chunk: {chunk.name!r} arrived before tensor {p.name!r} was complete")
        end = chunk.offset + len(chunk.data)
        if chunk.offset != p.received or not chunk.data or end > len(p.data):
            raise ValueError(f"chunk: tensor {p.name!r} got bytes [{chunk.offset}, {end}) after {p.received} "
                             f"of {len(p.data)}")
        p.data[chunk.offset : end] = np.frombuffer(chunk.data, dtype=np.uint8)
        p.received = end
        if p.received == len(p.data):
            self._partial = None
            self._put(p.name, tensor_codec.from_bytes(memoryview(p.data), p.dtype, p.shape, tensor=p.name, copy=False))

    def _add_shared_memory(self, message: rollout_pb2.SharedMemoryWeights) -> None:
        first = not self._segments
        self.engine_may_keep = message.engine_may_keep and (first or self.engine_may_keep)
        segment = self._segments.get(message.segment)
        if segment is None:
            segment = (self.segment_cache.get(message, self.shm_dir) if self.segment_cache is not None
                       else _MappedSegment(message, self.shm_dir))
            self._segments[message.segment] = segment
        views, num_bytes = segment.views(message)
        if not self.tensors.keys().isdisjoint(views):
            twice = next(name for name in views if name in self.tensors)
            raise ValueError(f"tensor {twice!r}: sent twice in one update")
        self.tensors.update(views)
        self.num_bytes += num_bytes

    def _add_collective(self, message: rollout_pb2.CollectiveWeights) -> None:
        if self.group is None or message.group != self.group.name:
            joined = self.group.name if self.group else "none"
            raise ValueError(f"collective.group: {message.group!r} is not the group this engine joined ({joined})")
        if message.num_bytes < 0:
            raise ValueError(f"collective.num_bytes: must be >= 0, got {message.num_bytes}")
        flat = self.group.receive(message.num_bytes, self.engine_device)
        for slot in message.tensors:
            self._put(slot.name, _view(flat, slot, "broadcast buffer"))
