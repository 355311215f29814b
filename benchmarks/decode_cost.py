"""The rollout engine's measured cost, fitted to the C3PO++ simulation's cost model.

    python -m benchmarks.decode_cost [--model DIR] [--batches 1,4,16,64] [--contexts 64,448]
                                     [--steps 16] [--repeats 3] [--threads N] [--out FILE]

For every batch size B and prompt length C it fills an engine (ours, `everstep_rollout.engine`, the
one the rollout service runs) with B sequences of C random prompt tokens and decodes `--steps`
tokens each, end of sequence disabled so the batch stays full. Every decode step is one observation
(active sequences B, context tokens B * (C + tokens so far), seconds; `Engine.last_step`), and the
first step of each run, which prefills B * C tokens, one more. A least-squares fit gives the
constants of `benchmarks.c3po.sim.CostModel`:

    decode step seconds = base + per_sequence * active + per_kv_token * context tokens
    prefill seconds     = prefill_per_token * prompt tokens      (the first step minus its decode part)

and, because a real engine's cost is not linear in the batch, the measured curve itself:
`decode_seconds_by_batch`, per batch size the median decode step without its KV part, which the
simulation interpolates instead of base + per_sequence * active (`fit_median_relative_error` and
`curve_median_relative_error` say how well each describes the measured steps).

The last line printed is a JSON object: the fitted `cost_model` (the fields `benchmarks.c3po
--simulate --cost-model FILE` reads; the train and weight-push constants are not measured here and
keep their defaults, named as such under `not_measured`), the fit's relative error, the median
seconds per decode step for each (B, C), and the settings. With `--out FILE` the same object is
written there.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.decode_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(REPO / "examples" / "demo-model"), help="a Hugging Face model directory")
    p.add_argument("--batches", default="1,4,16,64", help="batch sizes (active sequences), comma-separated")
    p.add_argument("--contexts", default="64,448", help="prompt lengths in tokens, comma-separated")
    p.add_argument("--steps", type=int, default=16, help="decode steps per run")
    p.add_argument("--repeats", type=int, default=3, help="runs per (batch, context); medians are reported")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="also write the result JSON here")
    args = p.parse_args(argv)
    for name in ("steps", "repeats"):
        if getattr(args, name) < 2:
            p.error(f"--{name} must be at least 2, got {getattr(args, name)}")
    try:
        args.batch_sizes = [int(b) for b in args.batches.split(",")]
        args.context_lengths = [int(c) for c in args.contexts.split(",")]
    except ValueError:
        p.error(f"--batches and --contexts take comma-separated integers, got {args.batches!r}, {args.contexts!r}")
    if min(args.batch_sizes) < 1 or min(args.context_lengths) < 1:
        p.error("--batches and --contexts must be positive")
    return args


@dataclasses.dataclass(frozen=True)
class Observation:
    active: int
    context_tokens: int
    prefill_tokens: int
    seconds: float


def measure(model: str, batch: int, context: int, steps: int, seed: int, dtype: str) -> list[Observation]:
    """One run: B sequences of `context` prompt tokens, `steps` tokens each; one observation per step."""
    from everstep_rollout.config import EngineConfig
    from everstep_rollout.engine import Engine
    from everstep_rollout.sequence import GenerationRequest, SamplingOptions

    engine = Engine(model, EngineConfig(max_running=batch, max_seq_len=context + steps + 1, dtype=dtype, seed=seed))
    engine.eos_token_ids = frozenset()  # measuring cost: every sequence runs its `steps` tokens
    vocab = engine.vocab_size
    rng = random.Random(seed)
    sampling = SamplingOptions(temperature=1.0, max_new_tokens=steps)
    engine.add([GenerationRequest(id=f"s{i}", prompt_ids=[rng.randrange(3, vocab) for _ in range(context)],
                                  sampling=sampling) for i in range(batch)])
    observations = []
    for step in range(steps):
        engine.step()
        stats = engine.last_step
        if stats.num_decoded != batch:
            raise RuntimeError(f"a step decoded {stats.num_decoded} sequences, expected {batch}")
        observations.append(Observation(active=batch, context_tokens=batch * (context + step),
                                        prefill_tokens=batch * context if step == 0 else 0,
                                        seconds=stats.step_seconds))
    if engine.has_work:
        raise RuntimeError("sequences still running after their max_new_tokens")
    return observations


def fit(observations: list[Observation]) -> tuple[dict[str, float], float]:
    """Least squares of the decode steps' relative error for (base, per_sequence, per_kv_token), then the
    prefill steps' remainder per prompt token; returns the constants and the decode fit's median relative
    error."""
    import torch

    decode = [o for o in observations if not o.prefill_tokens]
    design = torch.tensor([[1.0, o.active, o.context_tokens] for o in decode], dtype=torch.float64)
    seconds = torch.tensor([o.seconds for o in decode], dtype=torch.float64)
    # relative errors (each row divided by its seconds): a 1 ms step counts as much as a 100 ms one; the
    # columns scaled so the solve is well conditioned, then the scale undone
    weights = 1.0 / seconds
    scale = design.abs().max(dim=0).values.clamp(min=1.0)
    solution = torch.linalg.lstsq(design / scale * weights.unsqueeze(1),
                                  (seconds * weights).unsqueeze(1)).solution.squeeze(1) / scale
    base, per_sequence, per_kv = (max(0.0, float(v)) for v in solution)
    predicted = [base + per_sequence * o.active + per_kv * o.context_tokens for o in decode]
    error = statistics.median(abs(p - o.seconds) / o.seconds for p, o in zip(predicted, decode, strict=True))
    prefill = [o for o in observations if o.prefill_tokens]
    remainder = [(o.seconds - (base + per_sequence * o.active + per_kv * o.context_tokens)) / o.prefill_tokens
                 for o in prefill]
    # the measured curve: per batch size, the median decode step without its KV part
    batches = sorted({o.active for o in decode})
    by_batch = tuple((b, statistics.median(o.seconds - per_kv * o.context_tokens for o in decode if o.active == b))
                     for b in batches)
    constants: dict[str, Any] = {"base_seconds": base, "per_sequence_seconds": per_sequence,
                                 "per_kv_token_seconds": per_kv,
                                 "prefill_per_token_seconds": max(0.0, statistics.median(remainder))}
    if len(by_batch) >= 2:
        constants["decode_seconds_by_batch"] = by_batch
    return constants, error


def curve_error(constants: dict[str, Any], observations: list[Observation]) -> float:
    """The median relative error of the decode steps under the measured curve (decode_seconds_by_batch)."""
    from benchmarks.c3po.sim import CostModel

    model = CostModel(**constants)
    decode = [o for o in observations if not o.prefill_tokens]
    return statistics.median(abs(model.decode_seconds(o.active) + model.per_kv_token_seconds * o.context_tokens
                                 - o.seconds) / o.seconds for o in decode)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    from benchmarks.c3po.sim import CostModel

    observations: list[Observation] = []
    medians: dict[str, float] = {}
    for batch in args.batch_sizes:
        for context in args.context_lengths:
            runs = [measure(args.model, batch, context, args.steps, args.seed + r, args.dtype)
                    for r in range(args.repeats)]
            for run in runs:
                observations.extend(run)
            decode_seconds = [o.seconds for run in runs for o in run[1:]]
            medians[f"B{batch}_C{context}"] = statistics.median(decode_seconds)
            print(f"batch {batch:4d} context {context:5d}: {medians[f'B{batch}_C{context}'] * 1e3:8.2f} ms/step",
                  file=sys.stderr)
    constants, error = fit(observations)
    defaults = CostModel()
    measured = dataclasses.replace(defaults, **constants)
    result: dict[str, Any] = {
        "model": args.model,
        "cost_model": dataclasses.asdict(measured),
        "measured": sorted(constants),
        "not_measured": sorted(set(dataclasses.asdict(defaults)) - set(constants)),
        "fit_median_relative_error": round(error, 4),
        "curve_median_relative_error": (round(curve_error(constants, observations), 4)
                                        if "decode_seconds_by_batch" in constants else None),
        "decode_step_seconds_median": medians,
        "settings": {"batches": args.batch_sizes, "contexts": args.context_lengths, "steps": args.steps,
                     "repeats": args.repeats, "threads": args.threads, "dtype": args.dtype},
        "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
        "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
