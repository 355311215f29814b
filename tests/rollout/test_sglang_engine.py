"""The sglang engine: its selection, and its request bookkeeping against a stand-in for sglang.

sglang needs a CUDA GPU and is not installed here, so `SglangStandIn` plays `sglang.Engine` (0.5.3, the
pinned version) with the parts of its offline API that `SglangEngine` uses, including how they use event
loops, which is where a first GPU run would break:

- like sglang's Engine it has no loop attribute: its sync methods (`update_weights_from_tensor`) run
  `asyncio.get_event_loop().run_until_complete(...)` on the calling thread's loop;
- `tokenizer_manager.abort_request` plays sglang's, which returns at once for an unknown rid and
  otherwise sends on a `zmq.asyncio` socket: pyzmq's send makes an `asyncio.Future`, so without a current
  loop it raises RuntimeError ("There is no current event loop in thread ..."), which the stand-in
  raises the same way (`ZmqAsyncSendStandIn`);
- `tokenizer_manager.generate_request(GenerateReqInputStandIn(..., rid=...), None)` is an async generator
  of cumulative chunks with `meta_info.output_token_logprobs`, as sglang's (0.5.3's `Engine.async_generate`
  takes no rid, so the engine builds the request itself; the stand-in has no async_generate at all);
- `update_weights_from_tensor` refuses to flush its cache while requests run, and pickles the tensors
  with torch's ForkingPickler as sglang's MultiprocessingSerializer does; torch's refusal to re-share a
  CUDA tensor received from another process cannot happen on a CPU, so the stand-in raises torch's
  message for tensors `everstep.tensors.cuda_ipc` marked as received (`TorchReshareRefusalStandIn`).

Its "model" is a deterministic function of the tokens so far and a weight offset. The engine is driven
from a thread of its own, as `EngineLoop` drives it. These tests check our adapter, not sglang.
"""

from __future__ import annotations

import asyncio
import importlib.util
import io
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler  # what sglang's MultiprocessingSerializer uses
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.multiprocessing  # noqa: F401 - registers torch's tensor reductions with ForkingPickler

from everstep.tensors import cuda_ipc
from everstep_rollout.engine import EngineUnavailableError, QueueFullError, build_engine
from everstep_rollout.engine.sglang_engine import SglangEngine
from everstep_rollout.sequence import FinishReason, GenerationRequest, SamplingOptions, SequenceResult

SGLANG_INSTALLED = importlib.util.find_spec("sglang") is not None


def next_token(tokens: list[int], offset: int) -> int:
    return (tokens[-1] * 7 + len(tokens) + offset) % 40 + 4  # never EOS (2)


def expected_output(prompt: list[int], num_tokens: int, offset: int = 0) -> list[int]:
    tokens = list(prompt)
    for _ in range(num_tokens):
        tokens.append(next_token(tokens, offset))
    return tokens[len(prompt) :]


def zmq_async_send_stand_in() -> asyncio.AbstractEventLoop:
    """ZmqAsyncSendStandIn: what pyzmq's asyncio `send` needs, the loop its Future is made on.

    pyzmq: `_get_loop` tries `asyncio.get_running_loop()`, falls back to `asyncio.get_event_loop()`;
    `asyncio.Future()` does the same. On a thread with neither, that raises RuntimeError."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.get_event_loop()  # raises "There is no current event loop in thread ..." here


def torch_reshare_refusal_stand_in(tensor: torch.Tensor) -> None:
    """TorchReshareRefusalStandIn: torch's error when a CUDA tensor received by IPC is shared again."""
    if cuda_ipc.received_by_cuda_ipc(tensor):
        raise RuntimeError("Attempted to send CUDA tensor received from another process; this is not currently "
                           "supported. Consider cloning before sending.")


@dataclass(kw_only=True)
class GenerateReqInputStandIn:
    """Stand-in for sglang's `GenerateReqInput` (the fields the engine sets; `rid` is kw-only in BaseReq)."""

    input_ids: list[int]
    sampling_params: dict
    return_logprob: bool = False
    stream: bool = False
    rid: str | None = None


class SglangStandIn:
    """Stand-in for `sglang.Engine` (see the module docstring); one token per millisecond per request."""

    def __init__(self) -> None:
        self.offset = 0
        self.active: set[str] = set()
        self.aborted: set[str] = set()
        self.inputs: dict[str, list[int]] = {}
        self.sampling_params: dict[str, dict] = {}
        self.loops: set[int] = set()
        self.tokenizer_manager = SimpleNamespace(abort_request=self._abort_request,
                                                 generate_request=self._generate_request)
        self.shut_down = False
        self.received_tensors: list[torch.Tensor] = []

    def _abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        if not abort_all and rid not in self.active:
            return  # sglang: `rid not in self.rid_to_state`
        self.loops.add(id(zmq_async_send_stand_in()))
        self.aborted.add(rid)

    async def _generate_request(self, obj: GenerateReqInputStandIn, request=None):
        assert isinstance(obj, GenerateReqInputStandIn) and obj.return_logprob and obj.stream and obj.rid
        rid, tokens, max_new_tokens = obj.rid, list(obj.input_ids), obj.sampling_params["max_new_tokens"]
        self.loops.add(id(asyncio.get_running_loop()))
        await asyncio.sleep(0)  # sglang tokenizes (awaits) before it registers the rid that aborts look up
        self.inputs[rid] = list(tokens)
        self.sampling_params[rid] = dict(obj.sampling_params)
        self.active.add(rid)
        triples: list[tuple[float, int, None]] = []
        try:
            while True:
                await asyncio.sleep(0.001)
                if rid in self.aborted:
                    yield self._chunk(rid, triples, {"type": "abort", "message": "aborted"})
                    return
                token = next_token(tokens, self.offset)
                tokens.append(token)
                triples.append((-0.01 * token, token, None))
                done = len(triples) == max_new_tokens
                yield self._chunk(rid, triples, {"type": "length", "length": len(triples)} if done else None)
                if done:
                    return
        finally:
            self.active.discard(rid)

    @staticmethod
    def _chunk(rid, triples, finish_reason):
        return {"text": "", "meta_info": {"id": rid, "finish_reason": finish_reason, "completion_tokens":
                                          len(triples), "output_token_logprobs": list(triples)}}

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        for _, tensor in named_tensors:
            torch_reshare_refusal_stand_in(tensor)
        ForkingPickler(io.BytesIO()).dump(named_tensors)  # sglang's MultiprocessingSerializer.serialize
        loop = asyncio.get_event_loop()  # as sglang's Engine: the calling thread's loop

        async def update():
            self.loops.add(id(asyncio.get_running_loop()))
            if self.active:
                return False, f"cannot flush the cache: {len(self.active)} requests running"
            self.received_tensors = [t for _, t in named_tensors]
            self.offset = int(dict(named_tensors)["offset"].item())
            return True, "ok"

        return loop.run_until_complete(update())

    def shutdown(self) -> None:
        self.shut_down = True


def on_thread(call: Callable[[], Any]) -> Any:
    """Run `call` on a fresh thread (no event loop), as EngineLoop's thread runs the engine."""
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = call()
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            outcome["error"] = e

    thread = threading.Thread(target=target)
    thread.start()
    thread.join(60)
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


@pytest.fixture
def engine(tiny_model_dir):
    from everstep_rollout.config import EngineConfig

    stand_in = SglangStandIn()
    engine = SglangEngine(tiny_model_dir, EngineConfig(engine="sglang", max_running=4, max_queued=2),
                          sglang_engine=stand_in, request_type=GenerateReqInputStandIn)
    yield engine
    engine.shutdown()
    assert stand_in.shut_down


def run(engine: SglangEngine) -> dict[str, SequenceResult]:
    results: dict[str, SequenceResult] = {}
    for _ in range(10_000):
        if not engine.has_work:
            return results
        for r in engine.step():
            assert r.id not in results
            results[r.id] = r
    raise AssertionError("engine did not finish")


PROMPTS = {"a": [1, 5, 6], "b": [1, 9], "c": [1, 20, 21, 22]}


def test_generates_drains_and_continues(engine):
    sampling = SamplingOptions(temperature=1.0, max_new_tokens=30)
    engine.add(GenerationRequest(id=k, prompt_ids=p, sampling=sampling) for k, p in PROMPTS.items())
    engine.step()
    engine.step()
    partials = engine.drain()
    assert not engine.has_work and {p.finish_reason for p in partials} == {FinishReason.ABORTED}
    assert all(len(p.output_ids) < 30 for p in partials) and any(p.output_ids for p in partials)
    for p in partials:
        assert p.output_ids == expected_output(p.prompt_ids, len(p.output_ids))
    engine.add(GenerationRequest(id=p.id, prompt_ids=p.prompt_ids, output_ids=p.output_ids,
                                 output_logprobs=p.output_logprobs, output_versions=p.output_versions,
                                 sampling=sampling) for p in partials)
    results = run(engine)
    for key, prompt in PROMPTS.items():
        r = results[key]
        assert r.finish_reason == FinishReason.LENGTH
        assert r.output_ids == expected_output(prompt, 30)
        assert r.output_logprobs == pytest.approx([-0.01 * t for t in r.output_ids])
        assert r.output_versions == [0] * 30


def test_min_p_and_penalties_reach_sglang_under_its_names(tiny_model_dir):
    from everstep_rollout.config import EngineConfig

    stand_in = SglangStandIn()
    engine = SglangEngine(tiny_model_dir, EngineConfig(engine="sglang", max_running=4, max_queued=2),
                          sglang_engine=stand_in, request_type=GenerateReqInputStandIn)
    try:
        penalized = SamplingOptions(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=3, min_p=0.05,
                                    repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=-0.25)
        engine.add([GenerationRequest(id="p", prompt_ids=PROMPTS["a"], sampling=penalized),
                    GenerationRequest(id="plain", prompt_ids=PROMPTS["b"],
                                      sampling=SamplingOptions(temperature=1.0, max_new_tokens=3))])
        run(engine)
    finally:
        engine.shutdown()
    [p, plain] = sorted(stand_in.sampling_params.values(), key=len, reverse=True)
    assert p == {"temperature": 0.7, "top_p": 0.9, "top_k": 20, "max_new_tokens": 3, "min_p": 0.05,
                 "repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": -0.25}
    assert plain == {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 3}  # sglang's defaults


def test_drain_right_after_add_aborts_requests_sglang_has_not_registered_yet(engine):
    """No step between add and drain: the abort reaches sglang before the request does, and is repeated."""
    sampling = SamplingOptions(temperature=1.0, max_new_tokens=2000)
    engine.add([GenerationRequest(id="a", prompt_ids=PROMPTS["a"], sampling=sampling)])
    [partial] = engine.drain()
    assert partial.finish_reason == FinishReason.ABORTED and len(partial.output_ids) < 2000


def test_weight_update_continues_running_requests_under_the_new_version(engine):
    sampling = SamplingOptions(temperature=1.0, max_new_tokens=40)
    engine.add([GenerationRequest(id="a", prompt_ids=PROMPTS["a"], sampling=sampling)])
    generated = 0
    while not generated:
        engine.step()
        generated += engine.last_step.num_decoded
    engine.update_weights({"offset": torch.tensor([5])}, version=1)
    result = run(engine)["a"]
    old = result.output_versions.count(0)
    assert 0 < old < 40 and result.output_versions == [0] * old + [1] * (40 - old)
    head = result.output_ids[:old]
    assert head == expected_output(PROMPTS["a"], old, offset=0)
    assert result.output_ids[old:] == expected_output(PROMPTS["a"] + head, 40 - old, offset=5)


def test_queue_is_bounded(engine):
    sampling = SamplingOptions(max_new_tokens=5)
    engine.add(GenerationRequest(id=f"q{i}", prompt_ids=[1, 5], sampling=sampling) for i in range(6))
    with pytest.raises(QueueFullError, match="queue full"):
        engine.add([GenerationRequest(id="late", prompt_ids=[1, 5], sampling=sampling)])
    with pytest.raises(ValueError, match="already in flight"):
        engine.add([GenerationRequest(id="q0", prompt_ids=[1, 5], sampling=sampling)])
    assert len(run(engine)) == 6


def test_stand_in_abort_and_sync_calls_fail_without_a_loop_as_sglang_does():
    """The stand-in reproduces the failure an engine-loop thread hit before the fix (its test can fail)."""
    stand_in = SglangStandIn()
    stand_in.active.add("r1")
    with pytest.raises(RuntimeError, match="event loop"):
        on_thread(lambda: stand_in.tokenizer_manager.abort_request(rid="r1"))
    with pytest.raises(RuntimeError, match="event loop"):
        on_thread(lambda: stand_in.update_weights_from_tensor([("offset", torch.tensor([1]))]))
    marked = cuda_ipc.mark_received(torch.tensor([1]))
    with pytest.raises(RuntimeError, match="received from another process"):
        stand_in.update_weights_from_tensor([("offset", marked)])


def test_drain_and_update_from_the_engine_loop_thread_run_on_the_engine_loop(tiny_model_dir):
    """Drain (abort) and update_weights on a thread without an event loop, as EngineLoop's thread is."""
    from everstep_rollout.config import EngineConfig

    stand_in = SglangStandIn()
    engine = on_thread(lambda: SglangEngine(tiny_model_dir, EngineConfig(engine="sglang", max_running=4),
                                            sglang_engine=stand_in, request_type=GenerateReqInputStandIn))
    sampling = SamplingOptions(temperature=1.0, max_new_tokens=50)

    def start_and_drain() -> list[SequenceResult]:
        engine.add(GenerationRequest(id=k, prompt_ids=p, sampling=sampling) for k, p in PROMPTS.items())
        for _ in range(3):
            engine.step()
        return engine.drain()

    partials = on_thread(start_and_drain)
    assert {p.finish_reason for p in partials} == {FinishReason.ABORTED} and stand_in.aborted
    # long enough (the stand-in makes a token per ms) that "a" is still running through both updates, whose
    # aborts may wait a retry (50 ms) for a request sglang has not registered yet
    long = SamplingOptions(temperature=1.0, max_new_tokens=400)
    engine.add([GenerationRequest(id="a", prompt_ids=PROMPTS["a"], sampling=long)])
    on_thread(engine.step)
    # A tensor that came by CUDA IPC is cloned before sglang re-shares it; an owned one is passed as it is.
    received = cuda_ipc.mark_received(torch.tensor([5]))
    on_thread(lambda: engine.update_weights({"offset": received}, version=1))
    assert stand_in.offset == 5 and stand_in.received_tensors[0] is not received
    owned = torch.tensor([6])
    on_thread(lambda: engine.update_weights({"offset": owned}, version=2))
    assert stand_in.received_tensors[0] is owned
    result = on_thread(lambda: run(engine))["a"]
    assert result.output_versions[-1] == 2 and len(result.output_ids) == 400
    assert len(stand_in.loops) == 1  # every sglang call ran on the engine's one loop
    on_thread(engine.shutdown)
    assert stand_in.shut_down


def test_sglang_arguments_carry_mem_fraction_static_and_the_gpu(tiny_model_dir):
    from everstep_rollout.config import EngineConfig

    def arguments(**fields) -> dict:
        engine = SglangEngine(tiny_model_dir, EngineConfig(engine="sglang", **fields), sglang_engine=SglangStandIn(),
                              request_type=GenerateReqInputStandIn)
        try:
            return engine.sglang_arguments()
        finally:
            engine.shutdown()

    assert "mem_fraction_static" not in arguments()  # 0: sglang's own default
    chosen = arguments(mem_fraction_static=0.35, device="cuda:1", max_running=16)
    assert chosen["mem_fraction_static"] == 0.35 and chosen["base_gpu_id"] == 1
    assert chosen["max_running_requests"] == 16 and chosen["model_path"] == str(tiny_model_dir)
    with pytest.raises(ValueError, match="mem_fraction_static"):
        EngineConfig(engine="sglang", mem_fraction_static=1.5)


@pytest.mark.skipif(SGLANG_INSTALLED, reason="checks the message shown when sglang is missing")
def test_missing_sglang_names_its_environment(tiny_model_dir, free_port):
    from everstep_rollout.config import EngineConfig

    with pytest.raises(EngineUnavailableError, match=r"make sglang-venv"):
        build_engine(tiny_model_dir, EngineConfig(engine="sglang"))
    # The server refuses to start with it, saying why.
    process = subprocess.run(
        [sys.executable, "-m", "everstep_rollout", "--port", str(free_port), "--grpc-port", "0", "--engine",
         "sglang", "--model", str(tiny_model_dir)], capture_output=True, text=True, timeout=120,
    )
    assert process.returncode == 2
    assert "engine 'sglang' needs the sglang package" in process.stderr
    assert "make sglang-venv" in process.stderr


def test_second_load_stops_the_old_engine_before_building_the_new_one(tiny_model_dir, monkeypatch):
    """Two sglang engines would not fit one GPU: the old one is shut down before the next is built."""
    from everstep_rollout import server
    from everstep_rollout.config import EngineConfig

    built: list[SglangStandIn] = []
    running_at_build: list[int] = []

    def build_engine_stand_in(model_path, config):
        running_at_build.append(sum(not s.shut_down for s in built))
        built.append(SglangStandIn())
        return SglangEngine(model_path, config, sglang_engine=built[-1], request_type=GenerateReqInputStandIn)

    monkeypatch.setattr(server, "build_engine", build_engine_stand_in)
    servicer = server.RolloutServicer(EngineConfig(engine="sglang"))
    try:
        servicer.load(str(tiny_model_dir))
        servicer.load(str(tiny_model_dir), version=2)
        assert running_at_build == [0, 0] and built[0].shut_down and not built[1].shut_down
        assert servicer.status().version == 2
    finally:
        servicer.shutdown()
    assert built[1].shut_down


def test_sglang_signal_registration_is_skipped_off_the_main_thread():
    """sglang's launch calls signal.signal(SIGQUIT, ...), which only the main thread may; a Load builds the
    engine on a gRPC thread. `launch_stand_in` plays that one call of sglang's `_set_envs_and_config`."""
    import signal

    from everstep_rollout.engine.sglang_api import signal_handlers_skipped_off_main_thread

    def launch_stand_in() -> None:
        signal.signal(signal.SIGQUIT, lambda *_: None)

    with pytest.raises(ValueError, match="main thread"):
        on_thread(launch_stand_in)  # what a Load would hit without the guard

    def guarded() -> None:
        with signal_handlers_skipped_off_main_thread():
            launch_stand_in()

    before = signal.getsignal(signal.SIGQUIT)
    on_thread(guarded)
    assert signal.getsignal(signal.SIGQUIT) is before and signal.signal.__module__ in ("signal", "_signal")
    previous = signal.getsignal(signal.SIGQUIT)
    try:
        with signal_handlers_skipped_off_main_thread():  # on the main thread: the real registration
            launch_stand_in()
        assert signal.getsignal(signal.SIGQUIT) is not previous
    finally:
        signal.signal(signal.SIGQUIT, previous)
