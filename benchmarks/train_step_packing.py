"""Train-step cost, padded against packed micro-batches and packed with shared prompts:
`python -m benchmarks.train_step_packing [--model DIR] ...`.

One batch of real rollouts: the first --num-prompts prompts of the model's workload (the demo task's
train.jsonl for the demo model, the chat prompts of examples/data/arith-word-problems for a chat model; the
same as `benchmarks.rollout_throughput`), --group-size samples each at temperature 1 from our rollout
engine, with random advantages. The same batch is trained by three `PolicyTrainer`s built alike but for
`packing` (off: every micro-batch right-padded to its longest sequence; on: sequences back to back in rows,
`everstep_trainer.batch.samples`) and `share_prompts` (the shared arm: packed, each prompt computed once for the
samples of a micro-batch that share it, `everstep_trainer.batch.shared_prompts`), alternately (padded, packed,
shared, padded, ...) for --repeats train steps each,
from the same weights every time (each step trains a fresh copy of the initial state, so the runs compare
like with like).

Reported (the last line of stdout, one JSON object): per arm the median wall seconds of a train step, of its
log-prob pass and of its forward-backward, the padding fraction of the positions computed and the shared
prompt fraction (real tokens not computed); `speedup` (padded median over packed median); `speedup_shared`
(packed median over shared median) and `speedup_shared_vs_padded`; `max_loss_diff` and `max_grad_norm_diff`
between the arms' steps (the same batch and weights: equal up to floating-point order); the batch's shape and
the settings.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import random
import statistics
import sys
from pathlib import Path

from benchmarks.rollout_throughput import CHAT_PROMPTS, read_prompts, tokenize_prompts

log = logging.getLogger("benchmarks.train_step_packing")

DEFAULT_MODEL = Path("examples/demo-model")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.train_step_packing", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL, help=f"Hugging Face model directory ({DEFAULT_MODEL})")
    p.add_argument("--num-prompts", type=int, default=64, help="prompts in the batch")
    p.add_argument("--group-size", type=int, default=8, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=200, help="longest sampled response")
    p.add_argument("--micro-batch-tokens", type=int, default=16384, help="the trainer's micro-batch budget")
    p.add_argument("--repeats", type=int, default=5, help="train steps per arm (medians reported)")
    p.add_argument("--num-threads", type=int, default=0, help="torch threads (0: all cores but one)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for name in ("num_prompts", "group_size", "max_new_tokens", "micro_batch_tokens", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def rollout_batch(model_dir: Path, args: argparse.Namespace) -> list:
    """--num-prompts x --group-size sampled completions as train samples with random advantages."""
    from everstep_rollout.config import EngineConfig
    from everstep_rollout.engine import Engine
    from everstep_rollout.sequence import GenerationRequest, SamplingOptions
    from everstep_trainer.batch.samples import TrainSample

    rows = args.num_prompts * args.group_size
    engine = Engine(str(model_dir), EngineConfig(dtype="float32", device="cpu", max_running=min(rows, 256),
                                                 max_queued=rows, seed=args.seed))
    chat = bool(engine.tokenizer.chat_template)
    prompts = read_prompts(CHAT_PROMPTS if chat else model_dir / "train.jsonl", args.num_prompts)
    prompt_ids = tokenize_prompts(engine.tokenizer, prompts)
    sampling = SamplingOptions(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=args.max_new_tokens)
    engine.add(GenerationRequest(id=f"r{p}-{g}", prompt_ids=ids, sampling=sampling)
               for p, ids in enumerate(prompt_ids) for g in range(args.group_size))
    results = []
    while engine.has_work:
        results += engine.step()
    rng = random.Random(args.seed)
    return [TrainSample(r.prompt_ids, r.output_ids, r.output_logprobs, rng.uniform(-1.0, 1.0))
            for r in sorted(results, key=lambda r: r.id)]


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    import torch

    from everstep.settings.training import TrainerConfig
    from everstep_trainer.step.trainer import PolicyTrainer

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    num_threads = args.num_threads or max(1, cores - 1)
    torch.set_num_threads(num_threads)
    samples = rollout_batch(args.model, args)
    lengths = [s.num_tokens for s in samples]
    log.info("batch: %d samples, %d tokens, longest %d, mean %.1f", len(samples), sum(lengths), max(lengths),
             statistics.fmean(lengths))
    trainers = {}
    layouts = {"padded": (False, False), "packed": (True, False), "shared": (True, True)}
    for arm, (packing, share_prompts) in layouts.items():
        config = TrainerConfig(learning_rate=1e-5, micro_batch_tokens=args.micro_batch_tokens, packing=packing,
                               share_prompts=share_prompts, correction="icepop", seed=args.seed)
        trainer = PolicyTrainer(args.model, config, device="cpu")
        trainers[arm] = (trainer, copy.deepcopy(trainer.model.state_dict()),
                         copy.deepcopy(trainer.optimizer.state_dict()))
    runs: dict[str, list] = {arm: [] for arm in layouts}
    for repeat in range(args.repeats):
        for arm in layouts:
            trainer, weights, optimizer = trainers[arm]
            trainer.model.load_state_dict(weights)
            trainer.optimizer.load_state_dict(optimizer)
            _, stats = trainer.train_step(samples)
            seconds = stats.logp_seconds + stats.forward_backward_seconds + stats.optimizer_seconds
            runs[arm].append(stats)
            log.info("repeat %d %s: %.2f s (log-probs %.2f, forward-backward %.2f), padding %.3f, shared %.3f, "
                     "loss %.6f", repeat, arm, seconds, stats.logp_seconds, stats.forward_backward_seconds,
                     stats.padding_fraction, stats.shared_prompt_fraction, stats.loss)

    def median(arm: str, pick) -> float:
        return statistics.median(pick(s) for s in runs[arm])

    def total(s) -> float:
        return s.logp_seconds + s.forward_backward_seconds + s.optimizer_seconds

    arms = {arm: {"step_seconds": median(arm, total), "logp_seconds": median(arm, lambda s: s.logp_seconds),
                  "forward_backward_seconds": median(arm, lambda s: s.forward_backward_seconds),
                  "padding_fraction": runs[arm][0].padding_fraction,
                  "shared_prompt_fraction": runs[arm][0].shared_prompt_fraction,
                  "step_seconds_all": [total(s) for s in runs[arm]]} for arm in runs}
    result = {
        "model": str(args.model), "num_samples": len(samples), "num_tokens": sum(lengths),
        "longest": max(lengths), "mean_length": statistics.fmean(lengths), "num_threads": num_threads,
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "arms": arms, "speedup": arms["padded"]["step_seconds"] / arms["packed"]["step_seconds"],
        "speedup_shared": arms["packed"]["step_seconds"] / arms["shared"]["step_seconds"],
        "speedup_shared_vs_padded": arms["padded"]["step_seconds"] / arms["shared"]["step_seconds"],
        "max_loss_diff": max(abs(a.loss - b.loss) for other in ("packed", "shared")
                             for a, b in zip(runs["padded"], runs[other], strict=True)),
        "max_grad_norm_diff": max(abs(a.grad_norm - b.grad_norm) for other in ("packed", "shared")
                                  for a, b in zip(runs["padded"], runs[other], strict=True)),
        "load_average": os.getloadavg(),
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
