"""`python -m benchmarks.rollout_scaling [--quick] [--json-out PATH]`: a readable table, then the JSON summary as
the last line of stdout.

Each section of the benchmark adds its keys to one summary: the fleet simulation (`fleet_speedup`, `fleet`, ...)
and real engines on this machine (`speedup_2`, `real_engines`). A section is a function of the parsed arguments
that prints its table and returns its keys; `--sections` picks them (default: both).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.rollout_scaling.fleet_simulation import (
    BudgetUnit,
    FleetConfig,
    LengthModel,
    Placement,
    Policy,
    Setting,
    SettingResult,
    simulate_setting,
)
from benchmarks.rollout_scaling.real_engines import DEFAULT_PROMPTS, EngineWorkload, measure_real_engines

HEADLINE_ENGINES = 256
QUICK_ENGINE_WORKLOAD = EngineWorkload(num_prompts=8, max_new_tokens=64, repeats=2)
"""--quick's real-engine workload: 64 sequences, two alternating runs of each pool size."""
# the full run's variants at the headline engine count: everstep's token budget, the scheduler's default retention
VARIANTS: dict[str, dict[str, Any]] = {"token_budget": {"budget_unit": BudgetUnit.tokens},
                                       "retention_1": {"retention": 1}}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.rollout_scaling", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="A small run: 64 and 256 simulated engines, one seed, fewer iterations, no variants; "
                        "a smaller real-engine workload, two runs of each pool size.")
    parser.add_argument("--json-out", type=Path, help="Also write the JSON summary to this file.")
    parser.add_argument("--sections", default="fleet,engines",
                        help="Comma-separated: fleet (the simulation), engines (real engine processes).")
    fleet = parser.add_argument_group("fleet simulation")
    fleet.add_argument("--engines", default="64,128,256,512", help="Engine counts, comma-separated (must hold "
                       f"{HEADLINE_ENGINES} for fleet_speedup). --quick: 64,256.")
    fleet.add_argument("--seeds", type=int, default=3, help="Seeds 0..N-1 per setting. --quick: 1.")
    fleet.add_argument("--warmup-iterations", type=int, default=5,
                       help="Iterations run before measuring (carry-over starts from an empty fleet). --quick: 2.")
    fleet.add_argument("--iterations", type=int, default=8, help="Measured iterations per seed. --quick: 3.")
    fleet.add_argument("--slots-per-engine", type=int, default=64, help="Omega / E: sequences an engine decodes at "
                       "once.")
    fleet.add_argument("--group-size", type=int, default=8, help="G: samples per prompt, kept on one engine.")
    fleet.add_argument("--retention", type=int, default=6,
                       help="Sigma: carry-overs allowed before a purge (6: a max_new_tokens rollout that starts "
                       "late in an iteration still finishes on a full engine, so nothing is purged).")
    fleet.add_argument("--slowdown", type=float, default=0.25,
                       help="A full engine decodes each sequence at 1 / (1 + slowdown) tokens a tick.")
    fleet.add_argument("--median-tokens", type=int, default=2000, help="Median response length (log-normal).")
    fleet.add_argument("--length-sigma", type=float, default=1.0, help="Log-normal shape: larger, heavier tail.")
    fleet.add_argument("--max-new-tokens", type=int, default=16384, help="Lengths are cut here.")
    engines = parser.add_argument_group("real engines (speedup_2; --group-size is shared with the simulation)")
    engines.add_argument("--real-model", type=Path, default=None, help="Model directory (default: a random Llama of "
                         "--random-model-mb MB, built for the run; examples/demo-model is the trained demo model).")
    engines.add_argument("--random-model-mb", type=float, default=EngineWorkload.random_model_mb,
                         help="Size of the random Llama (float32 MB).")
    engines.add_argument("--real-prompts-file", type=Path, default=DEFAULT_PROMPTS,
                         help="JSONL of {\"prompt\": text} rows (default: the demo task's).")
    engines.add_argument("--real-prompts", type=int, default=None, help="Prompts of the workload (default "
                         f"{EngineWorkload.num_prompts}; --quick: {QUICK_ENGINE_WORKLOAD.num_prompts}).")
    engines.add_argument("--real-max-new-tokens", type=int, default=None, help="Output tokens per sequence at most "
                         f"(default {EngineWorkload.max_new_tokens}; --quick: {QUICK_ENGINE_WORKLOAD.max_new_tokens}).")
    engines.add_argument("--real-max-running", type=int, default=EngineWorkload.max_running,
                         help="KV cache slots of each engine.")
    engines.add_argument("--threads-per-engine", type=int, default=EngineWorkload.threads_per_engine,
                         help="torch and OpenMP threads of each engine.")
    engines.add_argument("--real-repeats", type=int, default=None, help="Alternating runs of each pool size (default "
                         f"{EngineWorkload.repeats}; --quick: {QUICK_ENGINE_WORKLOAD.repeats}).")
    args = parser.parse_args(argv)
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    if not args.sections or set(args.sections) - set(SECTIONS):
        parser.error(f"--sections: {args.sections} is not a list of {sorted(SECTIONS)}")
    if args.quick:
        args.engines, args.seeds, args.warmup_iterations, args.iterations = "64,256", 1, 2, 3
    defaults = QUICK_ENGINE_WORKLOAD if args.quick else EngineWorkload()

    def given(value: Any, default: Any) -> Any:
        return default if value is None else value

    try:
        args.engine_workload = EngineWorkload(
            model=args.real_model, random_model_mb=args.random_model_mb, prompts=args.real_prompts_file,
            num_prompts=given(args.real_prompts, defaults.num_prompts), group_size=args.group_size,
            max_new_tokens=given(args.real_max_new_tokens, defaults.max_new_tokens),
            max_running=args.real_max_running, threads_per_engine=args.threads_per_engine,
            repeats=given(args.real_repeats, defaults.repeats))
    except ValueError as e:
        parser.error(f"real engines: {e}")
    args.engine_counts = sorted({int(e) for e in args.engines.split(",")})
    if HEADLINE_ENGINES not in args.engine_counts:
        parser.error(f"--engines must include {HEADLINE_ENGINES} (fleet_speedup is measured there)")
    return args


def fleet_settings(args: argparse.Namespace) -> list[Setting]:
    """Every engine count under the four policies; the full run adds variants at the headline engine count:
    the other placements, and everstep's token budget and the scheduler's default retention (1), each with
    residual and round-robin placement."""
    lengths = LengthModel(median_tokens=args.median_tokens, sigma=args.length_sigma,
                          max_new_tokens=args.max_new_tokens)

    def config(num_engines: int, **changes: Any) -> FleetConfig:
        fields = {"num_engines": num_engines, "slots_per_engine": args.slots_per_engine,
                  "group_size": args.group_size, "retention": args.retention, "slowdown": args.slowdown,
                  "lengths": lengths, **changes}
        return FleetConfig(**fields)

    settings = []
    for num_engines in args.engine_counts:
        settings += [Setting(config=config(num_engines), policy=Policy.c3po_global, placement=Placement.residual),
                     Setting(config=config(num_engines), policy=Policy.static_split),
                     Setting(config=config(num_engines), policy=Policy.static_split_keep_decoding),
                     Setting(config=config(num_engines), policy=Policy.sync_batch)]
    if not args.quick:
        headline = config(HEADLINE_ENGINES)
        settings += [Setting(config=headline, policy=Policy.c3po_global, placement=Placement.oracle),
                     Setting(config=headline, policy=Policy.c3po_global, placement=Placement.round_robin)]
        for changes in VARIANTS.values():
            varied = config(HEADLINE_ENGINES, **changes)
            settings += [Setting(config=varied, policy=Policy.c3po_global, placement=Placement.residual),
                         Setting(config=varied, policy=Policy.c3po_global, placement=Placement.round_robin),
                         Setting(config=varied, policy=Policy.static_split),
                         Setting(config=varied, policy=Policy.static_split_keep_decoding)]
    return settings


def _find(results: list[SettingResult], num_engines: int, policy: Policy, **changes: Any) -> SettingResult:
    placement = Placement.residual if policy == Policy.c3po_global else None
    wanted = {"budget_unit": BudgetUnit.samples, **changes}
    for result in results:
        setting = result.setting
        if (setting.config.num_engines, setting.policy, setting.placement) == (num_engines, policy, placement) and \
                all(getattr(setting.config, k) == v for k, v in wanted.items()):
            return result
    raise KeyError((num_engines, policy, changes))


def _ratio(slow: SettingResult, fast: SettingResult) -> float:
    return round(slow.median_ticks / fast.median_ticks, 3)


def print_fleet_table(rows: list[dict[str, Any]]) -> None:
    header = (f"{'engines':>7} {'policy':<26} {'placement':<11} {'budget':<7} {'sigma':>5} {'median ticks':>12} "
              f"{'tokens/tick':>11} {'util':>6} {'trained/it':>10} {'purged/it':>9}")
    print(header)
    print("-" * len(header))
    for row in rows:
        print(f"{row['engines']:>7} {row['policy']:<26} {row['placement'] or '-':<11} {row['budget_unit']:<7} "
              f"{row['retention']:>5} {row['median_ticks']:>12.1f} {row['tokens_per_tick']:>11.1f} "
              f"{row['utilization']:>6.3f} {row['trained_samples_per_iteration']:>10.1f} "
              f"{row['purged_samples_per_iteration']:>9.1f}")


def simulate_fleet(args: argparse.Namespace) -> dict[str, Any]:
    """The fleet simulation section: runs every setting, prints the table, returns its summary keys."""
    seeds = list(range(args.seeds))
    results = []
    started = time.monotonic()
    for setting in fleet_settings(args):
        results.append(simulate_setting(setting, seeds=seeds, warmup_iterations=args.warmup_iterations,
                                        measured_iterations=args.iterations))
        print(f"[fleet] {setting.config.num_engines} engines, {setting.policy}, {setting.placement or '-'}, "
              f"{setting.config.budget_unit}, sigma {setting.config.retention}: {results[-1].median_ticks:.1f} "
              f"ticks ({time.monotonic() - started:.0f} s)", file=sys.stderr, flush=True)
    rows = [r.as_json() for r in results]
    print("\nFleet simulation: rollout-phase ticks per iteration (median over iterations and seeds)")
    print_fleet_table(rows)

    speedups = {str(n): _ratio(_find(results, n, Policy.static_split), _find(results, n, Policy.c3po_global))
                for n in args.engine_counts}
    sync_speedups = {str(n): _ratio(_find(results, n, Policy.sync_batch), _find(results, n, Policy.c3po_global))
                     for n in args.engine_counts}
    keep_decoding_speedups = {
        str(n): _ratio(_find(results, n, Policy.static_split_keep_decoding), _find(results, n, Policy.c3po_global))
        for n in args.engine_counts}
    summary: dict[str, Any] = {
        "fleet_speedup": speedups[str(HEADLINE_ENGINES)],
        "fleet_speedup_by_engines": speedups,
        "fleet_keep_decoding_speedup_by_engines": keep_decoding_speedups,
        "fleet_sync_speedup_by_engines": sync_speedups,
    }
    if not args.quick:
        summary["fleet_variant_speedups"] = {  # each static split against c3po_global, at the headline count
            name: {str(policy): _ratio(_find(results, HEADLINE_ENGINES, policy, **changes),
                                       _find(results, HEADLINE_ENGINES, Policy.c3po_global, **changes))
                   for policy in (Policy.static_split, Policy.static_split_keep_decoding)}
            for name, changes in VARIANTS.items()}
    print(f"\nfleet_speedup (static_split / c3po_global at {HEADLINE_ENGINES} engines): {summary['fleet_speedup']}")
    summary["fleet_model"] = {
        "slots_per_engine": args.slots_per_engine, "group_size": args.group_size, "retention": args.retention,
        "slowdown": args.slowdown, "median_tokens": args.median_tokens, "length_sigma": args.length_sigma,
        "max_new_tokens": args.max_new_tokens, "seeds": args.seeds, "warmup_iterations": args.warmup_iterations,
        "measured_iterations": args.iterations, "samples_per_iteration": "engines x slots_per_engine",
    }
    summary["fleet"] = rows
    return summary


def real_engines(args: argparse.Namespace) -> dict[str, Any]:
    """The real-engine section: one engine against two, on the same work (`real_engines.py`)."""
    return measure_real_engines(args.engine_workload, num_engines=2)


SECTIONS = {"fleet": simulate_fleet, "engines": real_engines}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    summary: dict[str, Any] = {}
    for name in args.sections:
        summary.update(SECTIONS[name](args))
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
