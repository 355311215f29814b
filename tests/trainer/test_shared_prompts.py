"""Shared prompts (`TrainerConfig.share_prompts`): samples of a micro-batch that start with the same prompt are laid
out as the prompt once and then each sample's own tokens; the log-probs, entropy, loss, gradients and a whole train
step equal the padded (and packed) ones, on every architecture the trainer covers, with tool replies inside the
responses, with routing replay, and on two ranks."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from distributed_check import (
    UPDATE_TOLERANCE,
    check_config,
    relative_update_difference,
    train_on_one_rank,
    train_on_ranks,
)
from pydantic import ValidationError

from everstep.settings.training import TrainerConfig, TrainerSettings
from everstep_trainer.batch import shared_prompts
from everstep_trainer.batch.samples import TrainSample, pad_samples
from everstep_trainer.batch.shared_prompts import SharedPromptRows, prompt_lengths
from everstep_trainer.model.hf_model import (
    _block_mask,
    check_packing_supported,
    compute_token_logprobs,
    compute_token_logprobs_and_entropy,
    load_causal_lm,
)
from everstep_trainer.model.routing import moe_routers, routed_experts
from everstep_trainer.step.trainer import PolicyTrainer


def _grouped_samples(seed: int, num_prompts: int, group_size: int, vocab: int = 50, *,
                     tools: bool = False) -> list[TrainSample]:
    """`group_size` responses to each of `num_prompts` prompts (GRPO groups), shuffled; with `tools`, some responses
    hold a tool reply (output tokens the model did not write) between two turns of their own."""
    rng = random.Random(seed)
    samples = []
    for _ in range(num_prompts):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 12))]
        for _ in range(group_size):
            output = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 9))]
            tool_mask = [False] * len(output)
            if tools and rng.random() < 0.5:
                reply = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 4))]
                after = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 4))]
                tool_mask = tool_mask + [True] * len(reply) + [False] * len(after)
                output = output + reply + after
            logprobs = [0.0 if tool else -rng.uniform(0.2, 4.0) for tool in tool_mask]
            samples.append(TrainSample(prompt, output, logprobs, rng.uniform(-1.5, 1.5),
                                       output_tool_mask=tool_mask if tools else ()))
    rng.shuffle(samples)
    return samples


def test_the_layout_computes_each_prompt_once_and_lets_each_sample_see_only_the_prompt_and_itself() -> None:
    samples = [TrainSample([5, 6, 7], [8, 9], [-1.0] * 2, 1.0), TrainSample([11], [12, 13], [-1.0] * 2, 0.5),
               TrainSample([5, 6, 7], [10], [-1.0], 0.0), TrainSample([5, 6], [7, 9], [-1.0] * 2, 0.0)]
    batch = pad_samples(samples, pad_token_id=0)
    assert prompt_lengths(batch) == [3, 1, 3, 2]
    layout = SharedPromptRows.build(batch, pad_token_id=0)
    # Segments, longest first: [5 6 7 | 8 9 | 10] (6 tokens: the row width), then [5 6 | 7 9] and [11 | 12 13].
    assert layout.num_segments == 3
    assert layout.input_ids.tolist() == [[5, 6, 7, 8, 9, 10], [5, 6, 7, 9, 0, 0], [11, 12, 13, 0, 0, 0]]
    assert layout.position_ids.tolist() == [[0, 1, 2, 3, 4, 3], [0, 1, 2, 3, 0, 0], [0, 1, 2, 0, 0, 0]]
    # Sample 0's tokens, then 1's, 2's and 3's; the prompt of samples 0 and 2 is the same three positions.
    assert layout.source.tolist() == [0, 1, 2, 3, 4, 12, 13, 14, 0, 1, 2, 5, 6, 7, 8, 9]
    assert layout.num_real_positions == 13
    allowed = layout.allowed[0].int().tolist()
    assert allowed[5] == [1, 1, 1, 0, 0, 1]  # sample 2's answer: the prompt and itself, not sample 0's tokens
    assert allowed[4] == [1, 1, 1, 1, 1, 0]
    assert allowed[2] == [1, 1, 1, 0, 0, 0]
    assert layout.allowed[1, 4].int().tolist() == [0, 0, 0, 0, 1, 0]  # padding sees only itself
    assert not layout.allowed[2, :3, 3:].any()


def test_a_large_group_is_split_into_segments_of_bounded_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shared_prompts, "SEGMENT_TOKENS", 10)
    samples = [TrainSample([5, 6, 7], [8 + i] * 3, [-1.0] * 3, 0.0) for i in range(5)]  # 5 x 3 own tokens
    layout = SharedPromptRows.build(pad_samples(samples, pad_token_id=0), pad_token_id=0)
    # Segments of at most 10 tokens: the prompt (3) with two answers (6) each, then the prompt with the last one.
    assert layout.num_segments == 3 and layout.input_ids.shape[1] == 9
    assert layout.input_ids[:, :3].tolist() == [[5, 6, 7]] * 2 + [[5, 6, 7]]
    assert layout.num_real_positions == 3 * 3 + 5 * 3


@pytest.mark.parametrize("architecture", ["llama", "llama3", "qwen2", "qwen3", "qwen3_moe"])
@pytest.mark.parametrize("tools", [False, True])
def test_shared_log_probs_entropy_and_gradients_equal_the_padded_ones(tiny_model_dirs, architecture: str,
                                                                      tools: bool) -> None:
    torch.manual_seed(0)
    model = load_causal_lm(tiny_model_dirs(architecture))
    samples = _grouped_samples(1, 3, 4, vocab=int(model.get_input_embeddings().num_embeddings), tools=tools)
    batch = pad_samples(samples, pad_token_id=0)
    layout = SharedPromptRows.build(batch, pad_token_id=0)
    assert layout.num_segments == 3 and layout.num_real_positions < int(batch.attention_mask.sum())
    weights = torch.randn(batch.output_mask.shape)

    def run(shared: SharedPromptRows | None) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        logp, entropy = compute_token_logprobs_and_entropy(model, batch.input_ids, batch.attention_mask,
                                                           batch.output_mask, 0.8, packed=shared)
        ((logp * weights).sum() + entropy.sum()).backward()
        return logp.detach(), entropy.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    padded_logp, padded_entropy, padded_grads = run(None)
    shared_logp, shared_entropy, shared_grads = run(layout)
    assert torch.allclose(shared_logp, padded_logp, atol=1e-5, rtol=0)
    assert torch.allclose(shared_entropy, padded_entropy, atol=1e-5, rtol=0)
    assert torch.all(shared_logp[~batch.output_mask] == 0) and torch.all(padded_logp[batch.output_mask] < 0)
    for name, grad in padded_grads.items():
        assert float(grad.abs().max()) > 0 or name.endswith("bias"), name
        assert torch.allclose(shared_grads[name], grad, atol=1e-5, rtol=1e-4), name
    with torch.no_grad():
        assert torch.allclose(compute_token_logprobs(model, batch.input_ids, batch.attention_mask, batch.output_mask,
                                                     0.8, packed=layout), padded_logp, atol=1e-5, rtol=0)


@pytest.mark.parametrize(("architecture", "micro_batch_tokens", "extra"), [
    ("llama", 16384, {}), ("llama", 60, {}), ("qwen3", 16384, {"kl_coef": 0.05}),
    ("qwen3_moe", 16384, {"ppo_epochs": 2}), ("llama", 16384, {"aggregation": "token-mean", "correction": "tis"})])
def test_a_train_step_with_shared_prompts_equals_the_packed_one(tiny_model_dirs, architecture: str,
                                                                micro_batch_tokens: int, extra: dict) -> None:
    model_dir = tiny_model_dirs(architecture)
    samples = _grouped_samples(2, 3, 5, tools=True)
    trainers, stats = {}, {}
    for share in (False, True):
        config = TrainerConfig(learning_rate=1e-3, micro_batch_tokens=micro_batch_tokens, packing=True,
                               share_prompts=share, num_minibatches=2, entropy_coef=0.01, max_grad_norm=1e6,
                               **extra)
        trainers[share] = PolicyTrainer(model_dir, config)
        _, stats[share] = trainers[share].train_step(samples)
    packed, shared = stats[False], stats[True]
    for field in ("loss", "grad_norm", "mismatch_kl", "masked_fraction", "entropy", "clip_fraction"):
        assert getattr(shared, field) == pytest.approx(getattr(packed, field), rel=1e-4, abs=1e-6), field
    assert shared.num_tokens == packed.num_tokens and shared.num_optimizer_steps == packed.num_optimizer_steps
    initial = _weights(PolicyTrainer(model_dir, config))
    assert relative_update_difference(initial, _weights(trainers[False]), _weights(trainers[True])) < UPDATE_TOLERANCE


def _weights(trainer: PolicyTrainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def test_the_step_reports_the_prompt_positions_it_did_not_compute(tiny_model_dir: Path) -> None:
    """Four prompts of 12 tokens sampled 8 times, 3-token answers, one micro-batch per minibatch: each prompt is
    computed once per micro-batch instead of 8 times."""
    rng = random.Random(5)
    samples = []
    for _ in range(4):
        prompt = [rng.randrange(3, 50) for _ in range(12)]
        samples += [TrainSample(prompt, [rng.randrange(3, 50) for _ in range(3)], [-1.0] * 3, rng.uniform(-1, 1))
                    for _ in range(8)]
    steps = {}
    for share in (False, True):
        trainer = PolicyTrainer(tiny_model_dir, TrainerConfig(packing=True, share_prompts=share))
        _, steps[share] = trainer.train_step(samples)
    assert steps[False].shared_prompt_fraction == 0.0
    # 32 samples x 15 tokens = 480 real tokens; 4 x (12 + 8 x 3) = 144 computed: 1 - 144 / 480.
    assert steps[True].shared_prompt_fraction == pytest.approx(1 - 144 / 480)
    assert 0.0 <= steps[True].padding_fraction < 0.5  # still the padding share of what was computed


def _moe_samples_with_routes(moe_dir: Path, *, differing_prompt_routes: bool) -> list[TrainSample]:
    """Two prompts x 3 responses with the model's own routes; with `differing_prompt_routes`, one response of the
    first prompt carries routes from a perturbed router (as an engine at another version would record)."""
    model = load_causal_lm(moe_dir)
    other = load_causal_lm(moe_dir)
    with torch.no_grad():
        for _, router in moe_routers(other):
            router.weight.mul_(-1.0)
    samples = _grouped_samples(4, 2, 3, vocab=51)
    first_prompt = list(samples[0].prompt_ids)
    routed, marked = [], False
    for sample in samples:
        engine = model
        if differing_prompt_routes and not marked and list(sample.prompt_ids) == first_prompt:
            engine, marked = other, True
        ids = torch.tensor([[*sample.prompt_ids, *sample.output_ids][:-1]])
        routes = routed_experts(engine, ids, torch.ones_like(ids))
        routed.append(dataclasses.replace(sample, routed_experts=routes.numpy().tobytes(),
                                          output_versions=[0] * len(sample.output_ids)))
    return routed


@pytest.mark.parametrize("differing_prompt_routes", [False, True])
def test_routing_replay_with_shared_prompts_equals_the_packed_step(tiny_model_dirs,
                                                                  differing_prompt_routes: bool) -> None:
    """Samples share a prompt's positions only when their routes of it agree; either way the replayed step is the
    packed one."""
    moe_dir = tiny_model_dirs("qwen3_moe")
    samples = _moe_samples_with_routes(moe_dir, differing_prompt_routes=differing_prompt_routes)
    results = {}
    for share in (False, True):
        trainer = PolicyTrainer(moe_dir, TrainerConfig(learning_rate=1e-3, packing=True, share_prompts=share,
                                                       routing_replay="rollout", max_grad_norm=1e6))
        _, step = trainer.train_step(samples)
        results[share] = (step, _weights(trainer))
    (packed, packed_weights), (shared, shared_weights) = results[False], results[True]
    initial = _weights(PolicyTrainer(moe_dir, TrainerConfig(packing=True, routing_replay="rollout")))
    assert shared.loss == pytest.approx(packed.loss, rel=1e-5, abs=1e-7)
    assert shared.routing_disagreement == pytest.approx(packed.routing_disagreement, abs=1e-12)
    assert (packed.routing_disagreement > 0) == differing_prompt_routes
    assert relative_update_difference(initial, packed_weights, shared_weights) < UPDATE_TOLERANCE
    batch = pad_samples(samples, pad_token_id=0, routing=PolicyTrainer(
        moe_dir, TrainerConfig(packing=True, routing_replay="rollout")).routing)
    assert SharedPromptRows.build(batch, pad_token_id=0).num_segments == (3 if differing_prompt_routes else 2)


@pytest.mark.slow
def test_two_ranks_with_shared_prompts_equal_one_rank(tiny_model_dirs) -> None:
    model_dir = tiny_model_dirs("qwen3")
    batches = [_grouped_samples(seed, 2, 3, vocab=51) for seed in (7, 8)]
    config = check_config(packing=True, share_prompts=True, micro_batch_tokens=40)
    one = train_on_one_rank(model_dir, config, batches)
    two = train_on_ranks(model_dir, config, batches, world_size=2)
    assert two.losses == pytest.approx(one.losses, rel=1e-5, abs=1e-7)
    assert two.grad_norms == pytest.approx(one.grad_norms, rel=1e-5)
    initial = train_on_one_rank(model_dir, config, [])
    assert relative_update_difference(initial.weights, one.weights, two.weights) < UPDATE_TOLERANCE
    packed = train_on_one_rank(model_dir, check_config(packing=True, micro_batch_tokens=40), batches)
    assert packed.losses == pytest.approx(one.losses, rel=1e-5, abs=1e-7)


def test_share_prompts_needs_packing_and_a_model_that_keeps_the_samples_apart(tiny_model_dir: Path) -> None:
    with pytest.raises(ValidationError, match="share_prompts: needs packing"):
        TrainerSettings(share_prompts=True)
    model = load_causal_lm(tiny_model_dir)
    check_packing_supported(model, pad_token_id=0, device=torch.device("cpu"), share_prompts=True)
    assert _block_mask(model, torch.eye(3, dtype=torch.bool)[None]).dtype == torch.bool  # sdpa: as it is
    from transformers import AutoModelForCausalLM

    eager = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="eager")
    assert _block_mask(eager, torch.eye(3, dtype=torch.bool)[None]).dtype == torch.float32  # additive
    check_packing_supported(eager, pad_token_id=0, device=torch.device("cpu"), share_prompts=True)
    flash = SimpleNamespace(config=SimpleNamespace(_attn_implementation="flash_attention_2"))  # ignores 4D masks
    with pytest.raises(ValueError, match="trainer.share_prompts: needs the model's attention implementation"):
        _block_mask(flash, torch.eye(3, dtype=torch.bool)[None])


def test_a_model_that_ignores_the_block_mask_is_refused(tiny_model_dir: Path) -> None:
    model = load_causal_lm(tiny_model_dir)
    forward = type(model).forward

    def causal_only(self, *args, attention_mask=None, **kwargs):  # drops the block mask: a plain causal row
        return forward(self, *args, **kwargs)

    model.forward = causal_only.__get__(model)
    with pytest.raises(ValueError, match="trainer.share_prompts: .* does not keep packed sequences apart"):
        check_packing_supported(model, pad_token_id=0, device=torch.device("cpu"), share_prompts=True)
