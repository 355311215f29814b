"""Prompt sharing in the torch engine (`EngineConfig.share_prompt_prefill`): G copies of a prompt admitted together are
prefilled once and decode on their own; the results equal those of an engine that prefills every copy.

Tiny random models of three architectures (`tiny_model_dirs`); the reference is the same engine with sharing off.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Literal

import numpy as np
import pytest
from prometheus_client import REGISTRY
from test_routed_experts import run

from everstep_rollout import metrics
from everstep_rollout.config import EngineConfig
from everstep_rollout.engine import Engine
from everstep_rollout.sequence import GenerationRequest, SamplingOptions, SequenceResult

ARCHITECTURES = ["llama", "qwen3", "qwen3_moe"]
# Two prompts sampled G = 4 times each and one sampled once, interleaved as a trainer's groups may arrive.
PROMPTS = {"a": [1, 5, 12, 4, 13, 6], "b": [1, 30, 31, 32, 33, 34, 35, 36, 37, 7, 8], "c": [1, 9, 10]}
G = 4
ATOL = 1e-5  # float32; the shared prompt is prefilled in a batch of another shape than the unshared one
LAYERS, TOP_K = 2, 2


def workload(sampling: Callable[[int], SamplingOptions]) -> list[GenerationRequest]:
    """a0 b0 a1 b1 ... c0: copy i of each grouped prompt gets sampling(i) (a seed of its own)."""
    requests = [GenerationRequest(id=f"{name}{i}", prompt_ids=PROMPTS[name], sampling=sampling(i))
                for i in range(G) for name in ("a", "b")]
    return [*requests, GenerationRequest(id="c0", prompt_ids=PROMPTS["c"], sampling=sampling(G))]


ExecutorName = Literal["auto", "native", "transformers"]


def engine(model_dir: Path, *, share: bool, max_running: int = 16, executor: ExecutorName = "auto",
           prefill_max_tokens: int = 8192) -> Engine:
    return Engine(model_dir, EngineConfig(max_running=max_running, max_seq_len=64, seed=3, share_prompt_prefill=share,
                                          executor=executor, prefill_max_tokens=prefill_max_tokens))


def prompt_tokens(*names: str) -> int:
    """Positions prefilled for these prompts: all tokens but the last (the first decode step's input)."""
    return sum(len(PROMPTS[n]) - 1 for n in names)


def assert_same_results(shared: dict[str, SequenceResult], alone: dict[str, SequenceResult]) -> None:
    assert shared.keys() == alone.keys()
    for key, r in alone.items():
        assert shared[key].output_ids == r.output_ids, key
        assert shared[key].output_logprobs == pytest.approx(r.output_logprobs, abs=ATOL), key
        assert shared[key].finish_reason == r.finish_reason, key


@pytest.mark.parametrize("architecture", ARCHITECTURES)
@pytest.mark.parametrize(("max_running", "prefill_max_tokens"), [(16, 8192), (3, 8192), (16, 12)],
                         ids=["all-at-once", "3-slots", "chunked-prefill"])
def test_shared_prefill_equals_separate_prefills(architecture: str, max_running: int, prefill_max_tokens: int,
                                                 tiny_model_dirs: Callable[[str], Path]) -> None:
    """Seeded samples at T = 1 (and greedy): the same tokens and log-probs with sharing on and off; for Qwen3-MoE the
    same routed experts, the prompt's the same for every copy. With 3 slots, copies join as others finish: only
    copies admitted in the same step share. With a prefill budget of 12 tokens, the leaders are prefilled in passes
    before the decode pass (one row each), whose keys and values reach the copies' slots there."""
    model_dir = tiny_model_dirs(architecture)
    routed = architecture == "qwen3_moe"

    def sampling(i: int) -> SamplingOptions:
        return SamplingOptions(temperature=1.0, max_new_tokens=12, seed=100 + i, return_routed_experts=routed)

    on = engine(model_dir, share=True, max_running=max_running, prefill_max_tokens=prefill_max_tokens)
    off = engine(model_dir, share=False, max_running=max_running, prefill_max_tokens=prefill_max_tokens)
    shared, alone = run(on, workload(sampling)), run(off, workload(sampling))
    assert_same_results(shared, alone)
    assert off.num_prefill_tokens_shared_total == 0
    assert on.num_prefill_tokens_shared_total > 0
    assert on.num_prefill_tokens_total + on.num_prefill_tokens_shared_total == off.num_prefill_tokens_total
    if max_running == 16:  # every copy admitted in the first step: each prompt prefilled once
        assert on.num_prefill_tokens_shared_total == (G - 1) * prompt_tokens("a", "b")
        assert on.num_prefill_tokens_total == prompt_tokens("a", "b", "c")
    # Independent sampling: the copies of a prompt did not all draw the same tokens.
    assert len({tuple(shared[f"a{i}"].output_ids) for i in range(G)}) > 1
    if routed:
        for key, r in alone.items():
            assert shared[key].routed_experts == r.routed_experts, key
        for name in ("a", "b"):
            n = len(PROMPTS[name])
            prompt_routes = [np.frombuffer(shared[f"{name}{i}"].routed_experts, dtype=np.uint8).reshape(
                -1, LAYERS, TOP_K)[:n] for i in range(G)]
            assert all(len(p) == n for p in prompt_routes)
            assert all(np.array_equal(p, prompt_routes[0]) for p in prompt_routes[1:])

    greedy = SamplingOptions(temperature=0.0, max_new_tokens=12)
    assert_same_results(run(on, workload(lambda i: greedy)), run(off, workload(lambda i: greedy)))


def test_unseeded_copies_sample_independently(tiny_model_dirs: Callable[[str], Path]) -> None:
    """Without seeds the copies draw from the engine's generator, one draw per row: different samples, and (one draw
    per row either way) the same ones as with sharing off."""
    sampling = SamplingOptions(temperature=1.0, max_new_tokens=12)
    requests = [GenerationRequest(id=f"s{i}", prompt_ids=PROMPTS["b"], sampling=sampling) for i in range(8)]
    shared = run(engine(tiny_model_dirs("llama"), share=True), requests)
    assert len({tuple(r.output_ids) for r in shared.values()}) > 1
    assert_same_results(shared, run(engine(tiny_model_dirs("llama"), share=False), requests))


def test_transformers_executor_shares_too(tiny_model_dirs: Callable[[str], Path]) -> None:
    """The copy of the leader's keys and values goes through `Executor.move_slot`, which both executors have."""
    def sampling(i: int) -> SamplingOptions:
        return SamplingOptions(temperature=1.0, max_new_tokens=8, seed=50 + i)

    on = engine(tiny_model_dirs("llama"), share=True, executor="transformers")
    assert on.executor_name == "transformers"
    shared = run(on, workload(sampling))
    assert on.num_prefill_tokens_shared_total == (G - 1) * prompt_tokens("a", "b")
    assert_same_results(shared, run(engine(tiny_model_dirs("llama"), share=False, executor="transformers"),
                                     workload(sampling)))


def test_only_fresh_copies_admitted_together_share(tiny_model_dirs: Callable[[str], Path]) -> None:
    """Carried-over sequences (prompt + partial output) are never shared, and copies arriving in a later step share
    only among themselves; the results still equal sharing off."""
    model_dir = tiny_model_dirs("qwen3")
    on, off = engine(model_dir, share=True), engine(model_dir, share=False)
    sampling = SamplingOptions(temperature=1.0, max_new_tokens=12, seed=7)
    carried = [GenerationRequest(id=f"k{i}", prompt_ids=PROMPTS["a"], output_ids=[20, 21], output_logprobs=[-1.0, -1.0],
                                 output_versions=[0, 0], sampling=sampling) for i in range(3)]
    assert_same_results(run(on, carried), run(off, carried))
    assert on.num_prefill_tokens_shared_total == 0
    assert on.num_prefill_tokens_total == 3 * (len(PROMPTS["a"]) + 1)

    def copies(first: int) -> list[GenerationRequest]:
        return [GenerationRequest(id=f"a{i}", prompt_ids=PROMPTS["a"],
                                  sampling=SamplingOptions(temperature=1.0, max_new_tokens=12, seed=i))
                for i in range(first, first + 3)]

    results: dict[str, dict[str, SequenceResult]] = {}
    for name, eng in (("on", on), ("off", off)):
        eng.add(copies(0))
        finished = eng.step()
        eng.add(copies(3))  # the second group arrives one step later
        results[name] = {r.id: r for r in finished}
        results[name].update(run(eng, []))
    assert_same_results(results["on"], results["off"])
    assert on.num_prefill_tokens_shared_total == 2 * 2 * prompt_tokens("a")


def test_prefill_metrics_count_shared_tokens(tiny_model_dirs: Callable[[str], Path]) -> None:
    """Every step's prefilled and shared positions reach the Prometheus counters."""
    def sample(name: str) -> float:
        return REGISTRY.get_sample_value(name) or 0.0

    before = sample("everstep_rollout_prefill_tokens_total"), sample("everstep_rollout_prefill_tokens_shared_total")
    eng = engine(tiny_model_dirs("llama"), share=True)
    eng.add(workload(lambda i: SamplingOptions(temperature=1.0, max_new_tokens=4, seed=i + 1)))
    while eng.has_work:
        eng.step()
        assert eng.last_step is not None
        metrics.observe_step(eng.last_step)
    after = sample("everstep_rollout_prefill_tokens_total"), sample("everstep_rollout_prefill_tokens_shared_total")
    assert after[0] - before[0] == prompt_tokens("a", "b", "c")
    assert after[1] - before[1] == (G - 1) * prompt_tokens("a", "b")


def test_the_rollout_server_shares_by_default_and_its_flag_turns_sharing_off() -> None:
    from everstep_rollout.__main__ import parse_args

    base = ["--port", "1", "--grpc-port", "2"]
    assert parse_args(base).share_prompt_prefill is True
    assert parse_args([*base, "--no-share-prompt-prefill"]).share_prompt_prefill is False
