"""The settings of a `benchmarks.time_to_accuracy` run, from its flags and the job spec it starts from.

- The demo model without ``--spec`` keeps the benchmark's demo defaults (`DEMO_DEFAULTS`: the demo job's
  data, G, learning rate, temperature and response length; 64 prompts a step; 30 steps; avg@4 on 200
  held-out prompts every 5 steps).
- Any other model, or ``--spec FILE``, takes them from the spec (default examples/smollm2-full.yaml):
  data, G, max_new_tokens, temperature, trainer.num_minibatches, learning rate, steps, evaluation, seed,
  and prompts per step (a sync spec's scheduler.prompts_per_iteration).
- The LoRA of the `lora` and `trl-lora` arms, and their learning rate, come from ``--lora-spec``
  (default examples/smollm2-lora.yaml, its trainer.lora and trainer.learning_rate).

A flag always wins; one that disagrees with the value it replaces is recorded in ``TtaConfig.overrides``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from benchmarks.time_to_accuracy.config import DEMO_SPEC, REPO, Arm, LoraArm, Override, TtaConfig
from everstep.rest.job_spec import JobSpec, SchedulerMode
from everstep.settings.training import LoraSettings
from everstep_cli.job_file import load_job_file

DEMO_MODEL = REPO / "examples" / "demo-model"
SMOLLM2_FULL_SPEC = REPO / "examples" / "smollm2-full.yaml"
SMOLLM2_LORA_SPEC = REPO / "examples" / "smollm2-lora.yaml"
QUICK = {"steps": 6, "eval_every": 3, "eval_prompts": 50}
DEMO_DEFAULTS: dict[str, Any] = {"steps": 30, "eval_every": 5, "eval_prompts": 200, "eval_samples": 4,
                                 "group_size": 8, "learning_rate": 5e-4, "temperature": 1.0, "max_new_tokens": 200,
                                 "prompts_per_step": 64, "token_budget": 16384, "pool_capacity": 512,
                                 "num_minibatches": None, "seed": 0}
DEMO_ARMS = "trl,sync,c3po,overlap"
SPEC_ARMS = "full,lora,trl,trl-lora"
# settings a flag of the same name (dashes for underscores) sets
FLAGGED = ("train_path", "eval_path", *DEMO_DEFAULTS)


def _load(path: Path, flag: str) -> JobSpec:
    try:
        return JobSpec.model_validate(load_job_file(path))
    except (OSError, ValueError) as e:
        raise ValueError(f"{flag} {path}: {e}") from e


def spec_defaults(job: JobSpec) -> dict[str, Any]:
    """The benchmark's settings as the job spec ``job`` has them."""
    sync = job.scheduler.mode == SchedulerMode.sync
    return {
        "model": job.model_path, "train_path": job.dataset.train_path, "eval_path": job.dataset.eval_path,
        "steps": job.steps, "eval_every": job.evaluation.every, "eval_prompts": job.evaluation.num_prompts,
        "eval_samples": job.evaluation.samples_per_prompt, "group_size": job.algorithm.group_size,
        "learning_rate": job.trainer.learning_rate, "temperature": job.sampling.temperature,
        "max_new_tokens": job.sampling.max_new_tokens,
        "prompts_per_step": job.scheduler.prompts_per_iteration if sync else DEMO_DEFAULTS["prompts_per_step"],
        "token_budget": DEMO_DEFAULTS["token_budget"] if sync else job.scheduler.token_budget,
        "pool_capacity": DEMO_DEFAULTS["pool_capacity"] if sync else job.scheduler.pool_capacity,
        "num_minibatches": job.trainer.num_minibatches, "seed": job.seed,
    }


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return a is not None and b is not None and abs(float(a) - float(b)) <= 1e-12 * max(abs(a), abs(b), 1.0)
    return a == b


def resolve(args: argparse.Namespace) -> TtaConfig:
    """The run's settings: each flag given, else the spec's (or the demo defaults'); disagreeing flags recorded."""
    demo = args.spec is None and (args.model is None or Path(args.model).resolve() == DEMO_MODEL.resolve())
    spec_path = Path(args.spec) if args.spec else (DEMO_SPEC if demo else SMOLLM2_FULL_SPEC)
    job = _load(spec_path, "--spec")
    if demo:
        model = Path(args.model) if args.model else DEMO_MODEL
        base = {**DEMO_DEFAULTS, "model": str(model), "train_path": str(model / "train.jsonl"),
                "eval_path": str(model / "eval.jsonl")}
    else:
        base = spec_defaults(job)
    flags = {name: getattr(args, name) for name in FLAGGED}
    flags["model"] = args.model
    if args.quick:  # --quick's sizes count as flags; flags given explicitly win
        flags.update({k: v for k, v in QUICK.items() if flags[k] is None})
    values: dict[str, Any] = {}
    overrides: list[Override] = []
    for name, value in flags.items():
        values[name] = base[name] if value is None else value
        if value is not None and name in base and not _same(_comparable(name, value), _comparable(name, base[name])):
            overrides.append(Override(setting=name, spec_value=base[name], flag_value=value))
    lora, lora_learning_rate, lora_overrides = _lora(args)
    arms = tuple(Arm(a.strip()) for a in (args.arms or (DEMO_ARMS if demo else SPEC_ARMS)).split(",") if a.strip())
    if not arms:
        raise ValueError("--arms names no arm")
    return TtaConfig(
        **{k: v for k, v in values.items() if k != "model"}, model=str(values["model"]),
        spec=str(spec_path.resolve()), settings_from="demo defaults" if demo else "spec",
        threads_per_worker=args.threads_per_worker, poll_seconds=args.poll_seconds, arms=arms, repeats=args.repeats,
        lora=lora, lora_learning_rate=lora_learning_rate, lora_spec=str(Path(args.lora_spec or SMOLLM2_LORA_SPEC)
                                                                        .resolve()),
        concurrent=args.concurrent, overrides=tuple(overrides + lora_overrides),
    )


def _comparable(name: str, value: Any) -> Any:
    return str(Path(value).resolve()) if name in ("model", "train_path", "eval_path") else value


def _lora(args: argparse.Namespace) -> tuple[LoraArm, float, list[Override]]:
    """The LoRA arms' adapters and learning rate: the flags, else --lora-spec's trainer.lora and learning rate."""
    path = Path(args.lora_spec or SMOLLM2_LORA_SPEC)
    job = _load(path, "--lora-spec")
    if job.trainer.lora is None:
        raise ValueError(f"--lora-spec {path}: the job has no trainer.lora to take the LoRA arms' adapters from")
    spec_lora = job.trainer.lora
    targets = None if args.lora_target_modules is None else [
        t.strip() for t in args.lora_target_modules.split(",") if t.strip()]
    flags: dict[str, Any] = {"rank": args.lora_rank, "alpha": args.lora_alpha, "dropout": args.lora_dropout,
                             "target_modules": targets}
    merged = {k: getattr(spec_lora, k) if v is None else v for k, v in flags.items()}
    try:
        settings = LoraSettings(**merged)  # the trainer's own checks, with their field names
    except ValueError as e:
        raise ValueError(f"--lora-*: {e}") from e
    overrides = [Override(setting=f"lora.{k}", spec_value=getattr(spec_lora, k), flag_value=v)
                 for k, v in flags.items() if v is not None and not _same(v, getattr(spec_lora, k))]
    learning_rate = job.trainer.learning_rate if args.lora_learning_rate is None else args.lora_learning_rate
    if args.lora_learning_rate is not None and not _same(args.lora_learning_rate, job.trainer.learning_rate):
        overrides.append(Override(setting="lora_learning_rate", spec_value=job.trainer.learning_rate,
                                  flag_value=args.lora_learning_rate))
    lora = LoraArm(rank=settings.rank, alpha=settings.alpha, dropout=settings.dropout,
                   target_modules=tuple(settings.target_modules))
    return lora, learning_rate, overrides
