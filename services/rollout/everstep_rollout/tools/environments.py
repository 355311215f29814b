"""Where a tool call runs: the built-in `python` tool in the sandbox service (over its gRPC, as the reward service
calls it), or an environment over HTTP (docs/tools.md: POST /reset, /step, /close with JSON bodies).

Every failure becomes a `ToolOutcome` with an error kind and a message for the model; nothing here raises for a bad
call, a slow tool or a service that is down, so no tool can fail a job.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any, Protocol

import grpc

from everstep.settings.tools import ToolSettings
from everstep.tools.calls import ParsedCall
from everstep.transport import channels
from everstep.v1 import common_pb2, sandbox_pb2, sandbox_pb2_grpc

__all__ = ["HttpEnvironment", "PythonSandbox", "ToolEnvironmentClient", "ToolOutcome"]

log = logging.getLogger(__name__)
_RETRY_PAUSES_SECONDS = (0.1, 0.3)
"""Pauses before the python tool's second and third attempt when the sandbox is unavailable."""

Kind = int  # common_pb2.ToolErrorKind


@dataclass(frozen=True, kw_only=True)
class ToolOutcome:
    reply: str
    """What goes back to the model (an error message when `error` is set)."""
    error: Kind = common_pb2.TOOL_ERROR_KIND_UNSPECIFIED
    seconds: float = 0.0
    done: bool = False
    """The environment ended the episode."""
    reward: float | None = None
    """The environment's reward for the step, when it gives one."""


class ToolEnvironmentClient(Protocol):
    def run(self, call: ParsedCall, trajectory: common_pb2.ToolTrajectory) -> ToolOutcome:
        """Run one validated call; may set trajectory.env_session (http reset)."""
        ...

    def close(self, trajectory: common_pb2.ToolTrajectory) -> None: ...


class PythonSandbox:
    """`python`: the code runs in the sandbox (RunCode); the reply is stdout, then stderr, then a non-zero exit."""

    def __init__(self, endpoint: str, settings: ToolSettings) -> None:
        self._endpoint = endpoint
        self._settings = settings
        self._lock = threading.Lock()
        self._stub: sandbox_pb2_grpc.SandboxStub | None = None

    def _sandbox(self) -> sandbox_pb2_grpc.SandboxStub:
        with self._lock:
            if self._stub is None:
                self._stub = sandbox_pb2_grpc.SandboxStub(channels.balanced_channel(self._endpoint))
            return self._stub

    def run(self, call: ParsedCall, trajectory: common_pb2.ToolTrajectory) -> ToolOutcome:
        if not self._endpoint:
            return ToolOutcome(reply="error: the python tool is unavailable (no sandbox configured)",
                               error=common_pb2.TOOL_ERROR_KIND_UNAVAILABLE)
        timeout = self._settings.tool_timeout_seconds
        request = sandbox_pb2.RunCodeRequest(code=str(call.arguments.get("code", "")), language=self._settings.language,
                                             run_timeout=timeout, compile_timeout=timeout)
        unavailable = ToolOutcome(reply="error: the python tool is unavailable, try again later",
                                  error=common_pb2.TOOL_ERROR_KIND_UNAVAILABLE)
        # A sandbox that is down or restarting is transient, as the reward service treats it: the call is tried
        # again a few times while it has time left, and only then the model hears of it.
        for attempt, pause_seconds in enumerate((*_RETRY_PAUSES_SECONDS, None)):
            try:
                # the sandbox's own limit is the run's; the call gets a little more for the round trip
                response = self._sandbox().RunCode(request, timeout=timeout + 5.0)
            except grpc.RpcError as e:
                code = e.code() if isinstance(e, grpc.Call) else None
                if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                    return ToolOutcome(reply=f"error: the tool did not answer within {timeout:g}s",
                                       error=common_pb2.TOOL_ERROR_KIND_TIMEOUT)
                if code != grpc.StatusCode.UNAVAILABLE or pause_seconds is None:
                    return unavailable
                log.debug("sandbox at %s unavailable (attempt %d): %s", self._endpoint, attempt + 1, e)
                time.sleep(pause_seconds)
                continue
            if response.status != "SandboxError":
                break
            if pause_seconds is None:
                return unavailable
            time.sleep(pause_seconds)
        result = response.run_result
        if result.status == "TimeLimitExceeded":
            return ToolOutcome(reply=f"{result.stdout}{result.stderr}error: the program ran longer than {timeout:g}s",
                               error=common_pb2.TOOL_ERROR_KIND_TIMEOUT)
        reply = result.stdout + result.stderr
        if response.HasField("compile_result") and response.compile_result.return_code:
            reply = response.compile_result.stderr or response.compile_result.stdout
        if result.return_code:
            reply += f"(exit code {result.return_code})"
        return ToolOutcome(reply=reply)

    def close(self, trajectory: common_pb2.ToolTrajectory) -> None:
        """The sandbox keeps no state between calls."""


class HttpEnvironment:
    """An environment server: reset (lazily, at a trajectory's first call), step per call, close at the end."""

    def __init__(self, settings: ToolSettings) -> None:
        self._url = settings.url.rstrip("/")
        self._timeout = settings.tool_timeout_seconds

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        request = urllib.request.Request(f"{self._url}/{path}", data=json.dumps(body).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=self._timeout) as response:  # noqa: S310 - the job's own URL
            value = json.loads(response.read() or b"{}")
        if not isinstance(value, dict):
            raise ValueError(f"/{path} answered {type(value).__name__}, not a JSON object")
        return value

    def run(self, call: ParsedCall, trajectory: common_pb2.ToolTrajectory) -> ToolOutcome:
        try:
            if not trajectory.env_session:
                row = json.loads(trajectory.row_json) if trajectory.row_json else {}
                session = self._post("reset", {"row": row}).get("session")
                if not isinstance(session, str) or not session:
                    raise ValueError('/reset must answer {"session": "<id>"}')
                trajectory.env_session = session
            answer = self._post("step", {"session": trajectory.env_session, "call_index": trajectory.num_tool_calls,
                                         "name": call.name, "arguments": call.arguments})
        except TimeoutError:
            return ToolOutcome(reply=f"error: the tool did not answer within {self._timeout:g}s",
                               error=common_pb2.TOOL_ERROR_KIND_TIMEOUT)
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:500]
            return ToolOutcome(reply=f"error: {detail or e.reason}", error=common_pb2.TOOL_ERROR_KIND_ENVIRONMENT)
        except urllib.error.URLError as e:
            if isinstance(e.reason, TimeoutError):
                return ToolOutcome(reply=f"error: the tool did not answer within {self._timeout:g}s",
                                   error=common_pb2.TOOL_ERROR_KIND_TIMEOUT)
            return ToolOutcome(reply="error: the environment is unavailable, try again later",
                               error=common_pb2.TOOL_ERROR_KIND_UNAVAILABLE)
        except (OSError, ValueError) as e:
            return ToolOutcome(reply=f"error: the environment failed: {e}",
                               error=common_pb2.TOOL_ERROR_KIND_ENVIRONMENT)
        observation = answer.get("observation", "")
        reward = answer.get("reward")
        return ToolOutcome(reply=observation if isinstance(observation, str) else json.dumps(observation),
                           done=bool(answer.get("done", False)),
                           reward=float(reward) if isinstance(reward, int | float) else None)

    def close(self, trajectory: common_pb2.ToolTrajectory) -> None:
        if trajectory.env_session:
            # nothing depends on this call: an environment that missed it loses only memory
            with contextlib.suppress(OSError, ValueError):
                self._post("close", {"session": trajectory.env_session})

