"""The threads tool calls run on, and one client per tool configuration, shared by the sequences that use it."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from everstep.settings.tools import ToolEnvironment, ToolSettings
from everstep_rollout.tools.environments import HttpEnvironment, PythonSandbox, ToolEnvironmentClient

__all__ = ["ToolRuntime"]

_MAX_TOOL_THREADS = 64


class ToolRuntime:
    def __init__(self, sandbox_endpoint: str = "") -> None:
        self.sandbox_endpoint = sandbox_endpoint
        self._pool = ThreadPoolExecutor(max_workers=_MAX_TOOL_THREADS, thread_name_prefix="tool")
        self._clients: dict[str, ToolEnvironmentClient] = {}
        self._lock = threading.Lock()

    def client(self, settings: ToolSettings, sandbox_address: str = "") -> ToolEnvironmentClient:
        key = settings.model_dump_json() + sandbox_address
        with self._lock:
            if key not in self._clients:
                if settings.environment == ToolEnvironment.python:
                    self._clients[key] = PythonSandbox(sandbox_address or self.sandbox_endpoint, settings)
                else:
                    self._clients[key] = HttpEnvironment(settings)
            return self._clients[key]

    def submit(self, fn: Any, *args: Any) -> Future:
        return self._pool.submit(fn, *args)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
