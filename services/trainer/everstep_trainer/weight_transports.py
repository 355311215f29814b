"""The weight transports by name, without torch (the CLI's `--weight-transport` choices come from here
before anything heavy is imported)."""

from __future__ import annotations

from enum import StrEnum

from everstep.v1 import trainer_pb2

__all__ = ["Transport"]

_PROTO_PREFIX = "WEIGHT_TRANSPORT_"


class Transport(StrEnum):
    """A transport setting by the name --weight-transport, the metrics' `transport` label and
    PushWeightsResponse.transports use; trainer.proto's `WeightTransport` of the same name on the wire
    (tests/trainer/test_weight_push_plan.py holds the two together)."""

    AUTO = "auto"
    """Not a transport: the setting that picks one per engine (weight_push_plan.choose_transport)."""
    GRPC = "grpc"
    SHM = "shm"
    NCCL = "nccl"
    GLOO = "gloo"
    CUDA_IPC = "cuda_ipc"

    @classmethod
    def from_proto(cls, value: trainer_pb2.WeightTransport) -> Transport | None:
        """None for UNSPECIFIED (the trainer's own setting); ValueError naming `transport` for a number
        this trainer has no name for."""
        if value == trainer_pb2.WEIGHT_TRANSPORT_UNSPECIFIED:
            return None
        try:
            return cls[trainer_pb2.WeightTransport.Name(value).removeprefix(_PROTO_PREFIX)]
        except (ValueError, KeyError):
            raise ValueError(f"transport: {value} is no WeightTransport of this trainer "
                             f"(known: {[t.value for t in cls]})") from None

    def to_proto(self) -> trainer_pb2.WeightTransport:
        return trainer_pb2.WeightTransport.Value(_PROTO_PREFIX + self.name)
