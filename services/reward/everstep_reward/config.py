"""Configuration of one reward process."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["RewardConfig"]


class RewardConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    host: str = Field("127.0.0.1", description="Address the gRPC server and /metrics bind to.")
    port: int = Field(9105, ge=0, le=65535, description="HTTP port of Prometheus /metrics.")
    grpc_port: int = Field(50054, ge=0, le=65535, description="gRPC port: everstep.v1.Reward and health.")
    sandbox_endpoint: str | None = Field(None, description="HOST:PORT of the sandbox gRPC API (code verifier).")
    math_workers: int = Field(default_factory=lambda: min(4, os.cpu_count() or 1), ge=1,
                              description="Worker processes for math verification.")
    worker_start_method: Literal["spawn", "forkserver"] = Field(
        "spawn", description="How math workers start (never fork: the server is multi-threaded).")
    timeout_seconds: float = Field(10.0, gt=0, description="Per-item limit of a math check, in seconds.")
    code_timeout_seconds: float = Field(60.0, gt=0, description="Limit of one sandbox RunTests call.")
    code_run_timeout_seconds: float = Field(5.0, gt=0, description="Sandbox run limit per test case.")
    max_concurrent_items: int = Field(64, ge=1, description="Items scored at once across all requests.")
    grpc_threads: int = Field(16, ge=1, description="gRPC handler threads (concurrent Score calls).")
