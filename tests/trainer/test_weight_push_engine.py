"""Weight pushes into real rollout server processes, over shm, chunked gRPC and a gloo broadcast group.

Each push sends perturbed weights; the engine must then generate exactly as a Hugging Face model
holding those weights (per-token log-probs compared), tagged with the pushed version.
"""

from __future__ import annotations

import functools
import os
import signal
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from safetensors.torch import load_file

from everstep.processes import ManagedProcess, free_port, spawn, stop_processes, wait_grpc_serving
from everstep.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
from everstep_trainer.weight_push import Transport, WeightPusher, WeightPushError, make_transport
from everstep_trainer.weight_push.shm import SEGMENT_PREFIX, SHM_DIR

PROMPTS = [[1, 5, 4, 7, 6], [1, 20, 5, 30, 6]]


def _launch(model_dir: Path, log_path: Path) -> ManagedProcess:
    http_port, grpc_port = free_port(), free_port()
    return spawn("rollout", ["-m", "everstep_rollout", "--host", "127.0.0.1", "--port", str(http_port),
                             "--grpc-port", str(grpc_port), "--model", str(model_dir), "--max-running", "4",
                             "--num-threads", "1"], log_path, http_port=http_port, grpc_port=grpc_port)


def _metrics_url(engine: ManagedProcess) -> str:
    return f"http://127.0.0.1:{engine.http_port}/metrics"


@pytest.fixture(scope="module")
def engines(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[ManagedProcess]]:
    """Two rollout servers with the tiny model, started together and shared by this module's tests."""
    log_dir = tmp_path_factory.mktemp("engines")
    started = [_launch(tiny_model_dir, log_dir / f"rollout-{i}.log") for i in range(2)]
    try:
        for engine in started:
            wait_grpc_serving(engine, 120)
        yield started
    finally:
        stop_processes(started)


def perturbed_weights(model_dir: Path, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=generator)
            for k, v in load_file(str(model_dir / "model.safetensors")).items()}


@functools.cache
def hf_model(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@torch.inference_mode()
def assert_engine_runs(address: str, model_dir: Path, weights: dict[str, torch.Tensor], version: int) -> None:
    """Greedy outputs of the engine carry `version` and the log-probs of a HF model holding `weights`."""
    request = rollout_pb2.GenerateRequest(
        sequences=[common_pb2.Sequence(id=f"p{i}", prompt_ids=p) for i, p in enumerate(PROMPTS)],
        sampling=common_pb2.SamplingParams(temperature=0.0, max_new_tokens=6))
    with grpc.insecure_channel(address) as channel:
        stub = rollout_pb2_grpc.RolloutStub(channel)
        results = [s for r in stub.Generate(iter([request]), timeout=60) for s in r.sequences]
        assert stub.GetStatus(rollout_pb2.GetStatusRequest()).version == version
    model = hf_model(model_dir)
    model.load_state_dict(weights)
    for sequence in results:
        assert set(sequence.output_versions) == {version}
        ids = torch.tensor([list(sequence.prompt_ids) + list(sequence.output_ids)])
        logits = model(ids).logits[0, len(sequence.prompt_ids) - 1 : -1]
        expected = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(sequence.output_ids)[:, None]).squeeze(1)
        torch.testing.assert_close(torch.tensor(list(sequence.output_logprobs)), expected, atol=2e-4, rtol=0)


def in_model_order(model_dir: Path, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`weights` in the order a trainer's state dict has them (q, k, v one after another), not the file's."""
    return {name: weights[name] for name in hf_model(model_dir).state_dict() if name in weights}


def segments_of_this_process() -> list[str]:
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(f"{SEGMENT_PREFIX}{os.getpid()}-"))


def test_shm_push_reaches_the_engine_and_keeps_one_warm_segment_without_one_copy(engines, tiny_model_dir) -> None:
    engine = engines[0]
    pusher = WeightPusher(shm_one_copy=False)  # auto: the engine reports this host's /dev/shm
    try:
        weights = perturbed_weights(tiny_model_dir, seed=1)
        report = pusher.push(weights.items(), version=11, endpoints=[engine.grpc_address])
        assert report.transports == {engine.grpc_address: "shm"}
        assert report.num_bytes == sum(t.numel() * t.element_size() for t in weights.values())
        assert [r.num_kept_in_place for r in report.results] == [0]  # the engine copied out of the segment
        assert_engine_runs(engine.grpc_address, tiny_model_dir, weights, 11)
        (kept,) = segments_of_this_process()

        weights = perturbed_weights(tiny_model_dir, seed=2)
        pusher.push(weights.items(), version=12, endpoints=[engine.grpc_address])
        assert_engine_runs(engine.grpc_address, tiny_model_dir, weights, 12)
        assert segments_of_this_process() == [kept]  # reused, warm
    finally:
        pusher.close()
    assert segments_of_this_process() == []
    metrics = urllib.request.urlopen(_metrics_url(engine), timeout=10).read().decode()
    assert 'everstep_rollout_weight_update_bytes_total{transport="shm"}' in metrics
    assert 'everstep_rollout_weight_update_seconds_count{transport="shm"}' in metrics


def test_one_copy_shm_pushes_alternate_two_segments_the_engine_runs_on(engines, tiny_model_dir) -> None:
    engine = engines[0].grpc_address
    transport = make_transport("shm", bucket_bytes=4096)  # one_copy by default; small buckets: many messages
    try:
        names: list[str] = []
        for i, seed in enumerate((51, 52, 53, 54)):
            weights = in_model_order(tiny_model_dir, perturbed_weights(tiny_model_dir, seed=seed))
            result = transport.push(weights.items(), version=50 + i, endpoints=[engine])
            assert result.num_kept_in_place == 1  # no copy on the engine's side
            assert_engine_runs(engine, tiny_model_dir, weights, 50 + i)
            names.append(transport.segment.name)
        assert names[0] == names[2] and names[1] == names[3] and names[0] != names[1]
        assert sorted(segments_of_this_process()) == sorted(names[:2])

        # The engine runs on the segment itself: scribbling on it (which a trainer never does to the segment
        # an engine holds) changes what the engine computes; the next push puts it right.
        held = transport.segment
        assert held is not None
        original = held.buffer.clone()
        held.buffer[: held.num_bytes // 2].zero_()
        with pytest.raises(AssertionError):
            assert_engine_runs(engine, tiny_model_dir, weights, 53)
        held.buffer.copy_(original)
        assert_engine_runs(engine, tiny_model_dir, weights, 53)
    finally:
        transport.close()
    assert segments_of_this_process() == []
    assert_engine_runs(engine, tiny_model_dir, weights, 53)  # its mapping outlives the trainer's name


def test_one_copy_never_rewrites_a_segment_another_engine_runs_on(engines, tiny_model_dir) -> None:
    first, second = (e.grpc_address for e in engines)
    transport = make_transport("shm")
    grpc_transport = make_transport("grpc")
    try:
        both = in_model_order(tiny_model_dir, perturbed_weights(tiny_model_dir, seed=61))
        assert transport.push(both.items(), version=61, endpoints=[first, second]).num_kept_in_place == 2
        for version, seed in ((62, 62), (63, 63), (64, 64)):  # the first engine alone, several versions
            weights = in_model_order(tiny_model_dir, perturbed_weights(tiny_model_dir, seed=seed))
            assert transport.push(weights.items(), version=version, endpoints=[first]).num_kept_in_place == 1
            assert_engine_runs(first, tiny_model_dir, weights, version)
        # The second engine's segment was released (its name is gone, never written again), not rewritten.
        assert_engine_runs(second, tiny_model_dir, both, 61)
        assert len(segments_of_this_process()) == 2  # the first's, and one being reused

        # A copying update (gRPC) in between: the engine takes its weights back into its own memory first.
        weights = perturbed_weights(tiny_model_dir, seed=65)
        grpc_transport.push(weights.items(), version=65, endpoints=[first])
        assert_engine_runs(first, tiny_model_dir, weights, 65)
        partial = {k: v for k, v in perturbed_weights(tiny_model_dir, seed=66).items() if "layers.0." in k}
        grpc_transport.push(partial.items(), version=66, endpoints=[first])
        assert_engine_runs(first, tiny_model_dir, {**weights, **partial}, 66)
        for segment in transport.segments:  # the engine no longer reads any of them
            segment.buffer.zero_()
        assert_engine_runs(first, tiny_model_dir, {**weights, **partial}, 66)
    finally:
        transport.close()
        grpc_transport.close()


def test_a_pusher_dials_and_asks_each_engine_once_and_sends_one_message_once_the_engine_has_the_segment(
        engines, tiny_model_dir, monkeypatch) -> None:
    addresses = [e.grpc_address for e in engines]
    pusher = WeightPusher(setting="shm")
    transport = pusher.transport(Transport.SHM)
    streamed: list[int] = []  # pushes that sent the layout in buckets as the segment was written
    layout_in_buckets = transport._buckets  # the real method, counted
    monkeypatch.setattr(transport, "_buckets", lambda *args: streamed.append(1) or layout_in_buckets(*args))
    try:
        for version in (71, 72, 73, 74, 75):
            weights = in_model_order(tiny_model_dir, perturbed_weights(tiny_model_dir, seed=version))
            report = pusher.push(weights.items(), version=version, endpoints=addresses)
            assert report.transports == dict.fromkeys(addresses, "shm")
            assert [r.num_kept_in_place for r in report.results] == [2]
            for address in addresses:
                assert_engine_runs(address, tiny_model_dir, weights, version)
        # Two segments alternate: the first push through each streamed the layout (the engines mapped the segment
        # meanwhile); every later push wrote the segment, then sent one message to each engine.
        assert len(streamed) == 2
        # One channel per engine and one GetStatus each, for five pushes.
        assert (pusher.connections.num_dials, pusher.connections.num_probes) == (2, 2)
        assert all(pusher.connections.remembered(a) is not None for a in addresses)
    finally:
        pusher.close()
    assert segments_of_this_process() == []


def test_an_engine_whose_push_failed_is_dialed_and_asked_again(service_process, engines, tiny_model_dir) -> None:
    doomed = service_process("rollout", "--model", str(tiny_model_dir), "--num-threads", "1")
    survivor = engines[0].grpc_address
    pusher = WeightPusher(setting="shm")
    try:
        weights = in_model_order(tiny_model_dir, perturbed_weights(tiny_model_dir, seed=81))
        pusher.push(weights.items(), version=81, endpoints=[survivor, doomed.grpc_address])
        assert pusher.connections.remembered(doomed.grpc_address) is not None
        os.killpg(doomed.process.pid, signal.SIGKILL)
        doomed.process.wait(timeout=30)
        with pytest.raises(WeightPushError) as failed:
            pusher.push(weights.items(), version=82, endpoints=[survivor, doomed.grpc_address])
        assert list(failed.value.failures) == [doomed.grpc_address]
        assert pusher.connections.remembered(doomed.grpc_address) is None  # forgotten: asked again next time
        assert pusher.connections.remembered(survivor) is not None
        dials = pusher.connections.num_dials
        pusher.push(weights.items(), version=83, endpoints=[survivor])
        assert pusher.connections.num_dials == dials  # the survivor's channel was kept
        assert_engine_runs(survivor, tiny_model_dir, weights, 83)
    finally:
        pusher.close()
    assert segments_of_this_process() == []


def test_a_tensor_over_the_message_limit_is_chunked_and_reassembled_by_the_engine(engines, tiny_model_dir) -> None:
    engine = engines[0]
    weights = perturbed_weights(tiny_model_dir, seed=3)
    largest = max(t.numel() * t.element_size() for t in weights.values())
    limit = 8 * 1024
    assert largest > 2 * limit  # several tensors travel in chunks
    transport = make_transport("grpc", max_message_bytes=limit, bucket_bytes=4096)
    result = transport.push(weights.items(), version=21, endpoints=[engine.grpc_address])
    assert result.transport == "grpc"
    assert_engine_runs(engine.grpc_address, tiny_model_dir, weights, 21)


def test_gloo_group_broadcasts_to_every_engine_and_reforms_after_a_failure(engines, tiny_model_dir,
                                                                           free_port) -> None:
    addresses = [e.grpc_address for e in engines]
    pusher = WeightPusher(setting="gloo", group_host="127.0.0.1", bucket_bytes=16 * 1024, timeout_seconds=60)
    try:
        weights = perturbed_weights(tiny_model_dir, seed=4)
        report = pusher.push(weights.items(), version=31, endpoints=addresses)
        assert report.transports == dict.fromkeys(addresses, "gloo")
        for address in addresses:
            assert_engine_runs(address, tiny_model_dir, weights, 31)
        transport = pusher.transport("gloo")
        group = transport._group
        weights = perturbed_weights(tiny_model_dir, seed=5)
        pusher.push(weights.items(), version=32, endpoints=addresses)
        assert transport._group is group  # the group stays while the endpoints do
        assert_engine_runs(addresses[1], tiny_model_dir, weights, 32)
        # the joins and both pushes' layout messages went over one kept channel per engine
        assert pusher.connections.num_dials == len(addresses)

        dead = f"127.0.0.1:{free_port}"
        with pytest.raises(WeightPushError) as failure:
            pusher.push(weights.items(), version=33, endpoints=[addresses[0], dead])
        assert dead in failure.value.failures and transport._group is None
        weights = perturbed_weights(tiny_model_dir, seed=6)
        pusher.push(weights.items(), version=34, endpoints=[addresses[0]])  # a new group of two
        assert_engine_runs(addresses[0], tiny_model_dir, weights, 34)
        assert pusher.connections.num_dials == len(addresses) + 1  # the dead one's; the survivor's kept
    finally:
        pusher.close()


def test_an_engine_that_dies_around_a_push_leaves_no_segment(service_process, engines, tiny_model_dir) -> None:
    doomed = service_process("rollout", "--model", str(tiny_model_dir), "--num-threads", "1")
    survivor = engines[0].grpc_address
    transport = make_transport("shm", bucket_bytes=4096)
    weights = perturbed_weights(tiny_model_dir, seed=7)
    killer = threading.Timer(0.05, lambda: os.killpg(doomed.process.pid, signal.SIGKILL))
    killer.start()
    try:
        # The kill lands before, during or (rarely) after the first push; the second finds the engine dead.
        for version in (41, 42):
            try:
                transport.push(weights.items(), version=version, endpoints=[survivor, doomed.grpc_address])
            except WeightPushError as e:
                assert list(e.failures) == [doomed.grpc_address]
                break
            killer.join()
        else:
            pytest.fail("no push failed although the engine was killed")
        assert segments_of_this_process() == []  # a failed push frees its segment at once
        assert_engine_runs(survivor, tiny_model_dir, weights, version)  # the live engine got it all
    finally:
        killer.join()
        transport.close()
    assert segments_of_this_process() == []
