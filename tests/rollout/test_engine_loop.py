"""The background loop under concurrent submitters and drains: nothing lost, nothing duplicated."""

from __future__ import annotations

import queue
import random
import threading
import time

from everstep_rollout.config import EngineConfig
from everstep_rollout.engine import Engine, EngineLoop, Withdrawn
from everstep_rollout.sequence import FinishReason, GenerationRequest, SamplingOptions, SequenceResult

SAMPLING = SamplingOptions(temperature=0.0, max_new_tokens=12)


def prompts(n: int) -> dict[str, list[int]]:
    rng = random.Random(0)
    return {f"q{i}": [1] + [rng.randrange(4, 51) for _ in range(rng.randrange(1, 8))] for i in range(n)}


def continuation(p: SequenceResult, stream: int) -> GenerationRequest:
    return GenerationRequest(id=p.id, prompt_ids=p.prompt_ids, output_ids=p.output_ids,
                             output_logprobs=p.output_logprobs, output_versions=p.output_versions,
                             sampling=SAMPLING, stream=stream)


def test_concurrent_streams_with_drains_lose_nothing(tiny_model_dir):
    all_prompts = prompts(120)
    reference = Engine(tiny_model_dir, EngineConfig(max_running=64))
    reference.add(GenerationRequest(id=k, prompt_ids=v, sampling=SAMPLING) for k, v in all_prompts.items())
    expected: dict[str, list[int]] = {}
    while reference.has_work:
        expected.update({r.id: r.output_ids for r in reference.step()})

    loop = EngineLoop(Engine(tiny_model_dir, EngineConfig(max_running=16))).start()
    keys = sorted(all_prompts)
    num_streams = 4
    finished: dict[str, list[SequenceResult]] = {k: [] for k in keys}
    withdrawn_by_stream: dict[int, queue.Queue] = {}
    errors: list[BaseException] = []
    done = threading.Event()
    num_drained: list[int] = []

    def client(index: int) -> None:
        try:
            stream_id, events = loop.open_stream()
            withdrawn_by_stream[stream_id] = withdrawn = queue.Queue()
            mine = keys[index::num_streams]
            pending = set(mine)
            for start in range(0, len(mine), 5):
                batch = mine[start : start + 5]
                loop.submit(GenerationRequest(id=k, prompt_ids=all_prompts[k], sampling=SAMPLING, stream=stream_id)
                            for k in batch)
                if start % 10 == 0:
                    # Partials come back on the stream and are resubmitted below.
                    num_drained.append(loop.drain_stream(stream_id))
            deadline = time.monotonic() + 60
            while pending and time.monotonic() < deadline:
                try:
                    event = events.get(timeout=0.2)
                except queue.Empty:
                    continue
                if isinstance(event, Withdrawn):
                    continue  # the drainer thread resubmits these
                if event.finish_reason == FinishReason.ABORTED:
                    loop.submit([continuation(event, stream_id)])
                else:
                    finished[event.id].append(event)
                    pending.discard(event.id)
            withdrawn.put(None)
            loop.close_stream(stream_id)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    def drainer() -> None:
        while not done.is_set():
            time.sleep(0.05)
            partials = loop.drain_all()
            num_drained.append(len(partials))
            for p in partials:
                loop.submit([continuation(p, p.stream)])

    clients = [threading.Thread(target=client, args=(i,)) for i in range(num_streams)]
    drain_thread = threading.Thread(target=drainer)
    drain_thread.start()
    for t in clients:
        t.start()
    for t in clients:
        t.join(timeout=90)
    done.set()
    drain_thread.join(timeout=10)
    loop.stop()

    assert not errors, errors
    assert sum(num_drained) > 0, "no drain caught a sequence in flight"
    assert all(len(v) == 1 for v in finished.values()), {k: len(v) for k, v in finished.items() if len(v) != 1}
    for key, (result,) in finished.items():
        assert result.output_ids == expected[key], key
        assert len(result.output_logprobs) == len(result.output_versions) == len(result.output_ids)


def test_a_weight_update_runs_in_the_callers_thread_only_while_the_loop_is_idle(tiny_model_dir):
    """An idle loop: the update runs in the calling thread, and the status shows its version at once. A busy loop
    (sequences decoding): the update runs in the loop thread, between two steps, as every other operation."""
    engine = Engine(tiny_model_dir, EngineConfig(max_running=4))
    loop = EngineLoop(engine).start()
    ran_in: list[int] = []
    update = engine.update_weights

    def recording_update(*args, **kwargs):
        ran_in.append(threading.get_ident())
        return update(*args, **kwargs)

    engine.update_weights = recording_update
    try:
        deadline = time.monotonic() + 30
        while not loop._idle and time.monotonic() < deadline:
            time.sleep(0.01)
        weights = {"model.norm.weight": engine.weights.named["model.norm.weight"].clone()}
        loop.update_weights(weights, 5)
        assert ran_in == [threading.get_ident()] and loop.status().version == 5

        stream_id, events = loop.open_stream()
        long = SamplingOptions(temperature=0.0, max_new_tokens=200)
        loop.submit([GenerationRequest(id="busy", prompt_ids=[1, 5, 6], sampling=long, stream=stream_id)])
        loop.update_weights(weights, 6)
        assert ran_in[-1] == loop._thread.ident and engine.version == 6
        assert events.get(timeout=60).output_versions[-1] == 6  # finished on the new version
    finally:
        loop.stop()
