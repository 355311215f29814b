"""Reads an offline W&B run's `.wandb` file: the records wandb wrote, parsed with wandb's own record schema
(`wandb.proto.wandb_internal_pb2.Record`).

wandb >= 0.2x writes the file from its Go core and no longer ships a Python reader (0.19's
`wandb.sdk.internal.datastore`), so the framing is read here as that reader did: a 7-byte file header
(":W&B", magic 0xBEE1, version 0), then 32 KiB blocks of chunks, each with a 7-byte header (CRC-32 of its
type byte and data, length, type: full, first, middle, last); a block's tail shorter than a header is padding.
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_FILE_HEADER = struct.Struct("<4sHB")
_CHUNK_HEADER = struct.Struct("<IHB")
_BLOCK = 32768
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def read_records(path: Path) -> list[Any]:
    """Every record of the file, in order (wandb_internal_pb2.Record)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    ident, magic, version = _FILE_HEADER.unpack_from(data, 0)
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), f"{path}: not a W&B file ({ident!r}, {magic:#x})"
    records, pending, offset = [], b"", _FILE_HEADER.size
    while offset + _CHUNK_HEADER.size <= len(data):
        room = _BLOCK - offset % _BLOCK
        if room < _CHUNK_HEADER.size:  # the block's padding
            offset += room
            continue
        checksum, length, kind = _CHUNK_HEADER.unpack_from(data, offset)
        if kind == 0 and length == 0:  # the rest of a block never written
            offset += room
            continue
        chunk = data[offset + _CHUNK_HEADER.size: offset + _CHUNK_HEADER.size + length]
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF == checksum, f"{path}: bad CRC at {offset}"
        offset += _CHUNK_HEADER.size + length
        pending = chunk if kind in (_FULL, _FIRST) else pending + chunk
        if kind in (_FULL, _LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


@dataclass
class OfflineRun:
    run_id: str = ""
    project: str = ""
    config: dict[str, Any] = field(default_factory=dict)
    history: dict[int, dict[str, Any]] = field(default_factory=dict)
    """_step -> the row's values (JSON-decoded), merged across the records of that step."""
    exit_code: int | None = None


def read_offline_run(path: Path) -> OfflineRun:
    run = OfflineRun()
    for record in read_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run.run_id, run.project = record.run.run_id, record.run.project
            run.config.update({item.key: json.loads(item.value_json) for item in record.run.config.update})
        elif kind == "config":
            run.config.update({item.key: json.loads(item.value_json) for item in record.config.update})
        elif kind == "history":
            row = {item.key or ".".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            step = row.pop("_step", record.history.step.num)
            run.history.setdefault(int(step), {}).update(row)
        elif kind == "exit":
            run.exit_code = record.exit.exit_code
    return run
