"""Our engine and trainer on SmolLM2-135M-Instruct: log-probs equal to transformers', generation that stops
on the chat model's end of turn, a 540 MB weight push over shared memory and over gRPC, and a train step."""

from __future__ import annotations

import resource
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from safetensors.torch import load_file

from everstep.processes import ManagedProcess, free_port, spawn, stop_processes, wait_grpc_serving
from everstep.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
from everstep_trainer.weight_push import make_transport

QUESTIONS = ["Tom has 3 apples and buys 5 more. How many apples does he have? Put the answer in \\boxed{}.",
             "What is 12 times 7?", "Say hello."]


@pytest.fixture(scope="module")
def hf(smollm2_dir: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval(),
            AutoTokenizer.from_pretrained(smollm2_dir))


def chat_ids(tokenizer, question: str) -> list[int]:
    return list(tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                              return_dict=True)["input_ids"])


@torch.inference_mode()
def reference_logprobs(model, prompt: list[int], output: list[int]) -> tuple[torch.Tensor, list[int]]:
    """float32 transformers: log-probs of `output` after `prompt`, and the greedy token at each position."""
    logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1].float()
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(1, torch.tensor(output)[:, None])[:, 0], logp.argmax(-1).tolist()


def test_native_engine_matches_transformers_and_stops_on_im_end(smollm2_dir: Path, hf) -> None:
    from everstep_rollout.config import EngineConfig
    from everstep_rollout.engine import Engine
    from everstep_rollout.sequence import FinishReason, GenerationRequest, SamplingOptions

    model, tokenizer = hf
    engine = Engine(smollm2_dir, EngineConfig(max_running=4, max_seq_len=512))
    assert type(engine.executor).__name__ == "LlamaExecutor"  # GQA (9 query, 3 KV heads), tied embeddings
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end in engine.eos_token_ids
    prompts = [chat_ids(tokenizer, q) for q in QUESTIONS]
    greedy = SamplingOptions(temperature=1.0, top_k=1, max_new_tokens=64)
    sampled = SamplingOptions(temperature=1.0, max_new_tokens=64, seed=5)
    engine.add([GenerationRequest(id=f"g{i}", prompt_ids=p, sampling=greedy) for i, p in enumerate(prompts)]
               + [GenerationRequest(id=f"s{i}", prompt_ids=p, sampling=sampled) for i, p in enumerate(prompts)])
    results = []
    while engine.has_work:
        results += engine.step()
    assert len(results) == 2 * len(prompts)
    deltas = []
    for r in results:
        prompt = prompts[int(r.id[1:])]
        expected, argmax = reference_logprobs(model, prompt, list(r.output_ids))
        deltas.append((expected - torch.tensor(r.output_logprobs)).abs())
        if r.id.startswith("g"):  # greedy: every token is transformers' argmax
            assert list(r.output_ids) == argmax
        if r.finish_reason == FinishReason.STOP:
            assert r.output_ids[-1] in engine.eos_token_ids
        else:
            assert r.finish_reason == FinishReason.LENGTH and len(r.output_ids) == 64
        assert "<|im_end|>" not in r.output_text and "<|im_start|>" not in r.output_text
    assert torch.cat(deltas).mean().item() < 1e-3
    assert any(r.finish_reason == FinishReason.STOP and r.output_ids[-1] == im_end for r in results)

    # greedy 64 tokens equal to transformers' own generate
    long = next(r for r in results if r.id == "g1")
    out = model.generate(torch.tensor([prompts[1]]), max_new_tokens=64, do_sample=False,
                         eos_token_id=sorted(engine.eos_token_ids))
    assert out[0, len(prompts[1]):].tolist() == list(long.output_ids)


@pytest.fixture(scope="module")
def engine_process(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagedProcess]:
    http_port, grpc_port = free_port(), free_port()
    log_path = tmp_path_factory.mktemp("engine") / "rollout.log"
    engine = spawn("rollout", ["-m", "everstep_rollout", "--host", "127.0.0.1", "--port", str(http_port),
                               "--grpc-port", str(grpc_port), "--model", str(smollm2_dir), "--max-running", "4",
                               "--max-seq-len", "256", "--num-threads", "1"], log_path, http_port=http_port,
                   grpc_port=grpc_port)
    try:
        wait_grpc_serving(engine, 300)
        yield engine
    finally:
        stop_processes([engine])


def _greedy_logprobs(address: str, prompt: list[int], version: int) -> common_pb2.Sequence:
    request = rollout_pb2.GenerateRequest(sequences=[common_pb2.Sequence(id="p", prompt_ids=prompt)],
                                          sampling=common_pb2.SamplingParams(temperature=0.0, max_new_tokens=8))
    with grpc.insecure_channel(address) as channel:
        stub = rollout_pb2_grpc.RolloutStub(channel)
        (result,) = [s for r in stub.Generate(iter([request]), timeout=120) for s in r.sequences]
        assert stub.GetStatus(rollout_pb2.GetStatusRequest()).version == version
    assert set(result.output_versions) == {version}
    return result


@pytest.mark.parametrize("transport", ["shm", "grpc"])
def test_the_whole_model_is_pushed_into_a_running_engine(transport: str, smollm2_dir: Path, engine_process, hf):
    model, tokenizer = hf
    weights = load_file(str(smollm2_dir / "model.safetensors"))
    assert sum(t.numel() * t.element_size() for t in weights.values()) > 530e6  # 540 MB in float32
    generator = torch.Generator().manual_seed(1 if transport == "shm" else 2)
    pushed = {k: v + 0.02 * torch.randn(v.shape, generator=generator) for k, v in weights.items()}
    version = 7 if transport == "shm" else 8
    pusher = make_transport(transport)
    try:
        result = pusher.push(pushed.items(), version=version, endpoints=[engine_process.grpc_address])
    finally:
        pusher.close()
    assert result.transport == transport
    prompt = chat_ids(tokenizer, QUESTIONS[0])
    sequence = _greedy_logprobs(engine_process.grpc_address, prompt, version)
    model.load_state_dict(pushed, strict=False)  # lm_head is tied to embed_tokens
    try:
        expected, _ = reference_logprobs(model, prompt, list(sequence.output_ids))
    finally:
        model.load_state_dict(weights, strict=False)
    torch.testing.assert_close(torch.tensor(list(sequence.output_logprobs)), expected, atol=1e-3, rtol=0)


def test_one_train_step_fits_and_changes_the_weights(smollm2_dir: Path, hf) -> None:
    from everstep.settings.training import TrainerConfig
    from everstep_trainer.batch.samples import TrainSample
    from everstep_trainer.step.trainer import PolicyTrainer

    _, tokenizer = hf
    trainer = PolicyTrainer(smollm2_dir, TrainerConfig(learning_rate=1e-5, micro_batch_tokens=2048, correction="none"))
    before = {k: v.clone() for k, v in list(trainer.named_weights())[:3]}
    samples = []
    for i, question in enumerate(QUESTIONS * 2):
        prompt = chat_ids(tokenizer, question)
        output = tokenizer(f"The answer is \\boxed{{{i}}}.").input_ids + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
        samples.append(TrainSample(prompt, output, [-1.0] * len(output), 1.0 if i % 2 else -1.0))
    version, stats = trainer.train_step(samples)
    assert version == 1 and stats.num_tokens > 0
    after = dict(trainer.named_weights())
    assert any(not torch.equal(before[k], after[k]) for k in before)
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    assert peak_gib < 12, f"peak RSS {peak_gib:.1f} GiB"
