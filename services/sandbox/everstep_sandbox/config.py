"""Configuration of one sandbox process."""

from __future__ import annotations

import os
import sys
import tempfile
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["SandboxConfig", "default_python"]


def default_python() -> str:
    """The interpreter of Python runs: the system one (it lives in /usr, visible in the sandbox)."""
    return "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable


class SandboxConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    host: str = Field("127.0.0.1", description="Address the HTTP and gRPC servers bind to.")
    port: int = Field(8080, ge=0, le=65535, description="HTTP port: SandboxFusion API, /metrics, /healthz.")
    grpc_port: int = Field(50055, ge=0, le=65535, description="gRPC port: everstep.v1.Sandbox and health.")
    workers: int = Field(default_factory=lambda: os.cpu_count() or 1, ge=1,
                         description="Base sandbox slots of this process, started at once (more, up to "
                                     "max_slots, on demand).")
    processes: int = Field(1, ge=1, description="Worker processes accepting on the first one's HTTP socket, "
                                               "each with its own slots (gRPC: the first process only).")
    slot_offset: int = Field(0, ge=0, description="Index of this process's first slot (uids and cgroups of "
                                                  "worker processes must not collide: k * max_slots).")
    max_slots: int | None = Field(
        128, ge=1, description="Slots this process may run at once: beyond `workers`, elastic slots are started "
                               "on demand (each run is wall-clock limited, they share the CPU) and stopped when "
                               "idle. None or <= workers: no elastic slots.")
    max_queue_wait_seconds: float = Field(10.0, ge=0, description="How long a request waits when all max_slots "
                                                                  "are busy before it is answered 'busy'.")
    elastic_after_seconds: float = Field(0.25, ge=0, description="How long a request waits for a free slot "
                                                                 "before it starts an elastic one.")
    elastic_idle_seconds: float = Field(30.0, gt=0, description="An elastic slot unused this long is stopped.")
    shutdown_grace_seconds: float = Field(3.0, ge=0, description="On SIGTERM, how long running requests may "
                                                                 "go on before their runs are killed.")
    grpc_threads: int = Field(32, ge=1, description="gRPC handler threads (gRPC requests beyond them wait in "
                                                    "gRPC's own queue).")
    isolation: Literal["auto", "bubblewrap", "none"] = Field(
        "auto", description="auto: bubblewrap when it works here, else a logged fallback; bubblewrap: "
                            "fail to start without it; none: no namespaces (trusted code only).")
    allow_no_seccomp: bool = Field(
        False, description="Start even when no seccomp filter can be installed (libseccomp missing, or the kernel "
                           "refuses it); runs then go without one, which /v1/isolation and /metrics say. Off: "
                           "such a sandbox refuses to start.")
    default_compile_timeout_seconds: float = Field(10.0, gt=0, description="Used when a request gives 0.")
    default_run_timeout_seconds: float = Field(10.0, gt=0, description="Used when a request gives 0.")
    max_timeout_seconds: float = Field(1800.0, gt=0, description="Longest compile_timeout or run_timeout a "
                                                                 "request may ask for; longer is a 422.")
    default_memory_limit_mb: int | None = Field(
        None, ge=16, description="Memory limit of a run when a request gives <= 0 (SandboxFusion's -1: no "
                                 "per-run limit); None: the slot's ceiling, max_memory_limit_mb.")
    max_memory_limit_mb: int = Field(8192, ge=16, description="The slot's memory ceiling (its cgroup limit): "
                                                              "requests asking for more are rejected.")
    compile_memory_limit_mb: int = Field(2048, ge=64, description="Memory limit of a compile.")
    max_output_bytes: int = Field(1 << 20, ge=1024, description="stdout/stderr kept per command; rest dropped.")
    max_file_size_bytes: int = Field(16 << 20, ge=1024,
                                     description="RLIMIT_FSIZE of every command (also stops output floods).")
    max_processes: int = Field(128, ge=8, description="Processes and threads of one run (pids cgroup and "
                                                      "RLIMIT_NPROC of the slot's uid).")
    cpu_cores_per_run: float = Field(1.0, gt=0, description="CPU quota of one command (cgroup cpu).")
    work_dir_size_mb: int = Field(256, ge=8, description="Size of each slot's private /work and /tmp tmpfs.")
    base_uid: int = Field(61000, ge=1000, description="Slot i runs programs as uid base_uid + i (when root).")
    max_requests_per_slot: int = Field(5000, ge=1, description="A slot's zygote is replaced after this many.")
    python_executable: str = Field(default_factory=default_python,
                                   description="Interpreter of language `python` (and of the slots' zygotes).")
    work_root: str = Field(default_factory=tempfile.gettempdir,
                           description="Host dir for slot dirs when there is no mount namespace.")
    compile_cache_dir: str = Field(default_factory=lambda: os.path.join(tempfile.gettempdir(),
                                                                        "everstep-sandbox-compile-cache"),
                                   description="Compile cache on disk (shared by worker processes).")
    compile_cache_entries: int = Field(2048, ge=0, description="Compiled programs kept; 0 disables the cache.")
