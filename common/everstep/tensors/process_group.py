"""The weight-broadcast group of a trainer (rank 0) and its engines, with torch alone (no grpc, no stubs).

Both sides build their process group here, so they look up the same store keys. The keys are the
ones sglang's `init_weights_update_group` uses (`sglang.srt.utils.init_custom_process_group`, which
goes through torch's `_new_process_group_helper`): the rendezvous store, then
`PrefixStore(group_name)`, then `PrefixStore(f"{group_name}/")`, then `PrefixStore(f"{device}/")`,
where device is the first device torch maps the backend to ("cuda" for nccl, "cpu" for gloo). A
trainer side built as `ProcessGroupNCCL(PrefixStore(name, store))` would wait for the NCCL unique id
under another key than an engine that joined through sglang, and hang.

The backend is constructed directly (not through `_new_process_group_helper`), so the group is not
registered in torch's global state and never splits from the default (FSDP) group's communicator.

`warm_up` is everstep's first step after forming: rank 0 broadcasts one byte and every rank waits
for it with the group's timeout. NCCL creates its communicator on the first collective, so without it
the trainer's first real broadcast would be where a rank that joined but never receives hangs it.
"""

from __future__ import annotations

import datetime
import logging
from typing import Any

import torch

__all__ = ["BACKENDS", "device_prefix", "group_store", "new_group", "shutdown_group", "warm_up"]

log = logging.getLogger(__name__)

BACKENDS = ("nccl", "gloo")


def device_prefix(backend: str) -> str:
    """The device torch's `_new_process_group_helper` names the backend's store after ("cuda", "cpu")."""
    from torch.distributed.distributed_c10d import Backend, BackendConfig

    if backend not in BACKENDS:
        raise ValueError(f"backend: must be one of {BACKENDS}, got {backend!r}")
    return next(iter(BackendConfig(Backend(backend)).get_device_backend_map()))


def group_store(store: Any, group_name: str, backend: str) -> Any:
    """The store the backend of group `group_name` uses, prefixed as sglang's init_custom_process_group does."""
    import torch.distributed as dist

    if not group_name:
        raise ValueError("group: must not be empty")
    prefixed = dist.PrefixStore(group_name, store)  # init_custom_process_group, after the rendezvous
    prefixed = dist.PrefixStore(f"{group_name}/", prefixed)  # _new_process_group_helper
    return dist.PrefixStore(f"{device_prefix(backend)}/", prefixed)  # its per-device backend store


def new_group(backend: str, store: Any, *, group_name: str, rank: int, world_size: int,
              timeout: datetime.timedelta) -> Any:
    """The backend of one weight group over `store` (the rendezvous TCPStore); gloo blocks until all joined."""
    import torch.distributed as dist

    prefixed = group_store(store, group_name, backend)
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    if not hasattr(dist, "ProcessGroupNCCL"):
        raise ValueError("backend: this torch build has no NCCL")
    options = dist.ProcessGroupNCCL.Options()
    options.is_high_priority_stream = False
    options._timeout = timeout
    options.global_ranks_in_group = []
    options.group_name = group_name
    return dist.ProcessGroupNCCL(prefixed, rank, world_size, options)


def warm_up(group: Any, *, device: torch.device, timeout: datetime.timedelta) -> None:
    """Rank 0 broadcasts one byte on `device`; every rank waits for it (NCCL forms its communicator here).

    Call it from a thread its caller can give up on: NCCL's communicator set-up itself has no timeout.
    """
    flag = torch.tensor([1 if group.rank() == 0 else 0], dtype=torch.uint8, device=device)
    group.broadcast(flag, 0).wait(timeout)
    if flag.is_cuda:
        torch.cuda.current_stream(flag.device).synchronize()
    if int(flag.item()) != 1:
        raise RuntimeError("weight group warm-up: rank 0's byte did not arrive")


def shutdown_group(group: Any) -> None:
    """Free a group's communicators (NCCL holds GPU memory and threads; gloo needs nothing)."""
    for method in ("shutdown", "abort"):
        fn = getattr(group, method, None)
        if fn is not None:
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - best effort on a group that may be broken
                log.debug("process group %s() failed: %s", method, e)
            return
