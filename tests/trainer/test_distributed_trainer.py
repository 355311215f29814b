"""FSDP2 on two CPU ranks (gloo, real processes) trains exactly like one rank; checkpoints written by
two ranks resume on one. Llama, Qwen3 and Qwen3-MoE (whose 3-D expert weights FSDP2 shards along the
expert dimension)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from distributed_check import (
    UPDATE_TOLERANCE,
    check_batches,
    check_config,
    max_weight_difference,
    relative_update_difference,
    train_on_one_rank,
    train_on_ranks,
)

TOLERANCE = 1e-5
# Weights after AdamW steps compare as a share of the update (`relative_update_difference`, UPDATE_TOLERANCE):
# AdamW normalises each update by the gradient's running scale, so float32 reduction-order noise in near-zero
# gradients becomes up to a few percent of one step (lr 1e-3) in a weight. A wrong shard or a missed reduction
# moves most weights by whole steps.
MODEL_CLASSES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


@pytest.mark.parametrize(("architecture", "aggregation", "extra"), [
    # Two epochs, a KL reference (sharded too) and an entropy bonus, with the paper's aggregation.
    ("llama", "seq-mean-token-mean", {"ppo_epochs": 2, "kl_coef": 0.05, "entropy_coef": 0.01}),
    ("llama", "token-mean", {"correction": "tis"}),
    # Packed micro-batches: each rank packs its own rows; the padding passes are packed too.
    ("llama", "seq-mean-token-mean", {"packing": True}),
    ("qwen3", "seq-mean-token-mean", {"packing": True}),
    ("qwen3_moe", "seq-mean-token-mean", {"ppo_epochs": 2, "kl_coef": 0.05, "entropy_coef": 0.01}),
    ("qwen3_moe", "token-mean", {"packing": True, "correction": "tis"}),
    # The KL in the reward: each rank scores its own rows, rank 0 returns every sample's sum.
    ("llama", "seq-mean-token-mean", {"kl_coef": 0.05, "kl_in_reward": True, "kl_target": 0.01}),
])
def test_two_ranks_give_the_one_rank_losses_and_weights(tiny_model_dirs, tmp_path: Path, architecture: str,
                                                        aggregation: str, extra: dict) -> None:
    tiny_model_dir = tiny_model_dirs(architecture)
    # Five samples of uneven length, two minibatches, 16-token micro-batches: the ranks get
    # different numbers of micro-batches (and sometimes none of a minibatch), so padding passes run.
    config = check_config(aggregation=aggregation, **extra)
    batches = check_batches(51, num_steps=2)
    one = train_on_one_rank(tiny_model_dir, config, batches)
    two = train_on_ranks(tiny_model_dir, config, batches, world_size=2, checkpoint_dir=tmp_path / "step-1",
                         checkpoint_after=1)

    assert two.versions == one.versions == [1, 2]
    assert two.losses == pytest.approx(one.losses, rel=TOLERANCE, abs=1e-7)
    assert two.grad_norms == pytest.approx(one.grad_norms, rel=TOLERANCE)
    assert two.mismatch_kls == pytest.approx(one.mismatch_kls, rel=TOLERANCE)
    assert one.mismatch_kls[0] > 0.01  # the batch does carry a mismatch
    if config.kl_in_reward:
        assert [len(sums) for sums in two.reward_kl_sums] == [len(b) for b in batches]
        assert [x for sums in two.reward_kl_sums for x in sums] == pytest.approx(
            [x for sums in one.reward_kl_sums for x in sums], rel=TOLERANCE, abs=1e-9)
        assert max(one.reward_kl_sums[0]) == 0.0 and min(one.reward_kl_sums[1]) > 0, "k3: 0 at the reference only"
    initial = train_on_one_rank(tiny_model_dir, config, [])
    assert relative_update_difference(initial.weights, one.weights, two.weights) < UPDATE_TOLERANCE
    assert {n: t.shape for n, t in two.weights.items()} == {n: t.shape for n, t in one.weights.items()}
    # One FSDP unit per decoder block plus the root; every parameter, the 3-D expert weights included
    # ([experts, out, in]), sharded along dim 0 between the two ranks.
    assert two.fsdp_units == ["", "model.layers.0", "model.layers.1"] and one.fsdp_units == []
    for name, shape in one.local_shapes.items():
        assert two.local_shapes[name] == [(shape[0] + 1) // 2, *shape[1:]], name
    if architecture == "qwen3_moe":
        assert two.local_shapes["model.layers.0.mlp.experts.gate_up_proj"] == [4, 128, 64]
    assert max_weight_difference(one.weights, initial.weights) > 100 * TOLERANCE  # training moved the weights

    # The checkpoint the two ranks wrote (full tensors, AdamW state gathered) resumes on one rank,
    # and names the model class, not its FSDP wrapper.
    assert json.loads((tmp_path / "step-1" / "config.json").read_text())["architectures"] == [
        MODEL_CLASSES[architecture]]
    resumed = train_on_one_rank(tiny_model_dir, config, batches[1:], resume_from=tmp_path / "step-1")
    assert resumed.versions == [2]
    assert resumed.losses[0] == pytest.approx(one.losses[1], rel=TOLERANCE, abs=1e-7)
    assert relative_update_difference(initial.weights, one.weights, resumed.weights) < UPDATE_TOLERANCE


def test_three_ranks_shard_eight_experts_unevenly_and_still_train_like_one(tiny_model_dirs) -> None:
    # 8 experts over 3 ranks: FSDP2 pads dim 0 (shards of 3, 3, 2); the step is unchanged.
    model_dir = tiny_model_dirs("qwen3_moe")
    config = check_config(packing=True)
    batches = check_batches(51, num_steps=2)
    one = train_on_one_rank(model_dir, config, batches)
    three = train_on_ranks(model_dir, config, batches, world_size=3)
    assert three.local_shapes["model.layers.1.mlp.experts.down_proj"] == [3, 64, 64]
    assert three.losses == pytest.approx(one.losses, rel=TOLERANCE, abs=1e-7)
    assert three.grad_norms == pytest.approx(one.grad_norms, rel=TOLERANCE)
    initial = train_on_one_rank(model_dir, config, [])
    assert relative_update_difference(initial.weights, one.weights, three.weights) < UPDATE_TOLERANCE


@pytest.mark.parametrize(("architecture", "extra"), [
    ("llama", {"packing": True, "kl_coef": 0.05}),
    ("qwen3_moe", {}),
])
def test_lora_on_two_ranks_gives_the_one_rank_adapters(tiny_model_dirs, tmp_path: Path, architecture: str,
                                                       extra: dict) -> None:
    """FSDP2 shards the frozen base and the float32 adapters alike; only the adapters' gradients are reduced, and
    a checkpoint the two ranks wrote (adapters only) resumes on one rank."""
    from everstep.settings.training import LoraSettings

    tiny_model_dir = tiny_model_dirs(architecture)
    config = check_config(lora=LoraSettings(rank=4, alpha=8.0), learning_rate=1e-2, **extra)
    batches = check_batches(51, num_steps=2)
    one = train_on_one_rank(tiny_model_dir, config, batches)
    two = train_on_ranks(tiny_model_dir, config, batches, world_size=2, checkpoint_dir=tmp_path / "step-1",
                         checkpoint_after=1)
    assert two.losses == pytest.approx(one.losses, rel=TOLERANCE, abs=1e-7)
    assert two.grad_norms == pytest.approx(one.grad_norms, rel=TOLERANCE)
    assert set(one.weights) == set(two.weights) and all(".lora_" in n for n in one.weights)
    initial = train_on_one_rank(tiny_model_dir, config, [])
    assert relative_update_difference(initial.weights, one.weights, two.weights) < UPDATE_TOLERANCE
    assert "base_model.model.model.layers.0" in two.fsdp_units
    assert max_weight_difference(one.weights, initial.weights) > 100 * TOLERANCE

    resumed = train_on_one_rank(tiny_model_dir, config, batches[1:], resume_from=tmp_path / "step-1")
    assert resumed.losses == pytest.approx(one.losses[1:], rel=TOLERANCE, abs=1e-7)
    assert relative_update_difference(initial.weights, one.weights, resumed.weights) < UPDATE_TOLERANCE
