"""Configuration of one sandbox process."""

from __future__ import annotations

import os
import sys

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["SandboxConfig"]


class SandboxConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    host: str = Field("127.0.0.1", description="Address the HTTP and gRPC servers bind to.")
    port: int = Field(8080, ge=0, le=65535, description="HTTP port: SandboxFusion API, /metrics, /healthz.")
    grpc_port: int = Field(50055, ge=0, le=65535, description="gRPC port: everstep.v1.Sandbox and health.")
    workers: int = Field(default_factory=lambda: os.cpu_count() or 1, ge=1,
                         description="Commands (compile or run) executing at once; the rest wait in a queue.")
    grpc_threads: int = Field(32, ge=1, description="gRPC handler threads (requests beyond `workers` queue).")
    default_compile_timeout_seconds: float = Field(10.0, gt=0, description="Used when a request gives 0.")
    default_run_timeout_seconds: float = Field(10.0, gt=0, description="Used when a request gives 0.")
    max_timeout_seconds: float = Field(120.0, gt=0, description="Requests asking for longer are rejected.")
    default_memory_limit_mb: int = Field(1024, ge=16,
                                         description="RLIMIT_AS in MiB when a request gives <= 0.")
    max_output_bytes: int = Field(1 << 20, ge=1024, description="stdout/stderr kept per command; rest dropped.")
    max_file_size_bytes: int = Field(64 << 20, ge=1024, description="RLIMIT_FSIZE of every command.")
    max_processes: int = Field(512, ge=8, description="RLIMIT_NPROC of runs (per user; not enforced for root).")
    python_executable: str = Field(default_factory=lambda: sys.executable,
                                   description="Interpreter for language `python`.")
    work_root: str | None = Field(None, description="Parent of the per-request work dirs (system temp if None).")
