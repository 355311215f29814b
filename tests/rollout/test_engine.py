"""The torch engine against Hugging Face forward passes of the same weights."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from rollout_reference import assert_matches_hf, hf_greedy, hf_logprobs, hf_model
from safetensors.torch import load_file

from everstep_rollout.config import EngineConfig
from everstep_rollout.engine import Engine, QueueFullError
from everstep_rollout.executor.models import LlamaExecutor
from everstep_rollout.executor.transformers_executor import TransformersExecutor
from everstep_rollout.sequence import FinishReason, GenerationRequest, SamplingOptions, SequenceResult

PROMPTS = [[1, 5, 12, 4, 13, 6], [1, 20], [1, 30, 31, 32, 33, 34, 35, 36, 37, 7, 8], [1, 9, 10], [1, 40, 41, 42]]


def run(engine: Engine, max_steps: int = 10_000) -> dict[str, SequenceResult]:
    results: dict[str, SequenceResult] = {}
    for _ in range(max_steps):
        if not engine.has_work:
            return results
        for r in engine.step():
            assert r.id not in results, f"{r.id} returned twice"
            results[r.id] = r
    raise AssertionError("engine did not finish")


def requests(sampling: SamplingOptions, prompts=PROMPTS, prefix: str = "s") -> list[GenerationRequest]:
    return [GenerationRequest(id=f"{prefix}{i}", prompt_ids=p, sampling=sampling) for i, p in enumerate(prompts)]


@pytest.mark.parametrize("arch", ["llama", "qwen2_tied"])
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_logprobs_match_hf_forward(arch, temperature, tiny_model_dir, tiny_qwen2_dir):
    model_dir = tiny_model_dir if arch == "llama" else tiny_qwen2_dir
    # Fewer slots than prompts: sequences join the running batch while others decode.
    engine = Engine(model_dir, EngineConfig(max_running=3, seed=5))
    sampling = SamplingOptions(temperature=temperature, top_k=20 if temperature else 0, max_new_tokens=24)
    engine.add(requests(sampling))
    results = run(engine)
    assert_matches_hf(results, hf_model(model_dir), PROMPTS, temperature)


def test_sampling_is_seeded_and_top_k_one_is_greedy(tiny_model_dir):
    def sample(engine_seed: int, **kw) -> list[list[int]]:
        engine = Engine(tiny_model_dir, EngineConfig(max_running=8, seed=engine_seed))
        engine.add(requests(SamplingOptions(max_new_tokens=12, **kw)))
        results = run(engine)
        return [results[f"s{i}"].output_ids for i in range(len(PROMPTS))]

    assert sample(1) == sample(1)
    assert sample(1) != sample(2)
    assert sample(3, top_k=1) == sample(4, temperature=0.0)
    # A per-sequence seed makes the sample independent of the engine seed.
    assert sample(1, seed=9) == sample(2, seed=9)


def test_drained_and_continued_equals_uninterrupted(tiny_model_dir):
    sampling = SamplingOptions(temperature=0.0, max_new_tokens=20)
    reference = Engine(tiny_model_dir, EngineConfig(max_running=8))
    reference.add(requests(sampling))
    expected = run(reference)

    engine = Engine(tiny_model_dir, EngineConfig(max_running=8))
    engine.add(requests(sampling))
    for _ in range(7):
        assert not engine.step()
    partials = engine.drain()
    assert not engine.has_work and engine.num_running == 0
    assert {p.finish_reason for p in partials} == {FinishReason.ABORTED}
    assert all(len(p.output_ids) == 7 for p in partials)
    engine.add(
        GenerationRequest(id=p.id, prompt_ids=p.prompt_ids, output_ids=p.output_ids,
                          output_logprobs=p.output_logprobs, output_versions=p.output_versions, sampling=sampling)
        for p in partials
    )
    continued = run(engine)
    for key, want in expected.items():
        got = continued[key]
        assert got.output_ids == want.output_ids
        assert got.finish_reason == want.finish_reason
        assert got.output_logprobs == pytest.approx(want.output_logprobs, abs=1e-5)


def test_max_new_tokens_counts_earlier_output(tiny_model_dir):
    engine = Engine(tiny_model_dir, EngineConfig(max_running=4))
    earlier = [17, 18, 19, 20]
    engine.add([
        GenerationRequest(id="cont", prompt_ids=[1, 5], output_ids=earlier, output_logprobs=[-1.0] * 4,
                          output_versions=[0] * 4, sampling=SamplingOptions(temperature=1.0, max_new_tokens=10)),
        GenerationRequest(id="full", prompt_ids=[1, 5], output_ids=earlier, output_logprobs=[-1.0] * 4,
                          output_versions=[0] * 4, sampling=SamplingOptions(max_new_tokens=4)),
    ])
    engine.update_weights({}, version=3)
    results = run(engine)
    cont = results["cont"]
    if cont.finish_reason == FinishReason.LENGTH:
        assert len(cont.output_ids) == 10
    assert 4 < len(cont.output_ids) <= 10
    assert cont.output_ids[:4] == earlier and cont.output_logprobs[:4] == [-1.0] * 4
    assert cont.output_versions == [0] * 4 + [3] * (len(cont.output_ids) - 4)
    assert results["full"].output_ids == earlier and results["full"].finish_reason == FinishReason.LENGTH


def test_update_weights_in_place_gives_new_policy(tiny_model_dir):
    generator = torch.Generator().manual_seed(123)
    old_weights = load_file(str(tiny_model_dir / "model.safetensors"))
    new_weights = {k: v + 0.05 * torch.randn(v.shape, generator=generator) for k, v in old_weights.items()}
    new_model = hf_model(tiny_model_dir)
    new_model.load_state_dict(new_weights)
    engine = Engine(tiny_model_dir, EngineConfig(max_running=4, version=0))
    storage = engine.weights.named["model.layers.0.self_attn.k_proj.weight"].data_ptr()
    sampling = SamplingOptions(temperature=0.0, max_new_tokens=16)
    engine.add([GenerationRequest(id="inflight", prompt_ids=PROMPTS[0], sampling=sampling)])
    for _ in range(3):
        engine.step()
    engine.update_weights(new_weights, version=1)
    assert engine.weights.named["model.layers.0.self_attn.k_proj.weight"].data_ptr() == storage
    engine.add(requests(sampling, PROMPTS[1:3], prefix="new"))
    results = run(engine)

    for i, prompt in enumerate(PROMPTS[1:3]):
        r = results[f"new{i}"]
        assert r.output_ids == hf_greedy(new_model, prompt, 16)
        assert r.output_versions == [1] * len(r.output_ids)
    inflight = results["inflight"]
    assert inflight.output_versions[:3] == [0, 0, 0] and set(inflight.output_versions[3:]) == {1}
    # Tokens after the update are the new policy's, given the tokens before it.
    head = inflight.output_ids[:3]
    assert inflight.output_ids[3:] == hf_greedy(new_model, PROMPTS[0] + head, len(inflight.output_ids) - 3)
    new_logprobs = hf_logprobs(new_model, PROMPTS[0] + head, inflight.output_ids[3:], 0.0)
    assert inflight.output_logprobs[3:] == pytest.approx(new_logprobs, abs=1e-4)

    with pytest.raises(ValueError, match="unknown parameter"):
        engine.update_weights({"model.nope.weight": torch.zeros(1)}, version=2)
    with pytest.raises(ValueError, match="shape"):
        engine.update_weights({"model.norm.weight": torch.zeros(3)}, version=2)
    assert engine.version == 1


def test_stops_on_eos_list_and_on_stop_strings(tiny_model_dir, tmp_path):
    sampling = SamplingOptions(temperature=0.0, max_new_tokens=30)
    engine = Engine(tiny_model_dir, EngineConfig(max_running=4))
    engine.add(requests(sampling, PROMPTS[:1]))
    free_run = run(engine)["s0"].output_ids
    assert len(free_run) >= 8 and 2 not in free_run[:8], "pick another prompt: the reference stops too early"

    # EOS given as a list in config.json: the engine stops at the first of them.
    eos_token = free_run[5]
    eos_dir = tmp_path / "eos-list"
    shutil.copytree(tiny_model_dir, eos_dir)
    config = json.loads((eos_dir / "config.json").read_text())
    (eos_dir / "config.json").write_text(json.dumps({**config, "eos_token_id": [2, eos_token]}))
    engine = Engine(eos_dir, EngineConfig(max_running=4))
    engine.add(requests(sampling, PROMPTS[:1]))
    stopped = run(engine)["s0"]
    assert stopped.finish_reason == FinishReason.STOP
    assert stopped.output_ids == free_run[: free_run.index(eos_token) + 1]

    # A stop string spanning two tokens, matched on the decoded text.
    tokenizer = engine.tokenizer
    stop = tokenizer.decode(free_run[4:6])
    expected_len = next(k for k in range(1, len(free_run) + 1) if stop in tokenizer.decode(free_run[:k]))
    engine = Engine(tiny_model_dir, EngineConfig(max_running=4))
    engine.add(requests(SamplingOptions(temperature=0.0, max_new_tokens=30, stop=("never there", stop)),
                        PROMPTS[:1]))
    stopped = run(engine)["s0"]
    assert stopped.finish_reason == FinishReason.STOP
    assert stopped.output_ids == free_run[:expected_len]
    assert stop in stopped.output_text


def test_queue_is_bounded(tiny_model_dir):
    engine = Engine(tiny_model_dir, EngineConfig(max_running=2, max_queued=3))
    sampling = SamplingOptions(max_new_tokens=5)
    engine.add(requests(sampling, [[1, 5]] * 5, prefix="a"))  # 2 take the free slots, 3 wait
    with pytest.raises(QueueFullError, match="queue full"):
        engine.add(requests(sampling, [[1, 5]], prefix="b"))
    assert engine.num_queued == 5
    with pytest.raises(ValueError, match="already in flight"):
        engine.add(requests(sampling, [[1, 5]], prefix="a"))
    engine.step()
    assert (engine.num_running, engine.num_queued) == (2, 3)
    assert len(run(engine)) == 5


def test_native_executor_names_what_it_does_not_support(tiny_model_dir, tmp_path):
    for name, patch, error, message in [
        ("gpt2", {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, ValueError,
         "architecture 'GPT2LMHeadModel' is not one the native executor runs; it runs LlamaForCausalLM"),
        ("yarn", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}, "rope_parameters": None}, NotImplementedError,
         "yarn"),
    ]:
        model_dir = tmp_path / name
        shutil.copytree(tiny_model_dir, model_dir)
        config = json.loads((model_dir / "config.json").read_text())
        (model_dir / "config.json").write_text(json.dumps({**config, **patch}))
        with pytest.raises(error, match=message):
            Engine(model_dir, EngineConfig(executor="native"))


def test_auto_executor_falls_back_to_transformers(tiny_model_dir, tmp_path):
    assert isinstance(Engine(tiny_model_dir).executor, LlamaExecutor)
    # A Llama with YaRN RoPE scaling: not ours, but transformers runs it.
    model_dir = tmp_path / "yarn"
    shutil.copytree(tiny_model_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    rope = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0, "original_max_position_embeddings": 128}
    (model_dir / "config.json").write_text(json.dumps({**config, "rope_scaling": rope, "rope_parameters": rope}))
    engine = Engine(model_dir, EngineConfig(max_running=4))
    assert isinstance(engine.executor, TransformersExecutor)
    engine.add(requests(SamplingOptions(temperature=0.0, max_new_tokens=12), PROMPTS[:2]))
    results = run(engine)
    model = hf_model(model_dir)
    for i, prompt in enumerate(PROMPTS[:2]):
        assert results[f"s{i}"].output_ids == hf_greedy(model, prompt, len(results[f"s{i}"].output_ids))


def test_prefill_in_chunks_and_fused_with_decode_agree(tiny_model_dir):
    """Budget-limited prefill passes before the decode pass give the same tokens as one fused pass."""
    sampling = SamplingOptions(temperature=0.0, max_new_tokens=10)
    outputs = []
    for budget in (8192, 8):
        engine = Engine(tiny_model_dir, EngineConfig(max_running=8, prefill_max_tokens=budget))
        engine.add(requests(sampling))
        outputs.append(run(engine))
    for key, want in outputs[0].items():
        assert outputs[1][key].output_ids == want.output_ids
        assert outputs[1][key].output_logprobs == pytest.approx(want.output_logprobs, abs=1e-5)


def test_finished_slots_are_compacted_without_changing_outputs(tiny_model_dir):
    """Sequences of high slots move down into slots freed by finished ones; their outputs are unchanged."""
    engine = Engine(tiny_model_dir, EngineConfig(max_running=4))
    moves = []
    move_slot = engine.executor.move_slot
    engine.executor.move_slot = lambda src, dst, length: (moves.append((src, dst)), move_slot(src, dst, length))
    engine.add(GenerationRequest(id=f"s{i}", prompt_ids=PROMPTS[i],
                                 sampling=SamplingOptions(temperature=0.0, max_new_tokens=n))
               for i, n in enumerate([2, 3, 12, 14]))
    results = run(engine)
    assert (3, 0) in moves
    model = hf_model(tiny_model_dir)
    for i in range(4):
        r = results[f"s{i}"]
        assert r.output_ids == hf_greedy(model, PROMPTS[i], len(r.output_ids))
        assert r.output_logprobs == pytest.approx(hf_logprobs(model, PROMPTS[i], r.output_ids, 0.0), abs=1e-4)
