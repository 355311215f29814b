"""Which transport carries the weights to each engine: pure rules over what both sides report.

An engine reports a `WeightReceiverInfo` in `Rollout.GetStatus`; the trainer builds the same facts
about itself (`local_peer`). `choose_transport` then applies, for the setting "auto":

1. cuda_ipc  the trainer's weights and the engine are on the same GPU (same host, same GPU UUID) and
             share /dev/shm (torch's CUDA IPC ref counters are files there);
2. nccl      both are on GPUs (a broadcast group over the network or NVLink);
3. shm       both see the same /dev/shm (same kernel, same tmpfs instance);
4. grpc      anything else, including an engine whose status does not say (older engines, test doubles).

gloo is never picked by auto (gRPC is the CPU default between hosts); it is there to ask for by
name. An explicit setting that cannot work for an engine is an error naming `transport`, never a
silent fallback.

`Transport` names the settings. This module imports neither torch nor the transports, so the CLI's
`--weight-transport` choices come from here before anything heavy is imported.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from enum import StrEnum

import grpc

from everstep.settings.proto_enums import enum_from_proto, enum_to_proto
from everstep.transport import channels
from everstep.transport.peer_identity import boot_id, shm_domain
from everstep.v1 import rollout_pb2, rollout_pb2_grpc, trainer_pb2

__all__ = ["SETTINGS", "TRANSPORTS", "PeerInfo", "Transport", "choose_transport", "local_peer", "probe_peer",
           "shm_domain", "validate_setting"]

log = logging.getLogger(__name__)


class Transport(StrEnum):
    """A transport setting by the name --weight-transport, the metrics' `transport` label and
    PushWeightsResponse.transports use; trainer.proto's `WeightTransport` of the same name on the wire
    (tests/trainer/test_weight_push_plan.py holds the two together)."""

    AUTO = "auto"
    """Not a transport: the setting that picks one per engine (`choose_transport`)."""
    GRPC = "grpc"
    SHM = "shm"
    NCCL = "nccl"
    GLOO = "gloo"
    CUDA_IPC = "cuda_ipc"

    @classmethod
    def from_proto(cls, value: trainer_pb2.WeightTransport) -> Transport | None:
        """None for UNSPECIFIED (the trainer's own setting); ValueError naming `transport` for a number
        this trainer has no name for."""
        return enum_from_proto(cls, value, trainer_pb2.WeightTransport.DESCRIPTOR, field="transport")

    def to_proto(self) -> trainer_pb2.WeightTransport:
        return enum_to_proto(self, trainer_pb2.WeightTransport.DESCRIPTOR)


SETTINGS: tuple[Transport, ...] = tuple(Transport)
TRANSPORTS: tuple[Transport, ...] = tuple(t for t in Transport if t != Transport.AUTO)
_AUTO_ORDER = (Transport.CUDA_IPC, Transport.NCCL, Transport.SHM)  # the first that can reach an engine, else grpc


@dataclass(frozen=True, kw_only=True)
class PeerInfo:
    """Where one side of a push lives; "" means unknown, which rules out every transport but grpc and gloo."""

    boot_id: str = ""
    shm_domain: str = ""
    device: str = ""
    """torch device of the weights (trainer) or of the engine: "cpu", "cuda:0", ..."""
    gpu_uuid: str = ""

    @property
    def on_gpu(self) -> bool:
        return self.device.startswith("cuda")

    @classmethod
    def from_proto(cls, info: rollout_pb2.WeightReceiverInfo) -> PeerInfo:
        return cls(boot_id=info.boot_id, shm_domain=info.shm_domain, device=info.device, gpu_uuid=info.gpu_uuid)


def local_peer(device: str) -> PeerInfo:
    """This process, holding its weights on `device`."""
    gpu_uuid = ""
    if device.startswith("cuda"):
        from everstep.tensors.cuda_ipc import device_uuid as cuda_device_uuid

        gpu_uuid = cuda_device_uuid(device)
    return PeerInfo(boot_id=boot_id(), shm_domain=shm_domain(), device=device, gpu_uuid=gpu_uuid)


def probe_peer(endpoint: str, timeout_seconds: float = 10.0, *,
               stub: rollout_pb2_grpc.RolloutStub | None = None) -> PeerInfo:
    """What the engine at `endpoint` reports; an empty PeerInfo if it does not say (or cannot be asked:
    the push itself then reports the endpoint's error). `stub`: ask over this (a kept channel,
    `connections.EngineConnections`) instead of dialing the endpoint for this one call."""
    request = rollout_pb2.GetStatusRequest()
    try:
        if stub is not None:
            status = stub.GetStatus(request, timeout=timeout_seconds)
        else:
            with channels.channel(endpoint) as channel:
                status = rollout_pb2_grpc.RolloutStub(channel).GetStatus(request, timeout=timeout_seconds)
    except grpc.RpcError as e:
        log.info("endpoint %s: no status (%s); weights go over grpc", endpoint, e.code().name)
        return PeerInfo()
    return PeerInfo.from_proto(status.weight_receiver)


def validate_setting(setting: str) -> Transport:
    """The setting as a Transport; ValueError naming `transport` for a name that is none."""
    try:
        return Transport(setting)
    except ValueError:
        raise ValueError(f"transport: must be one of {[s.value for s in SETTINGS]}, got {setting!r}") from None


def _impossible(setting: Transport, trainer: PeerInfo, engine: PeerInfo) -> str | None:
    """Why `setting` cannot carry weights from trainer to engine, or None if it can."""
    if setting == Transport.SHM and not (trainer.shm_domain and trainer.shm_domain == engine.shm_domain):
        return "the engine does not share this trainer's /dev/shm (another host or IPC namespace)"
    if setting == Transport.NCCL and not (trainer.on_gpu and engine.on_gpu):
        return f"nccl needs the weights and the engine on GPUs (trainer {trainer.device or '?'}, " \
               f"engine {engine.device or '?'})"
    if setting == Transport.CUDA_IPC and not (trainer.on_gpu and engine.on_gpu and trainer.gpu_uuid and
                                              trainer.gpu_uuid == engine.gpu_uuid and
                                              trainer.boot_id == engine.boot_id):
        return "cuda_ipc needs the engine on the GPU that holds the trainer's weights"
    if setting == Transport.CUDA_IPC and not (trainer.shm_domain and trainer.shm_domain == engine.shm_domain):
        return "cuda_ipc needs the engine to share this trainer's /dev/shm (torch's CUDA IPC ref counters live there)"
    return None


def choose_transport(setting: str, trainer: PeerInfo, engine: PeerInfo) -> Transport:
    """The transport for one engine; raises ValueError naming `transport` if an explicit one cannot work."""
    setting = validate_setting(setting)
    if setting == Transport.AUTO:
        for candidate in _AUTO_ORDER:
            if _impossible(candidate, trainer, engine) is None:
                return candidate
        return Transport.GRPC
    reason = _impossible(setting, trainer, engine)
    if reason is not None:
        raise ValueError(f"transport: {setting.value!r} cannot reach this engine: {reason}")
    return setting
