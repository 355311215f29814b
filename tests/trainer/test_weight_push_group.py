"""The weight group's store keys agree with sglang's, its address rules, and CUDA IPC handles per engine.

`SGLANG_SIDE_STAND_IN` is a stand-in for sglang's side of a weight group: the steps of sglang 0.5.3's
`ModelRunner.init_weights_update_group` -> `sglang.srt.utils.init_custom_process_group` (a tcp://
rendezvous, `PrefixStore(group_name, store)`, then torch's own `_new_process_group_helper`, which adds
`PrefixStore(f"{group_name}/")` and the device prefix), run over gloo in a second process, since sglang
is not installed here. NCCL cannot run here; it takes its store from the same chain ("cuda/" instead of
"cpu/", checked below against torch's own mapping).
"""

from __future__ import annotations

import datetime
import subprocess
import sys
import textwrap
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from everstep.tensors import cuda_ipc, process_group
from everstep.v1 import rollout_pb2
from everstep_trainer.weight_push import cuda_ipc as weight_push_cuda_ipc
from everstep_trainer.weight_push.base import WeightPushError
from everstep_trainer.weight_push.collective import CollectiveWeightTransport, default_group_host

SGLANG_SIDE_STAND_IN = textwrap.dedent("""
    import datetime, os, sys
    import torch
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    host, port, group_name = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    timeout = datetime.timedelta(seconds=float(sys.argv[4]))
    # sglang.srt.utils.init_custom_process_group(backend="gloo", init_method=f"tcp://{host}:{port}",
    #                                            world_size=2, rank=1, group_name=group_name)
    store, rank, world_size = next(rendezvous(f"tcp://{host}:{port}?rank=1&world_size=2", timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend("gloo"), store, group_name=group_name,
                                      backend_options=None, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    # sglang's update_weights_from_distributed: one broadcast per tensor from rank 0
    weight = torch.zeros(4)
    torch.distributed.broadcast(weight, src=0, group=pg)
    print("received", weight.tolist(), flush=True)
    os._exit(0)  # sglang's process lives on; skip gloo's teardown at interpreter exit (it may abort)
""")


def _sglang_side(port: int, group_name: str, timeout_seconds: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", SGLANG_SIDE_STAND_IN, "127.0.0.1", str(port), group_name,
                             str(timeout_seconds)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_trainer_side_meets_sglangs_init_custom_process_group_on_the_same_keys() -> None:
    timeout = datetime.timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=timeout, wait_for_workers=False)
    engine = _sglang_side(store.port, "everstep-weights-keys", 60)
    try:
        group = process_group.new_group("gloo", store, group_name="everstep-weights-keys", rank=0, world_size=2,
                                        timeout=timeout)
        try:
            group.broadcast(torch.arange(4, dtype=torch.float32), 0).wait()
        finally:
            out, err = engine.communicate(timeout=60)
    finally:
        engine.kill()
    assert engine.returncode == 0, err[-3000:]
    assert "received [0.0, 1.0, 2.0, 3.0]" in out


def test_the_old_single_prefix_scheme_does_not_meet_sglang() -> None:
    """The scheme the trainer used before (PrefixStore(name) only) waits on other keys than sglang's."""
    timeout = datetime.timedelta(seconds=4)
    store = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=timeout, wait_for_workers=False)
    engine = _sglang_side(store.port, "everstep-weights-old", 4)
    try:
        with pytest.raises(RuntimeError):
            dist.ProcessGroupGloo(dist.PrefixStore("everstep-weights-old", store), 0, 2, timeout)
    finally:
        engine.kill()
        engine.communicate()


def test_store_prefixes_follow_torchs_own_device_mapping() -> None:
    assert process_group.device_prefix("nccl") == "cuda"
    assert process_group.device_prefix("gloo") == "cpu"
    with pytest.raises(ValueError, match="backend"):
        process_group.device_prefix("mpi")
    store = dist.HashStore()
    process_group.group_store(store, "g", "nccl").set("0", b"id")
    assert store.get("g/g//cuda//0") == b"id"  # PrefixStore joins with "/": g + g/ + cuda/ + key
    with pytest.raises(ValueError, match="group"):
        process_group.group_store(store, "", "gloo")


@pytest.mark.parametrize(("endpoints", "expected"), [
    (["127.0.0.1:5000"], "127.0.0.1"),
    (["localhost:5000", "[::1]:5001", "127.0.1.1:5002"], "127.0.0.1"),
])
def test_default_group_host_on_loopback(endpoints, expected) -> None:
    assert default_group_host(endpoints) == expected


def test_remote_engines_need_an_explicit_group_host() -> None:
    with pytest.raises(ValueError, match="group_host.*10.0.0.7:5000"):
        default_group_host(["127.0.0.1:5000", "10.0.0.7:5000"])
    transport = CollectiveWeightTransport(backend="gloo", timeout_seconds=5)
    with pytest.raises(WeightPushError, match="group_host") as raised:
        transport.push([("w", torch.zeros(2))], version=1, endpoints=["engine-7.cluster:5000"])
    assert set(raised.value.failures) == {"engine-7.cluster:5000"}


_HANDLE = cuda_ipc.CudaIpcHandle(
    name="", dtype="bfloat16", shape=(2,), stride=(1,), storage_offset=0, device_uuid="GPU-1",
    storage_handle=b"\x01handle", storage_size_bytes=64, storage_offset_bytes=0, ref_counter_handle=b"/ref",
    ref_counter_offset=0, event_handle=b"", event_sync_required=False)


def test_cuda_ipc_encodes_every_tensor_once_per_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """ReduceTensorStandIn: `cuda_ipc.encode` counts its calls (each one raises torch's producer ref count
    once); with two engines every tensor must be encoded twice and each engine get its own handles."""
    calls: list[str] = []

    def reduce_tensor_stand_in(name: str, tensor: torch.Tensor) -> cuda_ipc.CudaIpcHandle:
        calls.append(name)
        return replace(_HANDLE, name=name, ref_counter_offset=len(calls))

    sent: dict[str, list] = {}

    adapters: list = []
    kept: list = []

    def streams_stand_in(buckets, endpoints, *, timeout_seconds, adapter=None, connections=None):
        assert len(endpoints) == 1
        sent[endpoints[0]] = list(buckets)
        adapters.append(adapter)
        kept.append(connections)
        return []

    monkeypatch.setattr(cuda_ipc, "encode", reduce_tensor_stand_in)
    monkeypatch.setattr(weight_push_cuda_ipc, "run_endpoint_streams", streams_stand_in)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "ipc_collect", lambda: None)
    transport = weight_push_cuda_ipc.CudaIpcWeightTransport(timeout_seconds=5)
    weights = [(f"w{i}", torch.zeros(2)) for i in range(3)]
    result = transport.push(weights, version=4, endpoints=["a:1", "b:2"])
    assert sorted(calls) == sorted(["w0", "w1", "w2"] * 2) and result.num_endpoints == 2
    offsets = {endpoint: [m.ref_counter_offset for b in buckets for m in b.cuda_ipc]
               for endpoint, buckets in sent.items()}
    assert set(offsets) == {"a:1", "b:2"} and all(len(o) == 3 for o in offsets.values())
    assert not set(offsets["a:1"]) & set(offsets["b:2"])  # no handle went to two engines
    assert all(buckets[-1].last and buckets[-1].version == 4 for buckets in sent.values())
    # LoRA adapters take the same path; the LoraAdapter goes to each engine's stream (stamped on its last bucket)
    lora = rollout_pb2.LoraAdapter(rank=4, alpha=8.0)
    transport.push([("m.lora_A", torch.zeros(4, 2)), ("m.lora_B", torch.zeros(2, 4))], version=5,
                   endpoints=["a:1", "b:2"], adapter=lora)
    assert adapters == [None, None, lora, lora]
    assert kept == [transport.connections] * 4  # every call over the transport's kept channels


def test_cuda_ipc_module_imports_with_torch_alone() -> None:
    """gpu_check imports everstep.tensors.cuda_ipc (and with it everstep.tensors.tensor_codec) on a machine without
    grpc, protobuf or the stubs."""
    script = textwrap.dedent("""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("grpc", "google") or name.startswith("everstep.v1"):
                    raise ImportError(f"blocked: {name}")
        sys.meta_path.insert(0, Block())
        import everstep.tensors.cuda_ipc, everstep.tensors.process_group, everstep.tensors.tensor_codec
        print("ok")
    """)
    process = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert process.returncode == 0 and process.stdout.strip() == "ok", process.stderr[-2000:]


def _join_in_thread(request) -> tuple:
    import threading

    from everstep_rollout.weights import WeightGroupMember

    outcome: dict = {}

    def join() -> None:
        try:
            outcome["member"] = WeightGroupMember.join(request)
        except Exception as e:  # noqa: BLE001 - inspected by the test
            outcome["error"] = e

    thread = threading.Thread(target=join, daemon=True)
    thread.start()
    return thread, outcome


def test_engine_join_returns_only_after_the_warm_up_and_fails_without_it() -> None:
    """The engine's JoinWeightGroup includes the first broadcast (NCCL's communicator is made there), so an
    engine that joined has received; a trainer side that never broadcasts fails the join by the timeout."""
    from everstep.v1 import rollout_pb2

    for warm in (True, False):
        timeout = datetime.timedelta(seconds=3)
        store = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=timeout, wait_for_workers=False)
        name = f"everstep-weights-warm-{warm}"
        request = rollout_pb2.JoinWeightGroupRequest(group=name, backend="gloo", rank=1, world_size=2,
                                                     store_address=f"127.0.0.1:{store.port}", timeout_seconds=3)
        thread, outcome = _join_in_thread(request)
        group = process_group.new_group("gloo", store, group_name=name, rank=0, world_size=2, timeout=timeout)
        if warm:
            process_group.warm_up(group, device=torch.device("cpu"), timeout=timeout)
        thread.join(30)
        assert not thread.is_alive()
        if warm:
            assert "member" in outcome, outcome
            flat = torch.arange(8, dtype=torch.uint8)
            work = group.broadcast(flat, 0)
            assert outcome["member"].receive(8, "cpu").tolist() == list(range(8))
            work.wait()
            outcome["member"].shutdown()
        else:
            assert isinstance(outcome.get("error"), RuntimeError), outcome
        process_group.shutdown_group(group)
