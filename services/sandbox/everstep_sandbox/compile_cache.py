"""Compile cache: what a successful compile produced, keyed by a hash of everything that went in
(language, compiler command and flags, source, extra files).

One file per entry on disk (written to a temporary name, then renamed) so that the worker
processes of one host share it, plus a small in-memory front. Only successful compiles are kept.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from everstep_sandbox.process import CommandResult, CommandRunStatus

__all__ = ["CompileCache", "CompiledProgram", "cache_key"]

log = logging.getLogger(__name__)
_MEMORY_ENTRIES = 256
_EVICT_EVERY = 64


@dataclass(frozen=True)
class CompiledProgram:
    artifacts: dict[str, tuple[bytes, int]]
    """Work-dir path → (content, mode)."""
    compile_result: CommandResult


def cache_key(language: str, compile_argv: Sequence[str], source_file: str, code: str,
              files: Mapping[str, bytes]) -> str:
    digest = hashlib.sha256()
    header = {"language": language, "argv": list(compile_argv), "source_file": source_file,
              "files": sorted((path, hashlib.sha256(content).hexdigest()) for path, content in files.items())}
    digest.update(json.dumps(header, sort_keys=True).encode())
    digest.update(b"\0")
    digest.update(code.encode())
    return digest.hexdigest()


class CompileCache:
    def __init__(self, directory: str, max_entries: int) -> None:
        self._dir = Path(directory)
        self._max_entries = max_entries
        self._memory: OrderedDict[str, CompiledProgram] = OrderedDict()
        self._lock = threading.Lock()
        self._num_puts = 0
        if max_entries:
            self._dir.mkdir(parents=True, exist_ok=True, mode=0o700)

    def get(self, key: str) -> CompiledProgram | None:
        if not self._max_entries:
            return None
        with self._lock:
            if key in self._memory:
                self._memory.move_to_end(key)
                return self._memory[key]
        try:
            entry = json.loads((self._dir / f"{key}.json").read_text())
            program = CompiledProgram(
                {p: (base64.b64decode(c), m) for p, (c, m) in entry["artifacts"].items()},
                CommandResult(CommandRunStatus(entry["status"]), entry["execution_time"], entry["return_code"],
                              entry["stdout"], entry["stderr"]))
        except (OSError, ValueError, KeyError):
            return None
        self._remember(key, program)
        return program

    def put(self, key: str, program: CompiledProgram) -> None:
        if not self._max_entries:
            return
        result = program.compile_result
        entry = {"artifacts": {p: (base64.b64encode(c).decode(), m) for p, (c, m) in program.artifacts.items()},
                 "status": result.status.value, "execution_time": result.execution_time,
                 "return_code": result.return_code, "stdout": result.stdout, "stderr": result.stderr}
        target = self._dir / f"{key}.json"
        partial = target.with_suffix(f".{os.getpid()}.{threading.get_ident()}.part")
        try:
            partial.write_text(json.dumps(entry))
            partial.replace(target)
        except OSError as e:
            log.warning("compile cache write failed: %s", e)
            with contextlib.suppress(OSError):
                partial.unlink()
        self._remember(key, program)
        self._num_puts += 1
        if self._num_puts % _EVICT_EVERY == 0:
            self._evict()

    def _remember(self, key: str, program: CompiledProgram) -> None:
        with self._lock:
            self._memory[key] = program
            self._memory.move_to_end(key)
            while len(self._memory) > min(_MEMORY_ENTRIES, self._max_entries):
                self._memory.popitem(last=False)

    def _evict(self) -> None:
        """Drops the least recently written entries beyond `max_entries`."""
        try:
            entries = sorted(self._dir.glob("*.json"), key=lambda p: p.stat().st_mtime)
        except OSError:
            return
        for path in entries[:max(0, len(entries) - self._max_entries)]:
            with contextlib.suppress(OSError):
                path.unlink()
