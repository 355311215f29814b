"""Transport selection (pure rules, no GPU needed) and the encodings both sides must agree on.

The CUDA IPC and NCCL paths themselves cannot run here (no GPU); these tests cover the choice of
transport and the CUDA IPC message encoding, whose decoding lives in the rollout package.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from everstep.v1 import trainer_pb2
from everstep_rollout.weights import group as weight_group
from everstep_rollout.weights import receiver as weight_receiver
from everstep_trainer.__main__ import parse_args
from everstep_trainer.server import _transport_from_proto
from everstep_trainer.weight_push import WeightPusher, make_transport
from everstep_trainer.weight_push import plan as weight_push_plan
from everstep_trainer.weight_push.cuda_ipc import encode_cuda_ipc_args
from everstep_trainer.weight_push.plan import PeerInfo, Transport, choose_transport

HOST_A = dict(boot_id="boot-a", shm_domain="boot-a:25:1")
HOST_B = dict(boot_id="boot-b", shm_domain="boot-b:25:1")
OTHER_SHM = dict(boot_id="boot-a", shm_domain="boot-a:97:1")  # same host, another IPC namespace's /dev/shm


def peer(host: dict, device: str = "cpu", gpu_uuid: str = "") -> PeerInfo:
    return PeerInfo(device=device, gpu_uuid=gpu_uuid, **host)


@pytest.mark.parametrize(("trainer", "engine", "expected"), [
    (peer(HOST_A), peer(HOST_A), "shm"),                                               # one host, CPUs
    (peer(HOST_A), peer(HOST_B), "grpc"),                                              # two hosts, CPUs
    (peer(HOST_A), PeerInfo(), "grpc"),                                                # engine does not say
    (peer(HOST_A, "cuda:0", "GPU-1"), peer(HOST_A, "cuda:1", "GPU-1"), "cuda_ipc"),    # same GPU, other index
    (peer(HOST_A, "cuda:0", "GPU-1"), peer(HOST_A, "cuda:0", "GPU-2"), "nccl"),        # other GPU, same host
    (peer(HOST_A, "cuda:0", "GPU-1"), peer(HOST_B, "cuda:0", "GPU-1"), "nccl"),        # same UUID string elsewhere
    (peer(HOST_A, "cuda:0", "GPU-1"), peer(OTHER_SHM, "cuda:0", "GPU-1"), "nccl"),     # same GPU, own /dev/shm
    (peer(HOST_A, "cuda:0", "GPU-1"), peer(HOST_A), "shm"),                            # GPU trainer, CPU engine
    (peer(HOST_A, "cuda:0", "GPU-1"), peer(HOST_B), "grpc"),
])
def test_auto_picks_the_fastest_transport_that_can_reach_the_engine(trainer, engine, expected) -> None:
    assert choose_transport("auto", trainer, engine) == expected


def test_an_explicit_transport_that_cannot_work_is_an_error_naming_the_setting() -> None:
    with pytest.raises(ValueError, match=r"transport: 'shm' cannot reach .*/dev/shm"):
        choose_transport("shm", peer(HOST_A), peer(HOST_B))
    with pytest.raises(ValueError, match=r"transport: 'nccl' .* GPUs"):
        choose_transport("nccl", peer(HOST_A), peer(HOST_A))
    with pytest.raises(ValueError, match=r"transport: 'cuda_ipc'"):
        choose_transport("cuda_ipc", peer(HOST_A, "cuda:0", "GPU-1"), peer(HOST_A, "cuda:0", "GPU-2"))
    with pytest.raises(ValueError, match=r"transport: must be one of"):
        choose_transport("pigeon", peer(HOST_A), peer(HOST_A))
    # The ones that work anywhere are taken as asked.
    assert choose_transport("grpc", peer(HOST_A), peer(HOST_A)) == "grpc"
    assert choose_transport("gloo", peer(HOST_A), peer(HOST_B)) == "gloo"
    with pytest.raises(ValueError, match="transport"):
        WeightPusher(setting="carrier-pigeon")


def test_trainer_and_engine_describe_this_host_identically() -> None:
    """Both packages report the shared-memory domain (everstep.transport.peer_identity); on one host they agree."""
    trainer = weight_push_plan.local_peer("cpu")
    engine = PeerInfo.from_proto(weight_receiver.receiver_info("cpu"))
    assert trainer.shm_domain and trainer.shm_domain == engine.shm_domain
    assert trainer.boot_id and trainer.boot_id == engine.boot_id
    assert choose_transport("auto", trainer, engine) == "shm"
    assert weight_push_plan.shm_domain() != weight_push_plan.shm_domain(Path("/proc"))


def test_explicit_cuda_ipc_needs_a_shared_dev_shm() -> None:
    with pytest.raises(ValueError, match="transport.*/dev/shm"):
        choose_transport("cuda_ipc", peer(HOST_A, "cuda:0", "GPU-1"), peer(OTHER_SHM, "cuda:0", "GPU-1"))
    assert choose_transport("cuda_ipc", peer(HOST_A, "cuda:0", "GPU-1"), peer(HOST_A, "cuda:3", "GPU-1")) == "cuda_ipc"


def test_cuda_ipc_encoding_round_trips_to_the_arguments_of_rebuild_cuda_tensor() -> None:
    """reduce_tensor(cuda tensor)[1] -> proto -> rebuild_cuda_tensor arguments on the engine's device index.

    The tuple is written by hand in reduce_tensor's order (there is no CUDA here to produce one)."""
    sent = (torch.Tensor, torch.Size([4, 3]), (3, 1), 6, torch.storage.TypedStorage, torch.bfloat16, 0,
            b"\x01ipc-handle", 4096, 512, False, b"/torch_ref_counter", 7, b"\x02event", True)
    message = encode_cuda_ipc_args("model.norm.weight", sent, "GPU-1234")
    assert message.dtype == "bfloat16" and message.device_uuid == "GPU-1234"
    received = weight_group.cuda_ipc_args(message, device_index=2)
    assert received == sent[:6] + (2,) + sent[7:]
    no_event = encode_cuda_ipc_args("w", sent[:13] + (None, False), "GPU-1234")
    assert weight_group.cuda_ipc_args(no_event, 0)[13:] == (None, False)
    with pytest.raises(ValueError, match="strides"):
        weight_group.cuda_ipc_args(type(message)(name="w", dtype="float32", shape=[2], stride=[]), 0)


def test_factory_builds_every_transport_without_a_gpu_and_names_unknown_ones() -> None:
    for kind in ("grpc", "shm", "gloo", "nccl", "cuda_ipc"):
        transport = make_transport(kind)
        assert transport.kind == kind
        transport.close()
    with pytest.raises(ValueError, match="kind"):
        make_transport("carrier-pigeon")


def test_transport_names_are_the_proto_enum_and_the_cli_values() -> None:
    """Transport and trainer.proto's WeightTransport name the same settings; UNSPECIFIED is the trainer's own."""
    names = [v.name.removeprefix("WEIGHT_TRANSPORT_").lower() for v in trainer_pb2.WeightTransport.DESCRIPTOR.values]
    assert names[1:] == [t.value for t in Transport] == ["auto", "grpc", "shm", "nccl", "gloo", "cuda_ipc"]
    assert all(Transport.from_proto(t.to_proto()) is t for t in Transport)
    assert Transport.from_proto(trainer_pb2.WEIGHT_TRANSPORT_UNSPECIFIED) is None
    with pytest.raises(ValueError, match="transport: unknown value 42"):
        Transport.from_proto(42)
    assert parse_args(["--weight-transport", "cuda_ipc"]).weight_transport == "cuda_ipc"


def test_the_cli_and_the_package_surface_import_without_torch() -> None:
    """`python -m everstep_trainer` parses its arguments (the transport names of `weight_push.plan`) before
    torch is imported; `everstep_trainer.weight_push` loads its names on first use."""
    code = ("import sys\n"
            "import everstep_trainer.__main__, everstep_trainer.weight_push as w\n"
            "assert w.Transport.SHM == 'shm' and w.SETTINGS[0] == 'auto'\n"
            "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))\n"
            "w.WeightPusher\n"
            "print('torch' in sys.modules)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split("\n")[:2] == ["[]", "True"]


def test_a_push_request_with_the_old_string_transport_is_refused() -> None:
    assert _transport_from_proto(trainer_pb2.PushWeightsRequest(transport=trainer_pb2.WEIGHT_TRANSPORT_SHM)) == "shm"
    assert _transport_from_proto(trainer_pb2.PushWeightsRequest(endpoints=["a:1"])) is None
    old = trainer_pb2.PushWeightsRequest.FromString(b"\x0a\x03a:1" + b"\x1a\x03shm")  # field 3: transport = "shm"
    with pytest.raises(ValueError, match="transport: field 3"):
        _transport_from_proto(old)


def test_engine_connections_remember_only_answers_and_keep_at_most_max_endpoints() -> None:
    """An engine that cannot be asked (nothing listens) is not remembered (asked again next time); past
    `max_endpoints` the endpoint used least recently is forgotten."""
    from everstep.processes import free_port
    from everstep_trainer.weight_push.connections import EngineConnections

    with pytest.raises(ValueError, match="max_endpoints"):
        EngineConnections(max_endpoints=0)
    connections = EngineConnections(max_endpoints=2)
    try:
        silent = f"127.0.0.1:{free_port()}"
        assert connections.peer(silent, timeout_seconds=2) == PeerInfo()
        assert connections.remembered(silent) is None
        connections.peer(silent, timeout_seconds=2)
        assert (connections.num_dials, connections.num_probes) == (1, 2)  # one channel kept, asked twice
        others = [f"127.0.0.1:{free_port()}" for _ in range(2)]
        for endpoint in others:
            connections.stub(endpoint)
        assert connections.num_dials == 3
        connections.stub(others[1])  # kept
        connections.stub(silent)  # the least recently used was forgotten: dialed anew
        assert connections.num_dials == 4
        connections.forget(silent)
        connections.forget("127.0.0.1:1")  # unknown: ignored
    finally:
        connections.close()
