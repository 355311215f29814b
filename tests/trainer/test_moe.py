"""Mixture-of-experts models (Qwen3-MoE: 8 experts, top-2) in the trainer: log-probs equal a plain transformers
forward, no router auxiliary loss, the pushed tensors are the HF state dict, and the routing functions."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from distributed_check import check_batches

from everstep.settings.training import TrainerConfig
from everstep_trainer.batch.packing import PackedRows
from everstep_trainer.batch.samples import pad_samples
from everstep_trainer.model.hf_model import compute_token_logprobs, load_causal_lm
from everstep_trainer.model.routing import moe_routers, routed_experts, routing_disagreement
from everstep_trainer.step.trainer import PolicyTrainer
from everstep_trainer.weight_push import GrpcWeightTransport

NUM_LAYERS, NUM_EXPERTS, TOP_K = 2, 8, 2


@pytest.fixture(scope="module")
def moe_dir(tiny_model_dirs) -> Path:
    return tiny_model_dirs("qwen3_moe")


def _batch(vocab: int = 51):
    samples = [sample for batch in check_batches(vocab, num_steps=2, seed=3) for sample in batch]
    return pad_samples(samples, pad_token_id=0)


def _packed(batch) -> PackedRows:
    """The batch's rows packed two by two (0+1, 2+3, ...) into rows as wide as the longest pair."""
    lengths = batch.attention_mask.sum(dim=1).tolist()
    rows = [list(range(i, min(i + 2, len(lengths)))) for i in range(0, len(lengths), 2)]
    width = max(sum(lengths[i] for i in row) for row in rows)
    return PackedRows.build(batch.input_ids, batch.attention_mask, rows, width=width, pad_token_id=0)


def _plain_token_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                          output_mask: torch.Tensor) -> torch.Tensor:
    """What transformers itself gives: log_softmax of the logits at the previous position."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits.float()
    logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return torch.where(output_mask, torch.nn.functional.pad(logp, (1, 0)), torch.zeros(()))


@torch.no_grad()
def test_moe_token_logprobs_equal_a_plain_transformers_forward_padded_and_packed(moe_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(moe_dir).eval()
    assert type(plain).__name__ == "Qwen3MoeForCausalLM"
    model = load_causal_lm(moe_dir)
    batch = _batch()
    expected = _plain_token_logprobs(plain, batch.input_ids, batch.attention_mask, batch.output_mask)
    padded = compute_token_logprobs(model, batch.input_ids, batch.attention_mask, batch.output_mask)
    assert torch.allclose(padded, expected, atol=1e-5, rtol=0)
    packed = _packed(batch)
    assert packed.input_ids.shape[0] < len(batch)
    packed_logp = compute_token_logprobs(model, batch.input_ids, batch.attention_mask, batch.output_mask,
                                         packed=packed)
    assert torch.allclose(packed_logp, expected, atol=1e-5, rtol=0)


def test_the_router_aux_loss_never_enters_the_trainer_loss(moe_dir: Path, tmp_path: Path) -> None:
    # A copy of the model whose config asks for router logits with a large aux-loss coefficient: transformers
    # would add 10 * aux_loss to a labels loss. The trainer's step must be the same as without the setting.
    noisy = tmp_path / "aux-on"
    shutil.copytree(moe_dir, noisy)
    config = json.loads((noisy / "config.json").read_text())
    config.update(output_router_logits=True, router_aux_loss_coef=10.0)
    (noisy / "config.json").write_text(json.dumps(config))

    from transformers import AutoModelForCausalLM

    with torch.no_grad():  # what the setting would do in transformers: an aux loss, well above zero
        batch = _batch()
        out = AutoModelForCausalLM.from_pretrained(noisy)(input_ids=batch.input_ids,
                                                          attention_mask=batch.attention_mask,
                                                          labels=batch.input_ids)
        assert out.aux_loss is not None and float(out.aux_loss) > 0.5

    trainer_config = TrainerConfig(learning_rate=1e-3, num_minibatches=2, micro_batch_tokens=32, max_grad_norm=1e6)
    batches = check_batches(51, num_steps=2)
    runs = {}
    for name, path in (("plain", moe_dir), ("aux-on", noisy)):
        trainer = PolicyTrainer(path, trainer_config)
        calls: list[dict] = []
        trainer.model.register_forward_pre_hook(lambda _m, _a, kwargs, calls=calls: calls.append(dict(kwargs)),
                                                with_kwargs=True)
        stats = [trainer.train_step(batch)[1] for batch in batches]
        assert calls and all(call.get("output_router_logits") is False for call in calls)
        runs[name] = (stats, {n: p.detach().clone() for n, p in trainer.model.named_parameters()})
    (plain_stats, plain_weights), (aux_stats, aux_weights) = runs["plain"], runs["aux-on"]
    for a, b in zip(plain_stats, aux_stats, strict=True):
        assert (a.loss, a.grad_norm) == (b.loss, b.grad_norm)
    for name, weight in plain_weights.items():
        assert torch.equal(weight, aux_weights[name]), name
    assert not torch.equal(plain_weights["model.layers.0.mlp.gate.weight"],
                           load_causal_lm(moe_dir).state_dict()["model.layers.0.mlp.gate.weight"])  # routers train


def test_a_push_carries_every_expert_tensor_under_its_hf_state_dict_name(moe_dir: Path, weight_receivers) -> None:
    (receiver,) = weight_receivers(1)
    trainer = PolicyTrainer(moe_dir, TrainerConfig(learning_rate=1e-3))
    version, _ = trainer.train_step(check_batches(51, num_steps=1)[0])
    # Small messages: the 3-D expert tensors (256 and 128 KiB) travel in chunks, as a real MoE's do.
    result = GrpcWeightTransport(bucket_bytes=32 * 1024, max_message_bytes=16 * 1024).push(
        trainer.named_weights(), version=version, endpoints=[receiver.address])
    (update,) = receiver.servicer.updates
    expected = load_causal_lm(moe_dir).state_dict()  # the names and shapes transformers gives the model
    assert update.tensors.keys() == expected.keys()
    assert result.num_bytes == sum(t.numel() * t.element_size() for t in expected.values())
    expert_names = [n for n in expected if ".mlp.experts." in n or n.endswith(".mlp.gate.weight")]
    assert len(expert_names) == 3 * NUM_LAYERS
    assert {n for n in expert_names if ".experts." in n} <= set(update.chunked_names)
    own = trainer.model.state_dict()
    for name, tensor in update.tensors.items():
        assert (tensor.shape, tensor.dtype) == (expected[name].shape, expected[name].dtype), name
        assert torch.equal(tensor, own[name]), name
    for layer in range(NUM_LAYERS):
        prefix = f"model.layers.{layer}.mlp."
        assert update.tensors[prefix + "experts.gate_up_proj"].shape == (NUM_EXPERTS, 2 * 64, 64)
        assert update.tensors[prefix + "experts.down_proj"].shape == (NUM_EXPERTS, 64, 64)
        assert update.tensors[prefix + "gate.weight"].shape == (NUM_EXPERTS, 64)


# -- routing ---------------------------------------------------------------------------------------------


@torch.no_grad()
def test_routed_experts_are_the_routers_top_k_for_every_real_token(moe_dir: Path) -> None:
    model = load_causal_lm(moe_dir)
    assert [name for name, _ in moe_routers(model)] == [f"model.layers.{i}.mlp.gate" for i in range(NUM_LAYERS)]
    batch = _batch()
    model(input_ids=batch.input_ids)  # transformers installs its own output-recording hooks on a first forward
    hooks_before = [dict(router._forward_hooks) for _, router in moe_routers(model)]
    experts = routed_experts(model, batch.input_ids, batch.attention_mask)
    assert [dict(router._forward_hooks) for _, router in moe_routers(model)] == hooks_before  # ours are gone
    num_tokens = int(batch.attention_mask.sum())
    assert experts.dtype == torch.uint8 and experts.shape == (num_tokens, NUM_LAYERS, TOP_K)
    assert int(experts.max()) < NUM_EXPERTS
    # Independently: the router logits transformers returns, top-k of their softmax, at the real tokens.
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, output_router_logits=True)
    real = batch.attention_mask.reshape(-1).bool()
    for layer, logits in enumerate(out.router_logits):
        top = torch.topk(torch.softmax(logits.float(), dim=-1), TOP_K, dim=-1).indices[real]
        assert torch.equal(experts[:, layer].long(), top), layer
    # A packed batch routes its real tokens the same way (routing is per token); `source` maps them back.
    packed = _packed(batch)
    packed_experts = routed_experts(model, packed.input_ids, position_ids=packed.position_ids)
    assert packed_experts.shape == (packed.input_ids.numel(), NUM_LAYERS, TOP_K)
    assert routing_disagreement(packed_experts[packed.source], experts) == 0.0


@torch.no_grad()
def test_routing_disagreement_is_zero_against_itself_and_positive_against_a_perturbed_model(moe_dir: Path) -> None:
    model = load_causal_lm(moe_dir)
    batch = _batch()
    experts = routed_experts(model, batch.input_ids, batch.attention_mask)
    assert routing_disagreement(experts, experts) == 0.0
    assert routing_disagreement(experts, experts.flip(-1)) == 0.0  # order within the top-k does not count
    for _, router in moe_routers(model):
        router.weight.add_(0.5 * router.weight.std() * torch.randn_like(router.weight))
    perturbed = routed_experts(model, batch.input_ids, batch.attention_mask)
    disagreement = routing_disagreement(experts, perturbed)
    assert 0.0 < disagreement < 1.0
    changed = (experts.sort(-1).values != perturbed.sort(-1).values).any(-1)
    assert disagreement == pytest.approx(float(changed.float().mean()))


def test_routing_disagreement_counts_token_layer_pairs_whose_sets_differ() -> None:
    a = torch.tensor([[[0, 1], [2, 3]], [[4, 5], [6, 7]]], dtype=torch.uint8)  # 2 tokens, 2 layers, top-2
    b = torch.tensor([[[1, 0], [2, 4]], [[4, 5], [7, 6]]], dtype=torch.uint8)
    assert routing_disagreement(a, b) == 0.25  # only token 0, layer 1: {2, 3} vs {2, 4}
    assert routing_disagreement(a[:0], b[:0]) == 0.0
    with pytest.raises(ValueError, match="a, b"):
        routing_disagreement(a, b[:1])


def test_routed_experts_refuses_a_dense_model(tiny_model_dir: Path) -> None:
    model = load_causal_lm(tiny_model_dir)
    assert moe_routers(model) == []
    with pytest.raises(ValueError, match="no mixture-of-experts router"):
        routed_experts(model, torch.tensor([[1, 5, 6]]))
