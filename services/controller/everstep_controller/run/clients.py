"""Thin gRPC clients for the services the controller drives, with a deadline on every call.

A call that fails for a cause a retry or a restarted service may fix raises `ServiceUnavailable`
(which names the service, its address and the call); the job runner then restarts the worker or
retries. Any other gRPC error (a bad request, a server bug) is raised as it is.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from enum import StrEnum

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from everstep.settings.quantization import Quantization, quantization_from_proto, quantization_to_proto
from everstep.transport import channels
from everstep.v1 import (
    common_pb2,
    reward_pb2,
    reward_pb2_grpc,
    rollout_pb2,
    rollout_pb2_grpc,
    trainer_pb2,
    trainer_pb2_grpc,
)
from everstep_controller.settings import ControllerSettings, check_settings, from_settings, setting

__all__ = ["Deadlines", "GenerateStream", "RewardClient", "RolloutClient", "Service", "ServiceUnavailable",
           "TrainerClient"]

_MAX_MESSAGE_BYTES = 256 * 1024 * 1024
_CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
]


# UNAVAILABLE: down, restarting or unreachable (a server killed in the middle of a stream shows so);
# DEADLINE_EXCEEDED: no answer in time (hung or overloaded); ABORTED: the server dropped the call (e.g.
# its engine was reset or failed).
_RECOVERABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED})


@dataclass(frozen=True, kw_only=True)
class Deadlines:
    """How long the controller waits for each kind of call before it gives up (DEADLINE_EXCEEDED).
    The defaults and checks are the controller's --*-deadline-seconds options (`ControllerSettings`)."""

    rollout_seconds: float = setting("rollout_deadline_seconds")  # one unary call to a rollout engine
    generate_seconds: float = setting("generate_deadline_seconds")  # one Generate stream
    trainer_seconds: float = setting("trainer_deadline_seconds")  # one call to a trainer
    reward_seconds: float = setting("reward_deadline_seconds")  # one Score call to the reward service
    engine_probe_seconds: float = setting("engine_probe_seconds")  # between health checks of a busy engine (0: none)
    engine_probe_timeout_seconds: float = setting("engine_probe_timeout_seconds")  # one health check
    engine_probe_failures: int = setting("engine_probe_failures")  # failed in a row: the engine is taken for hung

    def __post_init__(self) -> None:
        check_settings(self)

    @classmethod
    def from_settings(cls, settings: ControllerSettings) -> Deadlines:
        return from_settings(cls, settings)


class Service(StrEnum):
    """A service the controller calls; the value is its label in messages and in the `service` metric label.
    ROLLOUT and TRAINER are also the roles of a job's workers (what a launcher restarts)."""

    ROLLOUT = "rollout"
    TRAINER = "trainer"
    REWARD = "reward service"


class ServiceUnavailable(RuntimeError):
    """A call failed for a cause a retry or a restarted service may fix (see `_RECOVERABLE`).

    `role`: the job worker to restart (Service.ROLLOUT or Service.TRAINER), None for the shared reward
    pool or when the call does not tell which of two workers failed (a weight push).
    """

    def __init__(self, service: Service, address: str, method: str, error: grpc.RpcError, *,
                 deadline_seconds: float, role: Service | None) -> None:
        self.service, self.address, self.method, self.code, self.role = service, address, method, error.code(), role
        if self.code == grpc.StatusCode.DEADLINE_EXCEEDED:
            cause = f"did not answer {method} within {deadline_seconds:g}s (DEADLINE_EXCEEDED)"
        else:
            cause = f"failed {method}: {self.code.name}: {error.details()}"
        super().__init__(f"{service} at {address} {cause}")


@contextlib.contextmanager
def _calling(service: Service, address: str, method: str, deadline_seconds: float,
             role: Service | None) -> Iterator[None]:
    try:
        yield
    except grpc.RpcError as e:
        if e.code() in _RECOVERABLE:
            raise ServiceUnavailable(service, address, method, e, deadline_seconds=deadline_seconds,
                                     role=role) from e
        raise


class GenerateStream:
    """One bidirectional Generate call: send batches while results stream back.

    Each sequence comes back exactly once: finished, or as an ABORTED partial after `drain()`.
    """

    _END = object()

    def __init__(self, stub: rollout_pb2_grpc.RolloutStub, address: str, timeout_seconds: float,
                 tools: common_pb2.ToolConfig | None = None) -> None:
        self._tools = tools
        self._requests: queue.Queue = queue.Queue()
        self._closed = False
        self._lock = threading.Lock()
        self._address, self._timeout_seconds = address, timeout_seconds
        self._call = stub.Generate(iter(self._requests.get, self._END), timeout=timeout_seconds)

    def send(self, sequences: list[common_pb2.Sequence], sampling: common_pb2.SamplingParams) -> None:
        if sequences:
            self._requests.put(rollout_pb2.GenerateRequest(sequences=sequences, sampling=sampling, tools=self._tools))

    def drain_and_close(self) -> None:
        """Ask for every unfinished sequence back as a partial, then half-close."""
        with self._lock:
            if not self._closed:
                self._requests.put(rollout_pb2.GenerateRequest(drain=True))
                self.close()

    def close(self) -> None:
        """Half-close: the stream ends once everything sent has come back."""
        self._closed = True
        self._requests.put(self._END)

    def results(self) -> Iterator[common_pb2.Sequence]:
        with _calling(Service.ROLLOUT, self._address, "Generate", self._timeout_seconds, Service.ROLLOUT):
            for response in self._call:
                yield from response.sequences

    def cancel(self) -> None:
        self._call.cancel()


class RolloutClient:
    def __init__(self, address: str, deadlines: Deadlines | None = None) -> None:
        self.address = address
        self.deadlines = deadlines or Deadlines()
        self._channel = channels.channel(address, options=_CHANNEL_OPTIONS)
        self._stub = rollout_pb2_grpc.RolloutStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def _calling(self, method: str) -> contextlib.AbstractContextManager[None]:
        return _calling(Service.ROLLOUT, self.address, method, self.deadlines.rollout_seconds, Service.ROLLOUT)

    def load(self, model_path: str, *, dtype: str, version: int, seed: int, max_running: int,
             max_seq_len: int, quantization: Quantization = Quantization.none) -> rollout_pb2.LoadModelResponse:
        """Every per-job engine setting travels in the request; RuntimeError when the engine reports
        having taken other ones (an older server that ignores a field), so nothing is cut silently."""
        request = rollout_pb2.LoadModelRequest(model_path=model_path, dtype=dtype, version=version, seed=seed,
                                               max_running=max_running, max_seq_len=max_seq_len,
                                               quantization=quantization_to_proto(quantization))
        with self._calling("Load"):
            reply = self._stub.Load(request, timeout=self.deadlines.rollout_seconds)
        taken = {"dtype": reply.dtype, "max_running": reply.max_running, "max_seq_len": reply.max_seq_len,
                 "seed": reply.seed, "quantization": _quantization_name(reply.quantization)}
        asked = {"dtype": dtype, "max_running": max_running, "max_seq_len": max_seq_len, "seed": seed,
                 "quantization": Quantization(quantization).value}
        differ = {k: (asked[k], taken[k]) for k in asked if asked[k] != taken[k]}
        if differ:
            raise RuntimeError(f"rollout engine at {self.address} took other settings than the job's: "
                               + ", ".join(f"{k} {a!r} asked, {t!r} taken" for k, (a, t) in differ.items()))
        return reply

    def generate(self, tools: common_pb2.ToolConfig | None = None) -> GenerateStream:
        """`tools`: the job's tool loop, for every sequence of the stream (None: single turn)."""
        return GenerateStream(self._stub, self.address, self.deadlines.generate_seconds, tools)

    def check_health(self) -> None:
        """Asks the engine's gRPC health service (`engine_probe_timeout_seconds`); ServiceUnavailable when it does not
        answer in time (hung, stopped) or is down, RuntimeError when it answers other than SERVING."""
        timeout = self.deadlines.engine_probe_timeout_seconds
        with _calling(Service.ROLLOUT, self.address, "health Check", timeout, Service.ROLLOUT):
            reply = self._health.Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        if reply.status != health_pb2.HealthCheckResponse.SERVING:
            status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            raise RuntimeError(f"rollout engine at {self.address} is {status}")

    def status(self) -> rollout_pb2.RolloutStatus:
        with self._calling("GetStatus"):
            return self._stub.GetStatus(rollout_pb2.GetStatusRequest(), timeout=self.deadlines.rollout_seconds)

    def drain(self) -> list[common_pb2.Sequence]:
        """Stops every running and queued sequence of every stream (e.g. those of a dead controller)."""
        with self._calling("Drain"):
            return list(self._stub.Drain(rollout_pb2.DrainRequest(), timeout=self.deadlines.rollout_seconds).partials)

    def close(self) -> None:
        self._channel.close()


class TrainerClient:
    def __init__(self, address: str, deadlines: Deadlines | None = None) -> None:
        self.address = address
        self.deadlines = deadlines or Deadlines()
        self._channel = channels.channel(address, options=_CHANNEL_OPTIONS)
        self._stub = trainer_pb2_grpc.TrainerStub(self._channel)

    def _call(self, method: str, request: object, *, role: Service | None = Service.TRAINER) -> object:
        timeout = self.deadlines.trainer_seconds
        with _calling(Service.TRAINER, self.address, method, timeout, role):
            return getattr(self._stub, method)(request, timeout=timeout)

    def load(self, model_path: str, config: trainer_pb2.TrainerConfig, version: int) -> trainer_pb2.TrainerLoadResponse:
        return self._call("Load", trainer_pb2.TrainerLoadRequest(model_path=model_path, config=config, version=version))

    def load_checkpoint(self, path: str) -> trainer_pb2.LoadCheckpointResponse:
        """Resumes from a SaveCheckpoint directory with its own settings: weights, optimizer, RNG, step."""
        return self._call("LoadCheckpoint", trainer_pb2.LoadCheckpointRequest(path=path))

    def train_step(self, samples: list[trainer_pb2.TrainSample]) -> trainer_pb2.TrainStepResponse:
        return self._call("TrainStep", trainer_pb2.TrainStepRequest(samples=samples))

    def reference_kl(self, samples: list[trainer_pb2.TrainSample]) -> trainer_pb2.ReferenceKlResponse:
        """trainer.kl_in_reward: each sample's summed KL to the reference, and the coefficient of the step."""
        return self._call("ReferenceKl", trainer_pb2.ReferenceKlRequest(samples=samples))

    def push_weights(self, endpoints: list[str]) -> trainer_pb2.PushWeightsResponse:
        # a failed push does not say whether the trainer or an engine failed: role None
        return self._call("PushWeights", trainer_pb2.PushWeightsRequest(endpoints=endpoints), role=None)

    def save_checkpoint(self, path: str, data_position: str = "") -> trainer_pb2.SaveCheckpointResponse:
        return self._call("SaveCheckpoint", trainer_pb2.SaveCheckpointRequest(path=path, data_position=data_position))

    def close(self) -> None:
        self._channel.close()


class RewardClient:
    def __init__(self, address: str, timeout_seconds: float = 300.0) -> None:
        self.address = address
        self.timeout_seconds = timeout_seconds
        self._channel = channels.balanced_channel(address, options=_CHANNEL_OPTIONS)
        self._stub = reward_pb2_grpc.RewardStub(self._channel)

    def score(self, items: list[reward_pb2.RewardItem]) -> dict[str, reward_pb2.ScoreResult]:
        """Scores a batch; returns every result by item id, or raises if any is missing."""
        if not items:
            return {}
        with _calling(Service.REWARD, self.address, "Score", self.timeout_seconds, None):
            results = {r.id: r for r in self._stub.Score(reward_pb2.ScoreRequest(items=items),
                                                         timeout=self.timeout_seconds)}
        missing = {item.id for item in items} - set(results)
        if missing:
            raise RuntimeError(f"reward service returned no result for {len(missing)} items, e.g. {min(missing)}")
        return results

    def close(self) -> None:
        self._channel.close()


def _quantization_name(value: int) -> str:
    """The setting a reply's enum names; "" for UNSPECIFIED (an engine that predates the field)."""
    quantization = quantization_from_proto(value)
    return quantization.value if quantization is not None else ""
