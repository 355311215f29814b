"""Thin gRPC clients for the services the controller drives, with deadlines on every unary call."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator

from everstep import transport
from everstep.v1 import (
    common_pb2,
    reward_pb2,
    reward_pb2_grpc,
    rollout_pb2,
    rollout_pb2_grpc,
    trainer_pb2,
    trainer_pb2_grpc,
)

_MAX_MESSAGE_BYTES = 256 * 1024 * 1024
_CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
]


class GenerateStream:
    """One bidirectional Generate call: send batches while results stream back.

    Each sequence comes back exactly once: finished, or as an ABORTED partial after `drain()`.
    """

    _END = object()

    def __init__(self, stub: rollout_pb2_grpc.RolloutStub, timeout_seconds: float) -> None:
        self._requests: queue.Queue = queue.Queue()
        self._closed = False
        self._lock = threading.Lock()
        self._call = stub.Generate(iter(self._requests.get, self._END), timeout=timeout_seconds)

    def send(self, sequences: list[common_pb2.Sequence], sampling: common_pb2.SamplingParams) -> None:
        if sequences:
            self._requests.put(rollout_pb2.GenerateRequest(sequences=sequences, sampling=sampling))

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
        for response in self._call:
            yield from response.sequences

    def cancel(self) -> None:
        self._call.cancel()


class RolloutClient:
    def __init__(self, address: str, timeout_seconds: float = 120.0) -> None:
        self.address = address
        self.timeout_seconds = timeout_seconds
        self._channel = transport.channel(address, options=_CHANNEL_OPTIONS)
        self._stub = rollout_pb2_grpc.RolloutStub(self._channel)

    def load(self, model_path: str, *, dtype: str, version: int, seed: int,
             max_running: int) -> rollout_pb2.LoadModelResponse:
        request = rollout_pb2.LoadModelRequest(model_path=model_path, dtype=dtype, version=version, seed=seed,
                                               max_running=max_running)
        return self._stub.Load(request, timeout=self.timeout_seconds)

    def generate(self, stream_timeout_seconds: float) -> GenerateStream:
        return GenerateStream(self._stub, stream_timeout_seconds)

    def status(self) -> rollout_pb2.RolloutStatus:
        return self._stub.GetStatus(rollout_pb2.GetStatusRequest(), timeout=self.timeout_seconds)

    def drain(self) -> list[common_pb2.Sequence]:
        """Stops every running and queued sequence of every stream (e.g. those of a dead controller)."""
        return list(self._stub.Drain(rollout_pb2.DrainRequest(), timeout=self.timeout_seconds).partials)

    def close(self) -> None:
        self._channel.close()


class TrainerClient:
    def __init__(self, address: str, timeout_seconds: float = 600.0) -> None:
        self.address = address
        self.timeout_seconds = timeout_seconds
        self._channel = transport.channel(address, options=_CHANNEL_OPTIONS)
        self._stub = trainer_pb2_grpc.TrainerStub(self._channel)

    def load(self, model_path: str, config: trainer_pb2.TrainerConfig, version: int) -> trainer_pb2.TrainerLoadResponse:
        request = trainer_pb2.TrainerLoadRequest(model_path=model_path, config=config, version=version)
        return self._stub.Load(request, timeout=self.timeout_seconds)

    def train_step(self, samples: list[trainer_pb2.TrainSample]) -> trainer_pb2.TrainStepResponse:
        return self._stub.TrainStep(trainer_pb2.TrainStepRequest(samples=samples), timeout=self.timeout_seconds)

    def push_weights(self, endpoints: list[str]) -> trainer_pb2.PushWeightsResponse:
        return self._stub.PushWeights(trainer_pb2.PushWeightsRequest(endpoints=endpoints), timeout=self.timeout_seconds)

    def save_checkpoint(self, path: str) -> trainer_pb2.SaveCheckpointResponse:
        return self._stub.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(path=path), timeout=self.timeout_seconds)

    def close(self) -> None:
        self._channel.close()


class RewardClient:
    def __init__(self, address: str, timeout_seconds: float = 300.0) -> None:
        self.address = address
        self.timeout_seconds = timeout_seconds
        self._channel = transport.channel(address, options=_CHANNEL_OPTIONS)
        self._stub = reward_pb2_grpc.RewardStub(self._channel)

    def score(self, items: list[reward_pb2.RewardItem]) -> dict[str, reward_pb2.ScoreResult]:
        """Scores a batch; returns every result by item id, or raises if any is missing."""
        if not items:
            return {}
        results = {r.id: r for r in self._stub.Score(reward_pb2.ScoreRequest(items=items),
                                                     timeout=self.timeout_seconds)}
        missing = {item.id for item in items} - set(results)
        if missing:
            raise RuntimeError(f"reward service returned no result for {len(missing)} items, e.g. {min(missing)}")
        return results

    def close(self) -> None:
        self._channel.close()
