"""Configuration of one reward process."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from everstep_reward.verifiers.code import CodeRewardMode
from everstep_reward.verifiers.length import LengthUnit

__all__ = ["DEFAULT_FUNCTION_IMPORTS", "RewardConfig"]

DEFAULT_FUNCTION_IMPORTS = (
    "math_verify", "sympy", "numpy", "math", "cmath", "re", "json", "string", "collections", "itertools",
    "functools", "operator", "fractions", "decimal", "statistics", "random", "difflib", "unicodedata", "typing",
    "dataclasses", "enum", "asyncio", "textwrap", "ast", "copy", "heapq", "bisect", "numbers")
"""Modules a reward function may import unless the operator sets --function-allowed-imports."""


class RewardConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    host: str = Field("127.0.0.1", description="Address the gRPC server and /metrics bind to.")
    port: int = Field(9105, ge=0, le=65535, description="HTTP port of Prometheus /metrics.")
    grpc_port: int = Field(50054, ge=0, le=65535, description="gRPC port: everstep.v1.Reward and health.")
    sandbox_endpoint: str | None = Field(None, description="Sandbox gRPC target of the code verifier: HOST:PORT, "
                                         "dns:///HOST:PORT or ipv4:A:P,B:P (round robin over its addresses).")
    math_workers: int = Field(default_factory=lambda: min(4, os.cpu_count() or 1), ge=1,
                              description="Worker processes for math verification.")
    worker_start_method: Literal["spawn", "forkserver"] = Field(
        "spawn", description="How math workers start (never fork: the server is multi-threaded).")
    timeout_seconds: float = Field(10.0, gt=0, description="Per-item limit of a math check, in seconds.")
    code_timeout_seconds: float = Field(60.0, gt=0, description="Limit of one sandbox RunTests call.")
    code_run_timeout_seconds: float = Field(5.0, gt=0, description="Sandbox run limit per test case.")
    code_compile_timeout_seconds: float = Field(10.0, gt=0, description="Sandbox compile limit per sample.")
    code_reward_mode: CodeRewardMode = Field(
        CodeRewardMode.FRACTION, description="Code score: fraction of tests passed, or all_pass (1 or 0).")
    format_require_think: bool = Field(False, description="The format rule requires a closed <think> block.")
    length_max: int = Field(4096, ge=1, description="Length verifier L_max (DAPO overlong penalty).")
    length_cache: int = Field(512, ge=0, description="Length verifier L_cache: soft penalty band below L_max.")
    length_unit: LengthUnit = Field(
        LengthUnit.WORDS, description="How L is counted for items without num_response_tokens: words or chars.")
    reward_model: str | None = Field(None, description="Hugging Face reward model dir; enables the model verifier.")
    reward_model_device: str = Field("cpu", description="torch device of the reward model.")
    reward_model_max_tokens: int = Field(4096, ge=1, description="Reward model input limit (left-truncated).")
    reward_model_batch_size: int = Field(16, ge=1, description="Most responses per reward-model forward pass.")
    reward_model_threads: int | None = Field(None, ge=1, description="torch CPU threads (None: torch default).")
    model_timeout_seconds: float = Field(60.0, gt=0, description="Per-item limit of a reward-model score.")
    max_concurrent_items: int = Field(64, ge=1, description="Items scored at once across all requests.")
    grpc_threads: int = Field(16, ge=1, description="gRPC handler threads (concurrent Score calls).")
    function_isolation: Literal["process", "none"] = Field(
        "process", description="How the jobs' reward functions run: in isolated worker processes, or none: in this "
                               "process, without limits or time limit (trusted code only; never a job's choice).")
    function_workers: int = Field(2, ge=1, description="Worker processes per reward function.")
    function_timeout_seconds: float = Field(10.0, gt=0, description="Per-call limit of a reward function, in seconds.")
    function_memory_mb: int = Field(2048, ge=64, description="Address-space limit of a reward function's worker.")
    function_cpu_seconds: int = Field(600, ge=1, description="CPU seconds a function worker may use before it is "
                                                            "replaced.")
    function_allowed_imports: tuple[str, ...] = Field(
        DEFAULT_FUNCTION_IMPORTS, description="Top-level modules a reward function may import (and their submodules).")
    function_allow_network: bool = Field(False, description="Grant network to the functions of jobs that ask for it "
                                                            "(reward.functions[].allow_network).")
    function_max_pools: int = Field(4, ge=1, description="Idle functions' worker pools kept before the least "
                                                         "recently used is closed.")
    item_log: str | None = Field(None, description="JSONL file recording each scored item's prompt, response and "
                                                   "reward ({pid}: the process id); none: off.")

    @model_validator(mode="after")
    def _check_length(self) -> RewardConfig:
        if self.length_cache > self.length_max:
            raise ValueError("length_cache must not exceed length_max")
        if self.length_unit == LengthUnit.TOKENS:
            raise ValueError("length_unit is the fallback for items without num_response_tokens: words or chars")
        return self
