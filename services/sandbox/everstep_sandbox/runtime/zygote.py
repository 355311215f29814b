"""The sandbox slot's resident process (the "zygote"): runs inside the slot's namespaces, forks one
child per command, and resets the slot between requests.

It is started once per slot by the server (inside bubblewrap when available), imports what
Python programs commonly import, then serves length-prefixed JSON frames on stdin/stdout:

- `init`: seccomp filter (hex), uid to drop to, cgroup `cgroup.procs` fds, work and tmp dirs.
  The zygote joins the slot's cgroups and takes no_new_privs and the seccomp filter itself, once:
  every child inherits all three at fork, which is far cheaper than a cgroup migration and a
  filter compilation per run (the filter denies nothing the zygote needs).
- `write`: files into the work dir (base64, with mode bits).
- `exec`: fork; the child takes rlimits, memfds as stdin/stdout/stderr and drops to the run uid,
  then execs the command, or for `python_inline` runs the program in this pre-initialised
  interpreter (the warm pool: no interpreter start-up per run). The parent waits with a
  wall-clock timeout, then kills every process of the run.
- `collect`: files of the work dir matching glob patterns (compile artifacts).
- `mkdirs`: the parent directories of paths the run may write (absolute fetch_files).
- `fetch`: regular files at given paths (fetch_files), never through a symlink.
- `reset`: kill every leftover process, wipe the work and tmp dirs and remove what `write` and
  `mkdirs` created elsewhere in the slot's root (absolute paths).
- `batch`: several of the above in one round trip.

Standard library only, no everstep imports: this file is bind-mounted alone into the sandbox.
It trusts the server (its only peer) and never the program it runs.
"""

from __future__ import annotations

# Preloaded for Python programs (forked children find them already imported). Never `random`,
# `threading` or `logging` (nor `statistics`, `tempfile`, which import random): each registers an
# at-fork hook that runs Python code in every child, and those hooks touched (copied on write) more
# pages than the run itself: about 1.7 ms of CPU per run on a 2-core VM. A run that imports them
# gets a fresh module (random then seeds itself from os.urandom). tests/sandbox/test_zygote.py
# checks this.
import array  # noqa: F401
import base64
import bisect  # noqa: F401
import builtins
import collections  # noqa: F401
import contextlib
import copy  # noqa: F401
import ctypes
import dataclasses  # noqa: F401
import decimal  # noqa: F401
import fractions  # noqa: F401
import functools  # noqa: F401
import gc
import glob
import heapq  # noqa: F401
import io
import itertools  # noqa: F401
import json
import math  # noqa: F401
import operator  # noqa: F401
import os
import re  # noqa: F401
import resource
import select
import shutil
import signal
import stat
import string  # noqa: F401
import struct
import sys
import time
import traceback
import types
import typing  # noqa: F401

_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_SECCOMP = 22
_PR_SET_CHILD_SUBREAPER = 36
_PR_SET_PDEATHSIG = 1
_SECCOMP_MODE_FILTER = 2
_HEADER = struct.Struct("!I")
_DIAGNOSTICS: io.TextIOWrapper | None = None

_libc = ctypes.CDLL(None, use_errno=True)


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


class Zygote:
    def __init__(self, channel_in: io.BufferedReader, channel_out: io.BufferedWriter) -> None:
        self._in = channel_in
        self._out = channel_out
        self._run_uid: int | None = None
        self._work_dir = "/work"
        self._tmp_dir = "/tmp"
        self._extra_wipe: list[str] = []
        self._pid_namespace = True
        self._python_env: dict | None = None
        """The environment of Python runs, kept in this process's os.environ (see _op_exec)."""
        self._python_streams = _python_streams()
        self._created: list[str] = []
        """Top directories (or files) made outside the work and tmp dirs for absolute paths; removed at reset."""

    # -- protocol -----------------------------------------------------------------------------
    def serve(self) -> None:
        while True:
            header = self._in.read(_HEADER.size)
            if len(header) < _HEADER.size:
                return
            (length,) = _HEADER.unpack(header)
            request = json.loads(self._in.read(length))
            try:
                reply = getattr(self, "_op_" + request["op"])(request)
            except Exception as e:  # reported to the server, which restarts the slot
                reply = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
            data = json.dumps(reply).encode()
            self._out.write(_HEADER.pack(len(data)) + data)
            self._out.flush()

    def _op_init(self, request: dict) -> dict:
        self._run_uid = request["run_uid"]
        self._work_dir = request["work_dir"]
        self._tmp_dir = request["tmp_dir"]
        self._extra_wipe = list(request["extra_wipe"])
        self._pid_namespace = request["pid_namespace"]
        for path in (self._work_dir, self._tmp_dir):
            os.makedirs(path, exist_ok=True)
            if self._run_uid is not None:
                os.chown(path, self._run_uid, self._run_uid)
            os.chmod(path, 0o700)
        if self._pid_namespace and _libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")  # see _kill_all
        for fd in request["cgroup_fds"]:
            os.write(fd, b"0")  # this process joins the slot's cgroup; its children start inside it
            os.close(fd)  # no child inherits the fd
        if _libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
        seccomp = bytes.fromhex(request["seccomp_hex"])
        if seccomp:
            _install_seccomp(seccomp)
        return {"ok": True, "pid": os.getpid()}

    def _op_batch(self, request: dict) -> dict:
        """Several steps in one round trip (the server queues reset and write until it needs a reply)."""
        return {"results": [getattr(self, "_op_" + step["op"])(step) for step in request["steps"]]}

    def _op_write(self, request: dict) -> dict:
        for entry in request["files"]:
            target = self._target(entry["path"])
            self._make_dirs(os.path.dirname(target))
            if os.path.lexists(target) and not stat.S_ISREG(os.lstat(target).st_mode):
                raise ValueError(f"path {entry['path']!r} exists and is not a regular file")
            if not self._under_private_dirs(target) and not os.path.lexists(target):
                self._created.append(target)
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            with open(fd, "wb") as f:
                f.write(base64.b64decode(entry["content"]))
            os.chmod(target, entry.get("mode", 0o644))
            if self._run_uid is not None:
                os.chown(target, self._run_uid, self._run_uid)
        return {"ok": True}

    def _op_mkdirs(self, request: dict) -> dict:
        for path in request["paths"]:
            self._make_dirs(os.path.dirname(self._target(path)))
        return {"ok": True}

    def _op_fetch(self, request: dict) -> dict:
        files = {}
        for name, path in request["paths"].items():
            content = _read_regular_file(self._target(path), request["max_bytes"])
            if content is not None and self._fetchable(self._target(path)):
                files[name] = base64.b64encode(content).decode()
        return {"files": files}

    def _op_collect(self, request: dict) -> dict:
        files = []
        limit = request["max_bytes"]
        for pattern in request["patterns"]:
            for path in sorted(glob.glob(os.path.join(self._work_dir, pattern))):
                real = os.path.realpath(path)
                if not real.startswith(os.path.realpath(self._work_dir) + os.sep) or not os.path.isfile(real):
                    continue  # a symlink out of the work dir, or a directory
                with open(real, "rb") as f:
                    content = f.read(limit + 1)
                if len(content) > limit:
                    continue
                files.append({"path": os.path.relpath(path, self._work_dir),
                              "content": base64.b64encode(content).decode(),
                              "mode": stat.S_IMODE(os.stat(real).st_mode)})
        return {"files": files}

    def _op_reset(self, request: dict) -> dict:
        self._kill_all()
        for directory in (self._work_dir, self._tmp_dir, *self._extra_wipe):
            _wipe(directory)
        for path in reversed(self._created):
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            elif os.path.lexists(path):
                os.unlink(path)
        self._created = []
        return {"ok": True}

    def _op_exec(self, request: dict) -> dict:
        # Everything the child needs is computed here, before the fork: a page the child writes is a
        # page copied (a fault of several microseconds on a VM), one it only reads is free.
        rlimits = self._rlimits(request["limits"])
        if request["python_inline"] and request["env"] != self._python_env:
            # Python runs of a slot share one environment: set it here once, not in every child.
            os.environ.clear()
            os.environ.update(request["env"])
            self._python_env = dict(request["env"])
        stdin_fd = os.memfd_create("stdin", 0)
        os.write(stdin_fd, base64.b64decode(request["stdin"]))
        os.lseek(stdin_fd, 0, os.SEEK_SET)
        stdout_fd = os.memfd_create("stdout", 0)
        stderr_fd = os.memfd_create("stderr", 0)
        start = time.monotonic()
        pid = os.fork()
        if pid == 0:  # child: never returns
            self._child(request, rlimits, stdin_fd, stdout_fd, stderr_fd)
        for fd in (stdin_fd,):
            os.close(fd)
        timed_out = False
        pidfd = os.pidfd_open(pid)
        try:
            ready, _, _ = select.select([pidfd], [], [], request["timeout_seconds"])
            if not ready:
                timed_out = True
                _signal(pid, signal.SIGKILL)
        finally:
            os.close(pidfd)
        _, wait_status, usage = os.wait4(pid, 0)
        elapsed = time.monotonic() - start
        _signal(-pid, signal.SIGKILL)  # the run's process group (children that did not setsid)
        self._kill_all()
        max_output = request["max_output_bytes"]
        reply = {
            "timed_out": timed_out,
            "exit_code": os.waitstatus_to_exitcode(wait_status),
            "execution_time": elapsed,
            "stdout": _read_capped(stdout_fd, max_output),
            "stderr": _read_capped(stderr_fd, max_output),
            "max_rss_kb": usage.ru_maxrss,
        }
        os.close(stdout_fd)
        os.close(stderr_fd)
        return reply

    # -- the child ----------------------------------------------------------------------------
    def _child(self, request: dict, rlimits: list[tuple[int, tuple[int, int]]], stdin_fd: int, stdout_fd: int,
               stderr_fd: int) -> None:
        code = 127
        try:
            os.setsid()
            os.dup2(stdin_fd, 0)
            os.dup2(stdout_fd, 1)
            os.dup2(stderr_fd, 2)
            os.closerange(3, 65536)
            os.chdir(self._work_dir)
            for which, limit in rlimits:
                resource.setrlimit(which, limit)
            if self._run_uid is not None:
                os.setgroups([])
                os.setresgid(self._run_uid, self._run_uid, self._run_uid)
                os.setresuid(self._run_uid, self._run_uid, self._run_uid)
            if not self._pid_namespace:
                # No PID namespace to end with the zygote: the run dies with it (set after the uid
                # change, which clears a parent-death signal).
                _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            # The cgroups, no_new_privs and the seccomp filter came with the fork (see _op_init).
            if request["python_inline"]:
                code = _run_python(request["argv"][-1], self._work_dir, self._python_streams)
            else:
                for signum in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGCHLD, signal.SIGINT, signal.SIGTERM):
                    signal.signal(signum, signal.SIG_DFL)
                argv = request["argv"]
                os.execvpe(argv[0], argv, request["env"])
        except BaseException as e:  # noqa: BLE001 - report anything on the program's stderr
            with contextlib.suppress(OSError):
                os.write(2, f"sandbox: could not start the program: {e}\n".encode())
        os._exit(code)

    # -- helpers ------------------------------------------------------------------------------
    def _rlimits(self, limits: dict) -> list[tuple[int, tuple[int, int]]]:
        """The rlimits of a run as (resource, (soft, hard)), within this process's hard limits."""
        wanted = [(resource.RLIMIT_CPU, limits["cpu_seconds"], limits["cpu_seconds"] + 1),
                  (resource.RLIMIT_FSIZE, limits["file_size_bytes"], limits["file_size_bytes"]),
                  (resource.RLIMIT_CORE, 0, 0)]
        if limits.get("address_space_bytes"):
            wanted.append((resource.RLIMIT_AS, limits["address_space_bytes"], limits["address_space_bytes"]))
        if limits.get("max_processes") and self._run_uid is not None:
            wanted.append((resource.RLIMIT_NPROC, limits["max_processes"], limits["max_processes"]))
        result = []
        for which, soft, hard in wanted:
            _, current_hard = resource.getrlimit(which)
            if current_hard != resource.RLIM_INFINITY:  # cannot raise a hard limit (no CAP_SYS_RESOURCE)
                soft, hard = min(soft, current_hard), min(hard, current_hard)
            result.append((which, (soft, hard)))
        return result

    def _target(self, path: str) -> str:
        """The path in this slot: relative ones in the work dir. The server has checked it (no `..`,
        nothing under the system mounts); symlinks are refused where the file is written or read."""
        target = os.path.normpath(os.path.join(self._work_dir, path))
        if ".." in path.split("/") or not target.startswith("/") or target == "/":
            raise ValueError(f"path {path!r} is not allowed")
        return target

    def _under_private_dirs(self, path: str) -> bool:
        return any(path == d or path.startswith(d.rstrip("/") + "/") for d in (self._work_dir, self._tmp_dir))

    def _fetchable(self, path: str) -> bool:
        """Inside the work or tmp dir, or under what this request made for its absolute paths."""
        return self._under_private_dirs(path) or any(path == c or path.startswith(c + "/") for c in self._created)

    def _make_dirs(self, directory: str) -> None:
        """Creates `directory` and its missing parents (owned by the run uid), refusing any component that
        is a symlink or not a directory, so nothing a path names can lead out of the slot's own files."""
        current = "/"
        for part in [p for p in directory.split("/") if p]:
            current = os.path.join(current, part)
            try:
                mode = os.lstat(current).st_mode
            except FileNotFoundError:
                os.mkdir(current, 0o755)
                if not self._under_private_dirs(current):
                    self._created.append(current)
                if self._run_uid is not None:
                    os.chown(current, self._run_uid, self._run_uid)
                continue
            if not stat.S_ISDIR(mode):
                raise ValueError(f"{current!r} is a symlink or not a directory")

    def _kill_all(self) -> None:
        """SIGKILLs every process of the slot but this one and the namespace's init, and waits until all
        are gone. kill(-1) reaches exactly those in a PID namespace; as the child subreaper this
        process inherits every orphan, so once it has no child left no process of a run is left."""
        if not self._pid_namespace:
            return  # without a PID namespace the server kills the run's cgroup or process group
        _signal(-1, signal.SIGKILL)
        while True:
            try:
                os.waitpid(-1, 0)  # SIGKILL cannot be caught: this returns once each is dead
            except ChildProcessError:
                return


def _python_streams() -> tuple[io.TextIOWrapper, io.TextIOWrapper, io.TextIOWrapper]:
    """sys.stdin, sys.stdout and sys.stderr of Python runs, made once and never used here: each forked
    run gets them as new (on its own fds 0, 1 and 2, memfds like the /dev/null they see here: both
    seekable, neither a terminal), for far fewer copied pages than opening them in every run."""
    return (open(0, encoding="utf-8", errors="surrogateescape", closefd=False),  # noqa: SIM115
            open(1, "w", encoding="utf-8", errors="surrogateescape", closefd=False),  # noqa: SIM115
            open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False, buffering=1))  # noqa: SIM115


def _run_python(path: str, work_dir: str,
                streams: tuple[io.TextIOWrapper, io.TextIOWrapper, io.TextIOWrapper]) -> int:
    """Runs a Python program (`path`, relative to the work dir, the current directory) in this (forked)
    interpreter, as `python path` would; os.environ is already the run's."""
    if "random" in sys.modules:  # never preloaded (see the imports); reseed should that change
        sys.modules["random"].seed()
    sys.argv = [path]
    sys.path.insert(0, os.path.dirname(os.path.join(work_dir, path)))
    sys.stdin, sys.stdout, sys.stderr = streams
    code = 0
    try:
        # What `python path` does, minus runpy's per-call imports: a fresh __main__ module.
        with open(path, "rb") as f:
            program = compile(f.read(), path, "exec")
        main_module = types.ModuleType("__main__")
        main_module.__file__ = path
        main_module.__builtins__ = builtins  # type: ignore[attr-defined]
        sys.modules["__main__"] = main_module
        exec(program, main_module.__dict__)
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - a traceback, as the interpreter prints it
        traceback.print_exc()
        code = 1
    with contextlib.suppress(BaseException):
        if "threading" in sys.modules:  # the program imported it: join non-daemon threads, as at exit
            sys.modules["threading"]._shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # noqa: BLE001 - e.g. EFBIG when the output limit was hit
            code = code or 1
    return code & 0xFF


def _install_seccomp(program: bytes) -> None:
    buffer = ctypes.create_string_buffer(program)
    fprog = _SockFprog(len(program) // 8, ctypes.cast(buffer, ctypes.c_void_p))
    if _libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP)")


def _signal(pid: int, signum: int) -> None:
    """Sends a signal to a process (with a negative pid, its process group; with -1, every process this
    one may signal but itself and the PID namespace's init)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signum)


def _read_regular_file(path: str, max_bytes: int) -> bytes | None:
    """The content of a regular file reached without following any symlink, or None (missing, a
    symlink or a directory on the way, or larger than max_bytes)."""
    current = "/"
    parts = [p for p in path.split("/") if p]
    try:
        for part in parts[:-1]:
            current = os.path.join(current, part)
            if not stat.S_ISDIR(os.lstat(current).st_mode):
                return None
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    with open(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return None
        content = f.read(max_bytes + 1)
    return content if len(content) <= max_bytes else None


def _read_capped(fd: int, max_bytes: int) -> dict:
    size = os.fstat(fd).st_size
    data = os.pread(fd, max_bytes, 0)
    return {"data": base64.b64encode(data).decode(), "truncated": size > max_bytes, "size": size}


def _wipe(directory: str) -> None:
    try:
        entries = os.listdir(directory)
    except FileNotFoundError:
        return
    for name in entries:
        path = os.path.join(directory, name)
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.unlink(path)
        except OSError:
            pass


def main() -> None:
    # The channel is stdin/stdout; fds 0, 1 and 2 are re-pointed to /dev/null so nothing else writes
    # there (and the runs' std streams are made on them, see _python_streams); this process's own
    # tracebacks still reach the server's stderr through a copy of fd 2, closed in every run.
    channel_in = os.fdopen(os.dup(0), "rb")
    channel_out = os.fdopen(os.dup(1), "wb")
    global _DIAGNOSTICS
    # A module-level reference, so replacing sys.stderr in a run never finalises it (copying pages).
    _DIAGNOSTICS = sys.stderr = open(os.dup(2), "w", buffering=1)  # noqa: SIM115
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    # Die with the parent (the server, or bubblewrap): the server forks slots from a thread that lives
    # as long as it does, so this fires when the server dies, SIGKILL included.
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    # Forked runs share this interpreter's pages copy-on-write; a garbage collection in a run would
    # touch (and so copy) every tracked object. Frozen objects are never scanned.
    gc.collect()
    gc.freeze()
    Zygote(channel_in, channel_out).serve()


if __name__ == "__main__":
    main()
