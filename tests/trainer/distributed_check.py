"""`python tests/trainer/distributed_check.py --model DIR [--nproc 2] [--steps 2]`: does FSDP2
training on N gloo ranks give the same losses and weights as one rank on the same batches?

Trains from DIR on a fixed synthetic batch (with a training/inference mismatch, uneven lengths, two
minibatches and small micro-batches, so uneven per-rank work is exercised) once in this process
and once on N CPU ranks, and prints one JSON line: the largest weight and loss differences and
`"ok"`. A test harness, not part of the trainer: the tests in this directory import it as
`distributed_check` and use `train_on_ranks`. Ranks are forked from a forkserver that imports torch and
transformers once, which saves seconds per rank on a small machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from everstep.settings.training import TrainerConfig
from everstep_trainer.batch.samples import TrainSample

__all__ = ["UPDATE_TOLERANCE", "RankRunResult", "check", "check_batches", "max_weight_difference",
           "relative_update_difference", "train_on_one_rank", "train_on_ranks"]

UPDATE_TOLERANCE = 1e-3
"""The bound on `relative_update_difference` for two computations that should train alike (packed and padded, one
rank and two, shared prompts or not). Adam divides each update by the gradient's own running scale, so a weight
whose gradient is float noise (a reduction order, another CPU's kernels) moves by up to about the learning rate
either way: an absolute bound on the weights after a step measures that noise, not the computation (issue 38: an
AMD machine gave 6.2e-5 where an Intel one gave less than 2e-5). Such weights are few, so the difference of the two
updates stays a small share of the update itself (at most 4.2e-5 measured on an Intel Xeon, 24 times below the
bound); a wrong shard, a missed reduction or a wrong mask changes most of the update (measured: 0.74 for a step
without routing replay against one with it)."""

_PRELOAD = ["torch", "torch.distributed.fsdp", "transformers", "transformers.models.llama.modeling_llama",
            "transformers.models.qwen3_moe.modeling_qwen3_moe", "everstep_trainer.step.trainer"]


@dataclass(frozen=True)
class RankRunResult:
    """What rank 0 saw: per-step statistics and the final full weights."""

    losses: list[float]
    grad_norms: list[float]
    mismatch_kls: list[float]
    versions: list[int]
    weights: dict[str, torch.Tensor]
    fsdp_units: list[str] = dataclasses.field(default_factory=list)
    """Names of the modules FSDP2 wrapped (each one FSDP unit; "" is the root); empty on one rank."""
    local_shapes: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    """Each parameter's shape on rank 0: its shard with several ranks, the whole tensor with one."""
    routing_disagreements: list[float] = dataclasses.field(default_factory=list)
    reward_kl_sums: list[list[float]] = dataclasses.field(default_factory=list)
    """trainer.kl_in_reward: `reference_kl`'s per-sample sums before each step (empty without)."""


def _run(model_dir: Path, config: TrainerConfig, batches: Sequence[Sequence[TrainSample]], *,
         checkpoint_dir: Path | None, checkpoint_after: int, resume_from: Path | None) -> RankRunResult:
    from everstep_trainer.step.trainer import PolicyTrainer

    if resume_from is not None:
        trainer, _ = PolicyTrainer.resume(resume_from, config, device="cpu")
    else:
        trainer = PolicyTrainer(model_dir, config, device="cpu")
    losses, grad_norms, kls, versions, disagreements, reward_kls = [], [], [], [], [], []
    for step, batch in enumerate(batches, start=1):
        if config.kl_in_reward:
            reward_kls.append(trainer.reference_kl(batch).kl_sums)
        version, stats = trainer.train_step(batch)
        losses.append(stats.loss)
        grad_norms.append(stats.grad_norm)
        kls.append(stats.mismatch_kl)
        versions.append(version)
        disagreements.append(stats.routing_disagreement)
        if checkpoint_dir is not None and step == checkpoint_after:
            trainer.save_checkpoint(checkpoint_dir, data_position=f"after-step-{step}")
    weights = {name: t.detach().clone() for name, t in trainer.full_state_dict().items()}
    from torch.distributed.fsdp import FSDPModule

    fsdp_units = [name for name, module in trainer.model.named_modules() if isinstance(module, FSDPModule)]
    local_shapes = {name: list(p.to_local().shape if hasattr(p, "to_local") else p.shape)
                    for name, p in trainer.model.named_parameters()}
    return RankRunResult(losses, grad_norms, kls, versions, weights, fsdp_units, local_shapes, disagreements,
                         reward_kls)


def train_on_one_rank(model_dir: Path, config: TrainerConfig, batches: Sequence[Sequence[TrainSample]], *,
                      checkpoint_dir: Path | None = None, checkpoint_after: int = 0,
                      resume_from: Path | None = None) -> RankRunResult:
    """Train in this process (no process group)."""
    return _run(Path(model_dir), config, batches, checkpoint_dir=checkpoint_dir, checkpoint_after=checkpoint_after,
                resume_from=resume_from)


def _rank_main(rank: int, world_size: int, init_file: str, result_file: str, kwargs: dict) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)  # ranks share the machine's cores
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        result = _run(**kwargs)
        if rank == 0:
            torch.save(dataclasses.asdict(result), result_file)
    finally:
        dist.destroy_process_group()


def train_on_ranks(model_dir: Path, config: TrainerConfig, batches: Sequence[Sequence[TrainSample]], *,
                   world_size: int, checkpoint_dir: Path | None = None, checkpoint_after: int = 0,
                   resume_from: Path | None = None, timeout_seconds: float = 300.0) -> RankRunResult:
    """Train on `world_size` CPU processes joined by gloo (FSDP2); rank 0's result."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)
    kwargs = dict(model_dir=Path(model_dir), config=config, batches=[list(b) for b in batches],
                  checkpoint_dir=checkpoint_dir, checkpoint_after=checkpoint_after, resume_from=resume_from)
    with tempfile.TemporaryDirectory(prefix="everstep-ranks-") as workdir:
        init_file, result_file = os.path.join(workdir, "init"), os.path.join(workdir, "result.pt")
        processes = [context.Process(target=_rank_main, args=(rank, world_size, init_file, result_file, kwargs),
                                     name=f"trainer-rank-{rank}") for rank in range(world_size)]
        for process in processes:
            process.start()
        try:
            for process in processes:
                process.join(timeout_seconds)
        finally:
            for process in processes:
                if process.is_alive():
                    process.kill()
                    process.join()
        failed = {p.name: p.exitcode for p in processes if p.exitcode != 0}
        if failed:
            raise RuntimeError(f"trainer ranks failed (exit codes): {failed}")
        return RankRunResult(**torch.load(result_file, weights_only=True))


def check_batches(vocab_size: int, *, num_steps: int, seed: int = 0) -> list[list[TrainSample]]:
    """Synthetic batches of 5 samples with uneven lengths, mixed advantages and rollout log-probs
    that differ from any model's (so IcePop masks some tokens and TIS truncates some)."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(num_steps):
        batch = []
        for i, (num_prompt, num_output) in enumerate([(3, 6), (5, 2), (2, 9), (4, 4), (6, 3)]):
            ids = torch.randint(4, vocab_size, (num_prompt - 1 + num_output,), generator=generator).tolist()
            rollout_logp = (-4.0 + 2.0 * torch.rand(num_output, generator=generator)).tolist()
            batch.append(TrainSample(prompt_ids=[1, *ids[:num_prompt - 1]], output_ids=ids[num_prompt - 1:],
                                     rollout_logprobs=rollout_logp, advantage=(-1.0) ** i * (0.5 + 0.25 * i)))
        batches.append(batch)
    return batches


def check_config(**overrides: object) -> TrainerConfig:
    """The settings the check trains with: minibatches and micro-batches small enough that ranks
    get uneven numbers of passes."""
    defaults = dict(learning_rate=1e-3, num_minibatches=2, micro_batch_tokens=16, correction="icepop")
    return TrainerConfig(**{**defaults, **overrides})


def max_weight_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest element difference: for copies of the same weights (a checkpoint, a push), where any difference
    is a bug. Two computations trained by Adam compare with `relative_update_difference` instead."""
    if a.keys() != b.keys():
        raise ValueError(f"state dicts differ in names: {sorted(a.keys() ^ b.keys())[:5]}")
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def relative_update_difference(initial: dict[str, torch.Tensor], a: dict[str, torch.Tensor],
                               b: dict[str, torch.Tensor]) -> float:
    """How far two trainings from the same `initial` weights ended apart, as a share of how far `a` moved:
    ||a - b|| / ||a - initial|| over all weights together (L2). See `UPDATE_TOLERANCE`."""
    if not (a.keys() == b.keys() == initial.keys()):
        differing = (a.keys() ^ b.keys()) | (a.keys() ^ initial.keys())
        raise ValueError(f"state dicts differ in names: {sorted(differing)[:5]}")
    apart = sum(float((a[n].double() - b[n].double()).square().sum()) for n in a)
    moved = sum(float((a[n].double() - initial[n].double()).square().sum()) for n in a)
    if moved == 0.0:
        raise ValueError("the weights did not move: there is no update to compare")
    return (apart / moved) ** 0.5


def check(model_dir: Path, *, world_size: int = 2, num_steps: int = 2) -> dict:
    from transformers import AutoConfig

    vocab_size = AutoConfig.from_pretrained(model_dir).vocab_size
    config = check_config()
    batches = check_batches(vocab_size, num_steps=num_steps)
    one = train_on_one_rank(model_dir, config, batches)
    many = train_on_ranks(model_dir, config, batches, world_size=world_size)
    weight_diff = max_weight_difference(one.weights, many.weights)
    loss_diff = max(abs(a - b) for a, b in zip(one.losses, many.losses, strict=True))
    return {"world_size": world_size, "steps": num_steps, "max_abs_weight_diff": weight_diff,
            "max_abs_loss_diff": loss_diff, "losses_one_rank": one.losses, "losses_many_ranks": many.losses,
            "ok": weight_diff < 1e-5 and loss_diff < 1e-5}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python tests/trainer/distributed_check.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True, help="a Hugging Face causal LM directory")
    parser.add_argument("--nproc", type=int, default=2, help="ranks (CPU processes, gloo)")
    parser.add_argument("--steps", type=int, default=2, help="train steps to compare")
    args = parser.parse_args(argv)
    result = check(args.model, world_size=args.nproc, num_steps=args.steps)
    print(json.dumps(result))
    raise SystemExit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
