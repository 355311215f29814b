"""Where a request's `files` and `fetch_files` paths land inside a run's own file system.

A relative path is relative to the work dir (`/work`). An absolute path (SandboxFusion accepts
them, e.g. `/mnt/data/input.txt`) is the same path inside the slot's private root, which is a
tmpfs of its mount namespace that only the slot's zygote may write: the zygote creates the missing
directories (owned by the run's uid), and wipes them at the slot's reset. Absolute paths need that
private root and a run uid other than the zygote's (bubblewrap as root); elsewhere only `/work/...`
and `/tmp/...` are accepted. Never accepted: `..` components, NUL, the root itself, and anything
under the read-only system mounts (`/usr`, `/etc`, `/proc`, `/dev`, ...). Symlinks cannot lead
out either: the zygote refuses a symlink in any component when it writes or fetches a file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePosixPath

__all__ = ["SYSTEM_PREFIXES", "PathPolicy", "PathRefused"]

SYSTEM_PREFIXES = ("/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/proc", "/dev",
                   "/sys", "/opt/everstep-sandbox")
"""The slot's read-only (or kernel) mounts: no request file may go there."""
_PRIVATE_DIRS = ("/work", "/tmp")


class PathRefused(ValueError):
    """A file path a request may not use; the message names it and says why."""


@dataclass(frozen=True)
class PathPolicy:
    private_root: bool
    """Absolute paths anywhere outside the system mounts (bubblewrap as root); else /work and /tmp only."""
    mount_namespace: bool
    """The run sees /work and /tmp at those paths (bubblewrap); without it no absolute path maps."""
    extra_system_prefixes: tuple[str, ...] = ()
    """More read-only mounts of this host (the slot's Python prefix when outside /usr)."""

    def check(self, path: str, field: str) -> str:
        """The normalised path (relative to the work dir, or absolute in the run's root), or PathRefused."""
        if not path or "\0" in path:
            raise PathRefused(f"{field}: path {path!r} is empty or contains NUL")
        pure = PurePosixPath(path)
        if ".." in pure.parts:
            raise PathRefused(f"{field}: path {path!r} must not contain '..'")
        if not pure.is_absolute():
            return str(pure)
        normal = str(pure)
        if not self.mount_namespace:
            self._refuse(path, field, "absolute paths need the sandbox's mount namespace (bubblewrap), which "
                                      "this host does not give; use a path relative to the work dir")
        if normal in ("/", *_PRIVATE_DIRS):
            self._refuse(path, field, "a directory")
        if normal.startswith("/work/"):
            return str(pure.relative_to("/work"))
        if normal in ("/", *_PRIVATE_DIRS):
            self._refuse(path, field, "a directory")
        if any(normal == p or normal.startswith(p + "/") for p in (*SYSTEM_PREFIXES, *self.extra_system_prefixes)):
            self._refuse(path, field, "under a read-only system directory of the sandbox")
        if not self.private_root and not normal.startswith("/tmp/"):
            self._refuse(path, field, "outside /work and /tmp, absolute paths need a run uid of their own "
                                      "(the server running as root)")
        return normal

    @staticmethod
    def _refuse(path: str, field: str, why: str) -> str:
        raise PathRefused(f"{field}: path {path!r} is refused: {why}")
