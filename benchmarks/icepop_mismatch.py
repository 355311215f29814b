"""IcePop in small: `python -m benchmarks.icepop_mismatch [--model DIR] [--steps N] [--out DIR]`.

The Ring-1T paper's experiment at toy scale: the rollout engine samples in bfloat16 while the trainer
computes in float32, so pi_infer and pi_train disagree. Three runs of equal length, identical but for
the mismatch correction (none = plain GRPO, tis = truncated importance sampling, icepop = masking
tokens with k = pi_train / pi_infer outside [alpha, beta]), each: sample G completions for P prompts
of the demo task with the in-process rollout `Engine` (dtype bfloat16, CPU), score them (exact match
of the boxed answer), GRPO advantages, one `PolicyTrainer` step (float32, the same model), copy the
new weights into the engine, repeat. Same prompts and sampling seed in every run, so the first step
is identical across runs.

Writes OUT/icepop_mismatch.json (settings and per-step mismatch KL, max and mean |delta logp|,
masked fraction, reward, ...) and OUT/icepop_mismatch.png, and prints as its last line
`{"none": {...}, "tis": {...}, "icepop": {...}}` with final_reward (mean over the last 10% of
steps), masked_fraction_mean, mismatch_kl_first and mismatch_kl_last per run.

The model defaults to the demo model shipped in examples/demo-model (a --model folder that has no
model yet is built first, a few minutes). Small models and few steps show the mechanics, not the
paper's long-horizon collapse.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

CORRECTIONS = ("none", "tis", "icepop")
DEFAULT_MODEL = Path("examples/demo-model")

log = logging.getLogger("benchmarks.icepop_mismatch")


@dataclass(frozen=True, kw_only=True)
class Settings:
    """One benchmark run (all three corrections use it)."""

    model: str
    steps: int
    prompts_per_step: int
    group_size: int
    max_new_tokens: int
    learning_rate: float
    temperature: float
    alpha: float
    beta: float
    tis_cap: float
    seed: int
    num_threads: int


@dataclass(frozen=True, kw_only=True)
class StepRecord:
    step: int
    reward_mean: float
    mismatch_kl: float
    logp_diff_max: float
    logp_diff_abs_mean: float
    masked_fraction: float
    clip_fraction: float
    loss: float
    grad_norm: float
    entropy: float
    num_tokens: int
    rollout_seconds: float
    train_seconds: float


def ensure_model(model_dir: Path) -> None:
    if (model_dir / "config.json").is_file():
        return
    print(f"building the demo model in {model_dir} (one time, a few minutes)", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "everstep_trainer.demo", "--out", str(model_dir)], check=True)


def read_prompts(model_dir: Path, count: int, seed: int) -> list[tuple[str, str]]:
    """(prompt, answer) rows of the model directory's train.jsonl, shuffled with `seed`."""
    rows = [json.loads(line) for line in (model_dir / "train.jsonl").read_text().splitlines() if line.strip()]
    random.Random(seed).shuffle(rows)
    return [(row["prompt"], str(row["answer"])) for row in rows[:count]]


def _generate(engine, tokenizer, prompts: list[tuple[str, str]], settings: Settings, step: int) -> list:
    from everstep_rollout.sequence import GenerationRequest, SamplingOptions

    sampling = SamplingOptions(temperature=settings.temperature, max_new_tokens=settings.max_new_tokens)
    requests = [GenerationRequest(id=f"{step}-{p}-{g}", prompt_ids=tokenizer(prompt)["input_ids"], sampling=sampling)
                for p, (prompt, _) in enumerate(prompts) for g in range(settings.group_size)]
    engine.add(requests)
    results = {}
    while engine.has_work:
        for result in engine.step():
            results[result.id] = result
    return [results[r.id] for r in requests]


def run_one(correction: str, settings: Settings, prompts: list[tuple[str, str]]) -> list[StepRecord]:
    """One training run with `correction`; per-step records."""
    import torch

    from everstep_controller.scheduler import grpo_advantages
    from everstep_rollout.config import EngineConfig
    from everstep_rollout.engine import Engine
    from everstep_trainer.batching import TrainSample
    from everstep_trainer.config import TrainerConfig
    from everstep_trainer.demo.evaluation import is_correct
    from everstep_trainer.policy_trainer import PolicyTrainer

    torch.manual_seed(settings.seed)
    rows = settings.prompts_per_step * settings.group_size
    engine = Engine(settings.model, EngineConfig(dtype="bfloat16", device="cpu", max_running=rows,
                                                 max_queued=rows, seed=settings.seed))
    trainer = PolicyTrainer(settings.model, TrainerConfig(
        correction=correction, learning_rate=settings.learning_rate, alpha=settings.alpha, beta=settings.beta,
        tis_cap=settings.tis_cap, temperature=settings.temperature, seed=settings.seed), device="cpu")
    records = []
    for step in range(settings.steps):
        start = time.perf_counter()
        batch_prompts = prompts[step * settings.prompts_per_step:(step + 1) * settings.prompts_per_step]
        results = _generate(engine, engine.tokenizer, batch_prompts, settings, step)
        rollout_seconds = time.perf_counter() - start
        rewards = [float(is_correct(r.output_text, batch_prompts[i // settings.group_size][1]))
                   for i, r in enumerate(results)]
        samples = []
        for first in range(0, len(results), settings.group_size):
            group = results[first:first + settings.group_size]
            advantages = grpo_advantages(rewards[first:first + settings.group_size], normalize_std=True)
            samples += [TrainSample(r.prompt_ids, r.output_ids, r.output_logprobs, a)
                        for r, a in zip(group, advantages, strict=True)]
        start = time.perf_counter()
        version, stats = trainer.train_step(samples)
        engine.update_weights(dict(trainer.named_weights()), version)
        train_seconds = time.perf_counter() - start
        records.append(StepRecord(
            step=step + 1, reward_mean=sum(rewards) / len(rewards), mismatch_kl=stats.mismatch_kl,
            logp_diff_max=stats.logp_diff_max, logp_diff_abs_mean=stats.logp_diff_abs_mean,
            masked_fraction=stats.masked_fraction, clip_fraction=stats.clip_fraction, loss=stats.loss,
            grad_norm=stats.grad_norm, entropy=stats.entropy, num_tokens=stats.num_tokens,
            rollout_seconds=rollout_seconds, train_seconds=train_seconds))
        log.info("%s step %d: reward %.3f mismatch_kl %.2e max|dlogp| %.3f masked %.4f (%.1fs + %.1fs)",
                 correction, step + 1, records[-1].reward_mean, stats.mismatch_kl, stats.logp_diff_max,
                 stats.masked_fraction, rollout_seconds, train_seconds)
    return records


def summarize(records: list[StepRecord]) -> dict[str, float]:
    """final_reward: mean reward over the last 10% of steps (at least one)."""
    tail = max(1, math.ceil(len(records) / 10))

    def mean(values: list[float]) -> float:
        return sum(values) / len(values)

    return {
        "final_reward": mean([r.reward_mean for r in records[-tail:]]),
        "first_reward": mean([r.reward_mean for r in records[:tail]]),
        "masked_fraction_mean": mean([r.masked_fraction for r in records]),
        "mismatch_kl_first": records[0].mismatch_kl,
        "mismatch_kl_last": records[-1].mismatch_kl,
        "mismatch_kl_max": max(r.mismatch_kl for r in records),
        "logp_diff_max_max": max(r.logp_diff_max for r in records),
        "grad_norm_max": max(r.grad_norm for r in records),
        "seconds": sum(r.rollout_seconds + r.train_seconds for r in records),
    }


def plot(runs: dict[str, list[StepRecord]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("mismatch_kl", "mismatch KL (k3)"), ("logp_diff_max", "max |old_logp - rollout_logp|"),
              ("masked_fraction", "IcePop masked fraction"), ("reward_mean", "training reward (mean)")]
    fig, axes = plt.subplots(2, 2, figsize=(10, 6.5), sharex=True)
    for ax, (field, title) in zip(axes.flat, panels, strict=True):
        for correction, records in runs.items():
            ax.plot([r.step for r in records], [getattr(r, field) for r in records], label=correction)
        ax.set_title(title)
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("step")
    axes[0][0].legend()
    fig.suptitle("bfloat16 rollouts, float32 training: mismatch under none / TIS / IcePop")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.icepop_mismatch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL,
                        help=f"demo-task model directory with train.jsonl (default {DEFAULT_MODEL}, built if missing)")
    parser.add_argument("--steps", type=int, default=16, help="train steps per run")
    parser.add_argument("--out", type=Path, default=Path("outputs/icepop-mismatch"), help="where JSON and PNG go")
    parser.add_argument("--prompts-per-step", type=int, default=8, help="prompts per batch (P)")
    parser.add_argument("--group-size", type=int, default=8, help="completions per prompt (G)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="completion length cap")
    parser.add_argument("--learning-rate", type=float, default=3e-4, help="AdamW learning rate")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (trainer uses it too)")
    parser.add_argument("--alpha", type=float, default=0.5, help="IcePop lower bound")
    parser.add_argument("--beta", type=float, default=5.0, help="IcePop upper bound")
    parser.add_argument("--tis-cap", type=float, default=2.0, help="TIS cap")
    parser.add_argument("--seed", type=int, default=0, help="prompt order, sampling and trainer seed")
    parser.add_argument("--num-threads", type=int, default=0, help="torch threads (0: all cores but one)")
    args = parser.parse_args(argv)
    for name in ("steps", "prompts_per_step", "group_size", "max_new_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: must be >= 1")
    if args.group_size < 2:
        parser.error("--group-size: must be >= 2 (GRPO advantages need a group)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    num_threads = args.num_threads or max(1, cores - 1)
    torch.set_num_threads(num_threads)
    ensure_model(args.model)
    settings = Settings(model=str(args.model), steps=args.steps, prompts_per_step=args.prompts_per_step,
                        group_size=args.group_size, max_new_tokens=args.max_new_tokens,
                        learning_rate=args.learning_rate, temperature=args.temperature, alpha=args.alpha,
                        beta=args.beta, tis_cap=args.tis_cap, seed=args.seed, num_threads=num_threads)
    prompts = read_prompts(args.model, args.steps * args.prompts_per_step, args.seed)
    if len(prompts) < args.steps * args.prompts_per_step:
        parser.error(f"--steps: {args.model}/train.jsonl has {len(prompts)} prompts, fewer than "
                     f"steps x prompts-per-step = {args.steps * args.prompts_per_step}")

    started = time.perf_counter()
    runs = {correction: run_one(correction, settings, prompts) for correction in CORRECTIONS}
    summary = {correction: summarize(records) for correction, records in runs.items()}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "icepop_mismatch.json").write_text(json.dumps({
        "settings": asdict(settings), "wall_seconds": time.perf_counter() - started, "summary": summary,
        "steps": {c: [asdict(r) for r in records] for c, records in runs.items()},
    }, indent=1) + "\n")
    plot(runs, args.out / "icepop_mismatch.png")
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
