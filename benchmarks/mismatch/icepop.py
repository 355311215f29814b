"""IcePop under a real mismatch: `python -m benchmarks.mismatch.icepop [--quick] [--model DIR] [--out DIR] ...`.

The Ring-1T / truncated-importance-sampling experiment in small, on the demo task: a quantized rollout
engine (weight-only int8, per output channel, by default) samples while a float32 trainer trains, so
pi_infer and pi_train disagree. Four arms, identical but for the engine and the correction:

  fp32-none     float32 engine, no correction (the control: no engine mismatch)
  int8-none     quantized engine, plain GRPO (no correction)
  int8-tis      quantized engine, truncated importance sampling, cap --tis-cap (2)
  int8-icepop   quantized engine, IcePop masking outside [--alpha, --beta] ([0.5, 5])

(`--quantization int8-tensor`, `fp8` or `int4` renames the three quantized arms.) `--betas 2,3` adds IcePop arms
with a tighter upper bound (`int8-icepop-b2`, `int8-icepop-b3`: [--alpha, 2] and [--alpha, 3]). Each arm runs
once per seed (`--seeds`, default 3): seed s fixes the prompt order, the engine's sampling seed and the trainer's
seed, the same in every arm. A step samples G completions for P prompts of the demo task's train.jsonl with the
in-process rollout `Engine`, scores them (exact match of the boxed answer), computes GRPO advantages, runs
one `PolicyTrainer` step (float32), and pushes the full-precision weights into the engine, which quantizes
them on receipt, as the services do (the engine and trainer are the services' own classes, in one process
to keep gRPC off the 2-core budget). Every `--eval-every` steps (and at steps 0 and the last) a float32
engine holding the trainer's weights scores --eval-prompts held-out prompts of eval.jsonl: avg@4 (4
samples at temperature 1, fixed per-prompt seeds) and greedy accuracy; that measures the policy itself, not
the quantized engine.

Per step it records mismatch KL (k3), max and mean |delta logp|, the masked fraction (what IcePop would
mask, recorded in every arm), gradient norm, entropy, clip fraction, reward. Writes OUT/icepop_mismatch.json
(settings, per-run steps and evaluations, summary) and OUT/icepop_mismatch.png (mismatch, masked fraction,
accuracy and grad norm over steps, one line per arm, mean over seeds with a min-max band), and prints as its
last line a JSON object with, per arm: final_accuracy {mean, std} (avg@4 at the last evaluation, over
seeds), final_greedy {mean, std}, late_accuracy {mean, std} (avg@4 averaged over each run's last 3
evaluations, then over seeds: one evaluation of 50 prompts moves by several points), mismatch_kl_first /
mismatch_kl_last (mean over seeds of the mean over the first / last 10% of steps), masked_fraction_mean,
logp_diff_max_max, routing_disagreement_mean (0 here: a dense model has no routes).

`benchmarks.mismatch.moe` runs this same harness (`run_experiment`) with MoE arms (routing replay).

Sizes: the default (100 steps x 3 seeds x 4 arms at P=8, G=8) is the full run (about an hour on 2 cores);
`--quick` is about 4 to 7 minutes (30 steps, 2 seeds, P=4, 20 eval prompts). The model defaults to the demo
model shipped in examples/demo-model (a --model folder that has no model yet is built first, a few minutes).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.mismatch.records import Arm, EvalRecord, RunResult, Settings, StepRecord
from benchmarks.mismatch.reports import combine, load_runs, plot

DEFAULT_MODEL = Path("examples/demo-model")
QUANTIZATIONS = ("int8", "int8-tensor", "fp8", "int4")
EVAL_SAMPLES = 4
LATE_EVALS = 3  # late_accuracy: the mean of a run's last evaluations, steadier than its last one alone

log = logging.getLogger("benchmarks.mismatch.icepop")


def arms(quantization: str, betas: Sequence[float] = ()) -> list[Arm]:
    """The control, the quantized engine's none / TIS / IcePop arms, then one IcePop arm per tighter `betas`."""
    return [Arm(name="fp32-none", quantization="none", correction="none"),
            *(Arm(name=f"{quantization}-{c}", quantization=quantization, correction=c)
              for c in ("none", "tis", "icepop")),
            *(Arm(name=f"{quantization}-icepop-b{b:g}", quantization=quantization, correction="icepop", beta=b)
              for b in betas)]


def ensure_model(model_dir: Path) -> None:
    if (model_dir / "config.json").is_file():
        return
    print(f"building the demo model in {model_dir} (one time, a few minutes)", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "everstep_tools.demo", "--out", str(model_dir)], check=True)


def read_rows(path: Path, count: int, seed: int | None) -> list[tuple[str, str]]:
    """(prompt, answer) rows of a JSONL file; shuffled with `seed` unless it is None; the first `count`."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if seed is not None:
        random.Random(seed).shuffle(rows)
    return [(row["prompt"], str(row["answer"])) for row in rows[:count]]


def _generate(engine, prompts: list[tuple[str, str]], *, samples: int, temperature: float, max_new_tokens: int,
              tag: str, seed: int | None = None, routes: bool = False) -> list:
    """`samples` completions per prompt, in prompt order; with `seed`, request i samples with seed + i
    (else the engine's own seeded generator); with `routes`, each result carries its routed experts."""
    from everstep_rollout.sequence import GenerationRequest, SamplingOptions

    requests = []
    for p, (prompt, _) in enumerate(prompts):
        prompt_ids = engine.tokenizer(prompt)["input_ids"]
        for g in range(samples):
            index = p * samples + g
            sampling = SamplingOptions(temperature=temperature, max_new_tokens=max_new_tokens,
                                       seed=0 if seed is None else seed + index, return_routed_experts=routes)
            requests.append(GenerationRequest(id=f"{tag}-{index}", prompt_ids=prompt_ids, sampling=sampling))
    return complete(engine, requests)


def complete(engine, requests: list) -> list:
    """Every request run to its end on the in-process `engine`; the results in the requests' order."""
    engine.add(requests)
    results = {}
    while engine.has_work:
        for result in engine.step():
            results[result.id] = result
    return [results[r.id] for r in requests]


def evaluate(engine, trainer, prompts: list[tuple[str, str]], settings: Settings, step: int) -> EvalRecord:
    """avg@4 and greedy accuracy of the trainer's current weights, through a float32 engine."""
    from everstep_tools.demo.evaluation import is_correct

    engine.update_weights(dict(trainer.named_weights()), trainer.version)
    sampled = _generate(engine, prompts, samples=EVAL_SAMPLES, temperature=1.0,
                        max_new_tokens=settings.max_new_tokens, tag=f"eval{step}", seed=10_000)
    greedy = _generate(engine, prompts, samples=1, temperature=0.0, max_new_tokens=settings.max_new_tokens,
                       tag=f"greedy{step}")
    avg = sum(is_correct(r.output_text, prompts[i // EVAL_SAMPLES][1]) for i, r in enumerate(sampled)) / len(sampled)
    exact = sum(is_correct(r.output_text, prompts[i][1]) for i, r in enumerate(greedy)) / len(greedy)
    return EvalRecord(step=step, avg_at_4=avg, greedy=exact)


@contextlib.contextmanager
def mask_only_icepop() -> Iterator[None]:
    """Within it, the trainer's IcePop weight is its mask alone: 1 where alpha <= k <= beta, else 0 (IcePop's own
    weight is k there). A benchmark ablation for arms with `mask_only`; the in-process trainer's loss reads
    `mismatch_weight` from `policy`, which is replaced here and restored on exit."""
    from everstep_trainer.step.losses import policy

    original = policy.mismatch_weight

    def mask_weight(*args: Any, **kwargs: Any) -> Any:
        weight = original(*args, **kwargs)
        return (weight > 0).to(weight.dtype) if kwargs.get("correction") == "icepop" else weight

    policy.mismatch_weight = mask_weight
    try:
        yield
    finally:
        policy.mismatch_weight = original


def run_one(arm: Arm, seed: int, settings: Settings, prompts: list[tuple[str, str]],
            eval_prompts: list[tuple[str, str]]) -> RunResult:
    """One training run of `arm` with `seed`."""
    if arm.mask_only:
        if arm.correction != "icepop":
            raise ValueError(f"arm {arm.name}: mask_only needs correction icepop, got {arm.correction!r}")
        with mask_only_icepop():
            return _run_one(arm, seed, settings, prompts, eval_prompts)
    return _run_one(arm, seed, settings, prompts, eval_prompts)


def _run_one(arm: Arm, seed: int, settings: Settings, prompts: list[tuple[str, str]],
             eval_prompts: list[tuple[str, str]]) -> RunResult:
    import torch

    from everstep.settings.training import TrainerConfig
    from everstep_controller.algo.advantages.grpo import grpo_advantages
    from everstep_rollout.config import EngineConfig
    from everstep_rollout.engine import Engine
    from everstep_tools.demo.evaluation import is_correct
    from everstep_trainer.batch.samples import TrainSample
    from everstep_trainer.step.trainer import PolicyTrainer

    torch.manual_seed(seed)
    rows = settings.prompts_per_step * settings.group_size
    engine = Engine(settings.model, EngineConfig(dtype=arm.dtype, quantization=arm.quantization, device="cpu",
                                                 max_running=rows, max_queued=rows, seed=seed))
    eval_rows = len(eval_prompts) * EVAL_SAMPLES
    eval_engine = Engine(settings.model, EngineConfig(dtype="float32", device="cpu", max_running=min(eval_rows, 128),
                                                      max_queued=eval_rows, seed=seed))
    trainer = PolicyTrainer(settings.model, TrainerConfig(
        correction=arm.correction, correction_level=arm.correction_level, learning_rate=settings.learning_rate,
        alpha=settings.alpha, beta=settings.beta if arm.beta is None else arm.beta, tis_cap=settings.tis_cap,
        temperature=settings.temperature, seed=seed, routing_replay=arm.routing_replay), device="cpu")
    steps, evals = [], [evaluate(eval_engine, trainer, eval_prompts, settings, 0)]
    for step in range(1, settings.steps + 1):
        start = time.perf_counter()
        batch_prompts = prompts[(step - 1) * settings.prompts_per_step:step * settings.prompts_per_step]
        results = _generate(engine, batch_prompts, samples=settings.group_size, temperature=settings.temperature,
                            max_new_tokens=settings.max_new_tokens, tag=f"s{step}", routes=arm.routes)
        rollout_seconds = time.perf_counter() - start
        rewards = [float(is_correct(r.output_text, batch_prompts[i // settings.group_size][1]))
                   for i, r in enumerate(results)]
        samples = []
        for first in range(0, len(results), settings.group_size):
            advantages = grpo_advantages([rewards[first:first + settings.group_size]], normalize_std=True)[0]
            samples += [TrainSample(r.prompt_ids, r.output_ids, r.output_logprobs, a, output_versions=r.output_versions,
                                    routed_experts=r.routed_experts if arm.routes else b"")
                        for r, a in zip(results[first:first + settings.group_size], advantages, strict=True)]
        start = time.perf_counter()
        version, stats = trainer.train_step(samples)
        engine.update_weights(dict(trainer.named_weights()), version)  # full precision; quantized on receipt
        train_seconds = time.perf_counter() - start
        steps.append(StepRecord(
            step=step, reward_mean=sum(rewards) / len(rewards), mismatch_kl=stats.mismatch_kl,
            logp_diff_max=stats.logp_diff_max, logp_diff_abs_mean=stats.logp_diff_abs_mean,
            masked_fraction=stats.masked_fraction, clip_fraction=stats.clip_fraction, loss=stats.loss,
            grad_norm=stats.grad_norm, entropy=stats.entropy, num_tokens=stats.num_tokens,
            rollout_seconds=rollout_seconds, train_seconds=train_seconds,
            routing_disagreement=stats.routing_disagreement))
        if step % settings.eval_every == 0 or step == settings.steps:
            evals.append(evaluate(eval_engine, trainer, eval_prompts, settings, step))
        log.info("%s seed %d step %d: reward %.3f kl %.2e max|dlogp| %.3f masked %.4f routes %.4f%s (%.1fs + %.1fs)",
                 arm.name, seed, step, steps[-1].reward_mean, stats.mismatch_kl, stats.logp_diff_max,
                 stats.masked_fraction, stats.routing_disagreement,
                 f" eval avg@4 {evals[-1].avg_at_4:.3f} greedy {evals[-1].greedy:.3f}" if evals[-1].step == step
                 else "", rollout_seconds, train_seconds)
    return RunResult(arm=arm.name, seed=seed, steps=steps, evals=evals)


def _mean_std(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "std": statistics.pstdev(values) if len(values) > 1 else 0.0}


def summarize(runs: list[RunResult]) -> dict[str, float | dict[str, float]]:
    """One arm's figures over its seeds; see the module docstring."""
    tail = max(1, math.ceil(len(runs[0].steps) / 10))

    def over_seeds(pick) -> float:
        return statistics.fmean(pick(run) for run in runs)

    return {
        "final_accuracy": _mean_std([run.evals[-1].avg_at_4 for run in runs]),
        "final_greedy": _mean_std([run.evals[-1].greedy for run in runs]),
        "late_accuracy": _mean_std([statistics.fmean(e.avg_at_4 for e in run.evals[-LATE_EVALS:]) for run in runs]),
        "initial_accuracy": over_seeds(lambda run: run.evals[0].avg_at_4),
        "mismatch_kl_first": over_seeds(lambda run: statistics.fmean(s.mismatch_kl for s in run.steps[:tail])),
        "mismatch_kl_last": over_seeds(lambda run: statistics.fmean(s.mismatch_kl for s in run.steps[-tail:])),
        "masked_fraction_mean": over_seeds(lambda run: statistics.fmean(s.masked_fraction for s in run.steps)),
        "routing_disagreement_mean": over_seeds(
            lambda run: statistics.fmean(s.routing_disagreement for s in run.steps)),
        "logp_diff_max_max": max(s.logp_diff_max for run in runs for s in run.steps),
        "grad_norm_max": max(s.grad_norm for run in runs for s in run.steps),
        "reward_last": over_seeds(lambda run: statistics.fmean(s.reward_mean for s in run.steps[-tail:])),
        "num_seeds": len(runs),
        "seconds": sum(s.rollout_seconds + s.train_seconds for run in runs for s in run.steps),
    }


def build_parser(prog: str, description: str | None, *, default_model: Path, model_help: str, default_out: Path,
                 quantizations: Sequence[str], default_quantization: str, quantization_help: str,
                 report: str) -> argparse.ArgumentParser:
    """The flags every mismatch experiment shares (`report`: the saved JSON's file name, for --summarize)."""
    parser = argparse.ArgumentParser(prog=prog, description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=default_model, help=model_help)
    parser.add_argument("--out", type=Path, default=default_out, help="where JSON and PNG go")
    parser.add_argument("--quick", action="store_true",
                        help="about 10 minutes: 30 steps, 2 seeds, 4 prompts per step, 20 eval prompts (flags given "
                             "explicitly still win)")
    parser.add_argument("--quantization", choices=quantizations, default=default_quantization, help=quantization_help)
    parser.add_argument("--steps", type=int, default=None, help="train steps per run (default 100; quick 30)")
    parser.add_argument("--seeds", type=int, default=None, help="seeds per arm: 0..N-1 (default 3; quick 2)")
    parser.add_argument("--prompts-per-step", type=int, default=None, help="prompts per batch P (default 8; quick 4)")
    parser.add_argument("--group-size", type=int, default=8, help="completions per prompt (G)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="completion length cap")
    parser.add_argument("--learning-rate", type=float, default=3e-4, help="AdamW learning rate")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (trainer uses it too)")
    parser.add_argument("--alpha", type=float, default=0.5, help="IcePop lower bound")
    parser.add_argument("--beta", type=float, default=5.0, help="IcePop upper bound")
    parser.add_argument("--tis-cap", type=float, default=2.0, help="TIS cap")
    parser.add_argument("--eval-every", type=int, default=10, help="steps between held-out evaluations")
    parser.add_argument("--eval-prompts", type=int, default=None,
                        help="held-out prompts of eval.jsonl (default 50; quick 20)")
    parser.add_argument("--num-threads", type=int, default=0, help="torch threads (0: all cores but one)")
    parser.add_argument("--only-arms", default="", metavar="ARM1,ARM2",
                        help="run only these arms (names as in the summary; default: every arm)")
    parser.add_argument("--seed-list", default="", metavar="S1,S2",
                        help="run these seeds instead of 0..--seeds-1 (to split a full run across processes)")
    parser.add_argument("--summarize", type=Path, default=None, metavar="JSON",
                        help=f"run nothing: print the summary of a saved {report}, computed anew")
    parser.add_argument("--combine", type=Path, nargs="+", default=None, metavar="JSON",
                        help=f"run nothing: merge saved reports of runs split by --only-arms / --seed-list "
                             f"(settings otherwise equal) into OUT/{report} and its PNG, and print the summary")
    return parser


def finish_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> argparse.Namespace:
    """Fill the --quick-dependent defaults and check the shared flags."""
    defaults = {"steps": (100, 30), "seeds": (3, 2), "prompts_per_step": (8, 4), "eval_prompts": (50, 20)}
    for name, (full, quick) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    for name in ("steps", "seeds", "prompts_per_step", "group_size", "max_new_tokens", "eval_every", "eval_prompts"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: must be >= 1")
    if args.group_size < 2:
        parser.error("--group-size: must be >= 2 (GRPO advantages need a group)")
    if args.seed_list:
        try:
            seeds = [int(s) for s in args.seed_list.split(",") if s.strip()]
        except ValueError:
            parser.error(f"--seed-list: comma-separated integers, got {args.seed_list!r}")
        if not seeds or len(set(seeds)) != len(seeds) or min(seeds) < 0:
            parser.error(f"--seed-list: distinct seeds >= 0, got {args.seed_list!r}")
        args.seed_list = seeds
    else:
        args.seed_list = list(range(args.seeds))
    args.only_arms = [a.strip() for a in args.only_arms.split(",") if a.strip()]
    return args


def select_arms(arm_list: list[Arm], only: Sequence[str], parser: argparse.ArgumentParser) -> list[Arm]:
    """The arms of `arm_list` named in `only` (all of them when it is empty), in `arm_list`'s order."""
    names = [arm.name for arm in arm_list]
    unknown = [name for name in only if name not in names]
    if unknown:
        parser.error(f"--only-arms: no arm {', '.join(unknown)}; the arms are {', '.join(names)}")
    return [arm for arm in arm_list if not only or arm.name in only]


def parse_betas(text: str, parser: argparse.ArgumentParser) -> list[float]:
    """--betas: comma-separated IcePop upper bounds, each > 1, no repeats."""
    try:
        betas = [float(b) for b in text.split(",") if b.strip()]
    except ValueError:
        parser.error(f"--betas: comma-separated numbers, got {text!r}")
    if any(not math.isfinite(b) or b <= 1.0 for b in betas) or len({f"{b:g}" for b in betas}) != len(betas):
        parser.error(f"--betas: distinct upper bounds above 1, got {text!r}")
    return betas


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, argparse.ArgumentParser]:
    parser = build_parser(
        "python -m benchmarks.mismatch.icepop", __doc__, default_model=DEFAULT_MODEL,
        model_help=f"demo-task model directory with train.jsonl and eval.jsonl (default {DEFAULT_MODEL}, built if "
                   "missing)",
        default_out=Path("outputs/icepop-mismatch"), quantizations=QUANTIZATIONS, default_quantization="int8",
        quantization_help="the quantized arms' engine setting (int8: per output channel)",
        report="icepop_mismatch.json")
    parser.add_argument("--betas", default="", metavar="B1,B2",
                        help="add one IcePop arm per tighter upper bound, e.g. 2,3 (default: none)")
    args = finish_args(parser.parse_args(argv), parser)
    args.betas = parse_betas(args.betas, parser)
    return args, parser


def resummarize(path: Path) -> dict:
    """The per-arm summary of a saved icepop_mismatch.json (or moe_mismatch.json), computed by this version of
    `summarize`."""
    by_arm: dict[str, list[RunResult]] = {}
    for run in load_runs(path):
        by_arm.setdefault(run.arm, []).append(run)
    return {arm: summarize(runs) for arm, runs in by_arm.items()}


def write_report(path: Path, settings: Settings, arm_list: list[Arm], by_arm: dict[str, list[RunResult]],
                 started: float) -> dict:
    """Writes the report of the runs in `by_arm` (arms without a finished run left out); returns its summary."""
    summary = {arm: summarize(runs) for arm, runs in by_arm.items() if runs}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "settings": asdict(settings), "arms": [asdict(arm) for arm in arm_list],
        "wall_seconds": time.perf_counter() - started,
        "runs": [asdict(run) for runs in by_arm.values() for run in runs], "summary": summary,
    }, indent=1) + "\n")
    return summary


def run_experiment(args: argparse.Namespace, parser: argparse.ArgumentParser, arm_list: list[Arm], *, report: str,
                   title: str, prepare_model: Callable[[Path], None]) -> dict:
    """Every arm of `arm_list` once per seed; writes OUT/`report`.json and .png, prints the summary as the last
    line and returns it. With --summarize, only the summary of that saved report. `prepare_model(args.model)`
    builds or checks the model first (it may exit through the parser)."""
    if args.summarize is not None:
        summary = resummarize(args.summarize)
        print(json.dumps(summary))
        return summary
    if args.combine is not None:
        return _combine(args, parser, report=report, title=title)
    arm_list = select_arms(arm_list, args.only_arms, parser)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    num_threads = args.num_threads or max(1, cores - 1)
    torch.set_num_threads(num_threads)
    prepare_model(args.model)
    for name in ("train.jsonl", "eval.jsonl"):
        if not (args.model / name).is_file():
            parser.error(f"--model: {args.model} has no {name} (the demo task's prompts)")
    settings = Settings(
        model=str(args.model), quantization=args.quantization, steps=args.steps, seeds=args.seed_list,
        prompts_per_step=args.prompts_per_step, group_size=args.group_size, max_new_tokens=args.max_new_tokens,
        learning_rate=args.learning_rate, temperature=args.temperature, alpha=args.alpha, beta=args.beta,
        tis_cap=args.tis_cap, eval_every=args.eval_every, eval_prompts=args.eval_prompts, num_threads=num_threads)
    needed = args.steps * args.prompts_per_step
    eval_prompts = read_rows(args.model / "eval.jsonl", args.eval_prompts, None)
    if len(eval_prompts) < args.eval_prompts:
        parser.error(f"--eval-prompts: {args.model}/eval.jsonl has {len(eval_prompts)} prompts")
    started = time.perf_counter()
    by_arm: dict[str, list[RunResult]] = {arm.name: [] for arm in arm_list}
    for seed in settings.seeds:
        prompts = read_rows(args.model / "train.jsonl", needed, seed)
        if len(prompts) < needed:
            parser.error(f"--steps: {args.model}/train.jsonl has {len(prompts)} prompts, fewer than "
                         f"steps x prompts-per-step = {needed}")
        for arm in arm_list:
            by_arm[arm.name].append(run_one(arm, seed, settings, prompts, eval_prompts))
            # the runs so far, after each one: a long run stopped early still has its finished runs on disk
            # (`--summarize OUT/report.partial.json` summarises them)
            write_report(args.out / f"{report}.partial.json", settings, arm_list, by_arm, started)
    summary = write_report(args.out / f"{report}.json", settings, arm_list, by_arm, started)

    (args.out / f"{report}.partial.json").unlink()
    plot(by_arm, f"{title} (mean over {len(settings.seeds)} seeds, band: min-max)", args.out / f"{report}.png",
         routes=any(arm.routes for arm in arm_list))
    print(json.dumps(summary))
    return summary


def _combine(args: argparse.Namespace, parser: argparse.ArgumentParser, *, report: str, title: str) -> dict:
    """--combine: merge saved reports into OUT/`report`.json and .png; print and return the summary."""

    try:
        settings, arm_list, by_arm = combine(args.combine)
    except ValueError as error:
        parser.error(str(error))
    wall = sum(json.loads(path.read_text()).get("wall_seconds", 0.0) for path in args.combine)
    summary = write_report(args.out / f"{report}.json", settings, arm_list, by_arm, time.perf_counter() - wall)
    plot(by_arm, f"{title} (mean over {len(settings.seeds)} seeds, band: min-max)", args.out / f"{report}.png",
         routes=any(arm.routes for arm in arm_list))
    print(json.dumps(summary))
    return summary


def main(argv: list[str] | None = None) -> dict:
    args, parser = parse_args(argv)
    return run_experiment(args, parser, arms(args.quantization, args.betas), report="icepop_mismatch",
                          title=f"{args.quantization} rollouts vs float32 training: none / TIS / IcePop",
                          prepare_model=ensure_model)


if __name__ == "__main__":
    main()
