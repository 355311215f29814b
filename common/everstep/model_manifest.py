"""A built model folder's record of itself: build.json (how it was built, the sha256 of every file).

The trainer's demo build writes it; the controller's `everstep demo` checks it before a job uses the
folder, so a shipped model that was changed, or only partly checked out, fails by name instead of
training on something else. Plain JSON and hashlib: no torch.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["MANIFEST_NAME", "FileRecord", "ModelManifest", "file_records", "read_manifest", "verify_manifest",
           "write_manifest"]

MANIFEST_NAME = "build.json"
"""The manifest's file name inside the model folder (never listed in its own `files`)."""


@dataclass(frozen=True, kw_only=True)
class FileRecord:
    """One file of the folder as built."""

    sha256: str
    """Hex digest of its bytes."""
    num_bytes: int
    """Its size."""


@dataclass(frozen=True, kw_only=True)
class ModelManifest:
    """What build.json holds."""

    command: str
    """The shell command that rebuilds the folder (run from the repository root)."""
    settings: dict[str, Any]
    """The build's full configuration, as the builder's config class serialises it."""
    environment: dict[str, str]
    """Versions and settings that can change the weights (python, torch, transformers, threads)."""
    files: dict[str, FileRecord] = field(default_factory=dict)
    """Every other file of the folder, by name."""


def file_records(folder: Path) -> dict[str, FileRecord]:
    """The digest and size of each plain file in ``folder`` (not its subfolders, not the manifest)."""
    return {path.name: FileRecord(sha256=hashlib.sha256(path.read_bytes()).hexdigest(),
                                  num_bytes=path.stat().st_size)
            for path in sorted(Path(folder).iterdir()) if path.is_file() and path.name != MANIFEST_NAME}


def write_manifest(folder: Path, *, command: str, settings: dict[str, Any],
                   environment: dict[str, str]) -> ModelManifest:
    """Record ``folder``'s files as they are now; call it last, once every other file is written."""
    manifest = ModelManifest(command=command, settings=settings, environment=environment,
                             files=file_records(folder))
    (Path(folder) / MANIFEST_NAME).write_text(json.dumps(asdict(manifest), indent=2) + "\n")
    return manifest


def read_manifest(folder: Path) -> ModelManifest | None:
    """``folder``'s manifest, or None when it has none; a malformed one raises ValueError."""
    path = Path(folder) / MANIFEST_NAME
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text())
        files = {name: FileRecord(**record) for name, record in raw.pop("files").items()}
        return ModelManifest(**raw, files=files)
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise ValueError(f"{path} is not a model manifest: {error}") from error


def verify_manifest(folder: Path) -> ModelManifest:
    """``folder``'s manifest, once every file it lists is present with the recorded size and sha256.

    Raises FileNotFoundError without a manifest, ValueError naming each file that is missing or differs.
    Files the manifest does not list are allowed (a folder may gain, say, a README).
    """
    manifest = read_manifest(folder)
    if manifest is None:
        raise FileNotFoundError(f"{Path(folder) / MANIFEST_NAME} does not exist")
    actual = file_records(folder)
    problems = [f"{name} is missing" if name not in actual else f"{name} differs from its recorded sha256"
                for name, record in manifest.files.items() if actual.get(name) != record]
    if problems:
        raise ValueError(f"{folder} is not the model its {MANIFEST_NAME} records: {'; '.join(problems)}")
    return manifest
