"""A trainer of two nodes (two torchrun nodes of one CPU rank each, static rendezvous at node 0), over real gRPC:
its steps, checkpoint and resume match one rank trained in this process.

Two variants: the local launcher's (`resources.trainer.replicas: 2`, both nodes on loopback), and, where this
machine lets us (root, `ip netns`), node 1 in a network namespace of its own joined to this one by a veth pair, so
that the rendezvous and every gloo message cross a real interface.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from distributed_check import UPDATE_TOLERANCE, check_batches, relative_update_difference
from network_namespaces import netns_unavailable
from safetensors.torch import load_file

from everstep.processes import free_port
from everstep.rest.job_spec import ResourcesSpec, WorkerResources
from everstep.v1 import trainer_pb2, trainer_pb2_grpc
from everstep_controller.launchers.base import WorkerRequest
from everstep_controller.launchers.local import LocalLauncher
from everstep_trainer.server import config_from_proto
from everstep_trainer.step.trainer import PolicyTrainer

pytestmark = pytest.mark.slow


def _to_proto(batch) -> trainer_pb2.TrainStepRequest:
    return trainer_pb2.TrainStepRequest(samples=[
        trainer_pb2.TrainSample(prompt_ids=s.prompt_ids, output_ids=s.output_ids,
                                rollout_logprobs=s.rollout_logprobs, advantage=s.advantage) for s in batch])


def _check_two_nodes_match_one_rank(grpc_address: str, model_dir: Path, tmp_path: Path) -> None:
    config = trainer_pb2.TrainerConfig(learning_rate=1e-3, num_minibatches=2, micro_batch_tokens=16)
    batches = check_batches(51, num_steps=2)
    local = PolicyTrainer(model_dir, config_from_proto(config))
    initial = {n: t.clone() for n, t in local.full_state_dict().items()}
    _, local_first = local.train_step(batches[0])
    after_first = {n: t.clone() for n, t in local.full_state_dict().items()}
    _, local_second = local.train_step(batches[1])
    after_second = {n: t.clone() for n, t in local.full_state_dict().items()}

    with grpc.insecure_channel(grpc_address) as channel:
        stub = trainer_pb2_grpc.TrainerStub(channel)
        loaded = stub.Load(trainer_pb2.TrainerLoadRequest(model_path=str(model_dir), config=config), timeout=120)
        assert loaded.num_parameters == local.num_parameters
        first = stub.TrainStep(_to_proto(batches[0]), timeout=180)
        assert first.version == 1 and first.stats.num_tokens == local_first.num_tokens
        assert first.stats.loss == pytest.approx(local_first.loss, rel=1e-5)
        assert first.stats.grad_norm == pytest.approx(local_first.grad_norm, rel=1e-5)
        step_one = tmp_path / "step-1"
        saved = stub.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(path=str(step_one), data_position="cursor=5"),
                                    timeout=120)
        assert (saved.version, saved.train_step) == (1, 1)
        second = stub.TrainStep(_to_proto(batches[1]), timeout=180)
        assert second.stats.loss == pytest.approx(local_second.loss, rel=1e-5)
        assert second.stats.grad_norm == pytest.approx(local_second.grad_norm, rel=1e-5)
        step_two = tmp_path / "step-2"
        stub.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(path=str(step_two)), timeout=120)

        resumed = stub.LoadCheckpoint(trainer_pb2.LoadCheckpointRequest(path=str(step_one)), timeout=120)
        assert (resumed.version, resumed.train_step, resumed.data_position) == (1, 1, "cursor=5")
        again = stub.TrainStep(_to_proto(batches[1]), timeout=180)
        assert again.version == 2 and again.stats.loss == pytest.approx(second.stats.loss, rel=1e-6)

    assert relative_update_difference(initial, after_first, load_file(step_one / "model.safetensors")) \
        < UPDATE_TOLERANCE
    assert relative_update_difference(initial, after_second, load_file(step_two / "model.safetensors")) \
        < UPDATE_TOLERANCE


def test_local_launcher_trainer_of_two_nodes_matches_one_rank(tiny_model_dir: Path, tmp_path: Path) -> None:
    launcher = LocalLauncher(work_dir=tmp_path / "work", threads_per_worker=1, ready_timeout_seconds=240)
    request = WorkerRequest(job_id="nodes", max_running=2, max_seq_len=64,
                            resources=ResourcesSpec(trainer=WorkerResources(replicas=2)))
    try:
        workers = launcher.launch(request)
        assert [p.name for p in workers.processes] == ["rollout", "trainer", "trainer-node-1"]
        assert workers.trainer == next(f"127.0.0.1:{p.grpc_port}" for p in workers.processes if p.name == "trainer")
        _check_two_nodes_match_one_rank(workers.trainer, tiny_model_dir, tmp_path)
        assert launcher.alive(workers)
        logs = {p.name: Path(p.log_path).read_text() for p in workers.processes}
        assert "rank1" in logs["trainer-node-1"] and "rank 1 of 2 joined" in logs["trainer-node-1"]

        # A lost follower takes the whole trainer with it: both nodes start anew, the engine keeps serving.
        pids = {p.name: p.pid for p in workers.processes}
        os.killpg(pids["trainer-node-1"], signal.SIGKILL)
        os.waitpid(pids["trainer-node-1"], 0)  # the launcher started it from this process: reap it
        assert not launcher.alive(workers)
        replaced, renewed = launcher.replace(workers, request, set())
        assert renewed == {"trainer"}
        new_pids = {p.name: p.pid for p in replaced.processes}
        assert new_pids["rollout"] == pids["rollout"]
        assert new_pids["trainer"] != pids["trainer"] and new_pids["trainer-node-1"] != pids["trainer-node-1"]
        with grpc.insecure_channel(replaced.trainer) as channel:
            config = trainer_pb2.TrainerConfig(learning_rate=1e-3)
            trainer_pb2_grpc.TrainerStub(channel).Load(
                trainer_pb2.TrainerLoadRequest(model_path=str(tiny_model_dir), config=config), timeout=120)
        assert launcher.alive(replaced)
    finally:
        launcher.close()




def _received_bytes(interface: str) -> int:
    return int(Path(f"/sys/class/net/{interface}/statistics/rx_bytes").read_text())


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@pytest.fixture
def veth_namespace() -> Iterator[tuple[str, str, str, str]]:
    """A network namespace joined to this one by a veth pair: (namespace, this end's interface and address,
    the namespace end's interface and address) as (namespace, here_if:here_addr, there_if, there_addr)."""
    reason = netns_unavailable() if sys.platform.startswith("linux") else "network namespaces are Linux only"
    if reason:
        pytest.skip(reason)
    tag = uuid.uuid4().hex[:6]
    namespace, here, there = f"everstep-node1-{tag}", f"esh{tag}", f"esn{tag}"
    subnet = 10 + int(tag[:2], 16) % 200  # 10.213.<subnet>.0/24, unlikely to meet a real route
    here_addr, there_addr = f"10.213.{subnet}.1", f"10.213.{subnet}.2"
    _ip("netns", "add", namespace)
    try:
        _ip("link", "add", here, "type", "veth", "peer", "name", there)
        _ip("link", "set", there, "netns", namespace)
        _ip("addr", "add", f"{here_addr}/24", "dev", here)
        _ip("link", "set", here, "up")
        _ip("-n", namespace, "addr", "add", f"{there_addr}/24", "dev", there)
        _ip("-n", namespace, "link", "set", there, "up")
        _ip("-n", namespace, "link", "set", "lo", "up")
        yield namespace, here, here_addr, there
    finally:
        subprocess.run(["ip", "link", "del", here], capture_output=True)
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True)


def test_trainer_of_two_nodes_across_a_veth_pair_matches_one_rank(
        veth_namespace: tuple[str, str, str, str], service_process: Callable, tiny_model_dir: Path,
        tmp_path: Path) -> None:
    """Node 0 in this namespace, node 1 in its own: gloo binds each rank to its end of the pair
    (GLOO_SOCKET_IFNAME), so no message between them can take the loopback."""
    namespace, here, here_addr, there = veth_namespace
    rendezvous = ["--nnodes", "2", "--master-addr", here_addr, "--master-port", str(free_port())]
    node_log = tmp_path / "trainer-node-1.log"
    with node_log.open("w") as log:
        follower = subprocess.Popen(
            ["ip", "netns", "exec", namespace, sys.executable, "-m", "everstep_trainer", "--node-rank", "1",
             *rendezvous], stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "GLOO_SOCKET_IFNAME": there, "OMP_NUM_THREADS": "1"})
    try:
        trainer = service_process("trainer", "--node-rank", "0", *rendezvous, ready_timeout_seconds=240,
                                  env={"GLOO_SOCKET_IFNAME": here, "OMP_NUM_THREADS": "1"})
        received_before = _received_bytes(here)
        _check_two_nodes_match_one_rank(trainer.grpc_address, tiny_model_dir, tmp_path)
        received = _received_bytes(here) - received_before
        assert received > 100_000, f"only {received} bytes came over {here}: the ranks did not talk through it"
        assert follower.poll() is None, node_log.read_text()
        assert "rank 1 of 2 joined" in node_log.read_text()
    finally:
        if follower.poll() is None:
            os.killpg(follower.pid, signal.SIGTERM)
            try:
                follower.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(follower.pid, signal.SIGKILL)
                follower.wait()
