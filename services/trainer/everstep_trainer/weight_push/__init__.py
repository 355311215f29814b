"""Weight push from the trainer to rollout engines: one `WeightTransport` interface, one factory, one pusher.

How a push reaches an engine, in order:

1. `pusher.py`   `WeightPusher.push`: asks every engine where it lives, picks a transport per engine
                 (`plan.py`: `Transport`, `choose_transport`), builds it with `make_transport`.
2. `base.py`     `WeightTransport`, and `run_endpoint_streams`: one `Rollout.UpdateWeights` call per
                 engine, fed with `WeightBucket`s.
3. a transport, one module each:
   - `grpc.py`        tensor bytes inside the buckets (`everstep.tensors.tensor_codec`), a tensor over the
                      message limit in chunks; works everywhere.
   - `shm.py`         bytes through a /dev/shm segment, layout in the buckets; same host.
   - `collective.py`  nccl/gloo: a broadcast over a process group of the trainer and the engines.
   - `cuda_ipc.py`    CUDA IPC handles of the trainer's own tensors; same GPU.
4. the engine: `everstep_rollout.weights` (`receiver.py`: `WeightUpdate` turns the buckets into
   named tensors; `group.py`: the broadcast group and CUDA IPC on the engine's side).

The names below load on first use: `plan` (and with it `Transport`, the `--weight-transport`
choices) imports without torch; every other module here needs it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from everstep_trainer.weight_push.base import (
        DEFAULT_BUCKET_BYTES,
        GRPC_MAX_MESSAGE_BYTES,
        PushResult,
        WeightPushError,
        WeightTransport,
    )
    from everstep_trainer.weight_push.grpc import GrpcWeightTransport, iter_weight_buckets
    from everstep_trainer.weight_push.plan import SETTINGS, TRANSPORTS, Transport, choose_transport
    from everstep_trainer.weight_push.pusher import PushReport, WeightPusher, make_transport

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "GRPC_MAX_MESSAGE_BYTES",
    "SETTINGS",
    "TRANSPORTS",
    "GrpcWeightTransport",
    "PushReport",
    "PushResult",
    "Transport",
    "WeightPushError",
    "WeightPusher",
    "WeightTransport",
    "choose_transport",
    "iter_weight_buckets",
    "make_transport",
]

_HOME = {
    "DEFAULT_BUCKET_BYTES": "base", "GRPC_MAX_MESSAGE_BYTES": "base", "PushResult": "base",
    "WeightPushError": "base", "WeightTransport": "base",
    "GrpcWeightTransport": "grpc", "iter_weight_buckets": "grpc",
    "SETTINGS": "plan", "TRANSPORTS": "plan", "Transport": "plan", "choose_transport": "plan",
    "PushReport": "pusher", "WeightPusher": "pusher", "make_transport": "pusher",
}


def __getattr__(name: str) -> Any:
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
