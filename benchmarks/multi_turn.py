"""Multi-turn tool rollouts: `python -m benchmarks.multi_turn [--quick] [--tool-latency 0.2] [--out FILE]`.

The tool task: a real Llama checkpoint (tests/tool_fixtures.make_successor_model: attention and MLP outputs zeroed,
so the next token depends on the current one only) with Qwen2.5's chat template (tools included) and a word-level
tokenizer. Sampled at temperature 1, every model turn "thinks" a geometric number of tokens (`S S S ...`, each
followed by another with probability `--think`), then either calls the example calculator environment
(examples/environments/calculator.py, over HTTP, in its own process, every step delayed by `--tool-latency`
seconds) or answers (`answer 42`), the call with probability `--call-share`; `--max-turns` bounds the turns. Turn
lengths and turn counts are long-tailed, as real agent trajectories are; the model is tiny, so the figures are about
the loop (tool latency, batching), not about a model's decode cost.

(a) One engine, the same seeded sequences (`SamplingOptions.seed`: a step a sequence spends paused or taking its
    reply draws nothing from its generator, so each mode writes exactly the same tokens, checked:
    `same_sequences`), three ways to run the tools:
    - `concurrent`: the engine's tool loop (docs/tools.md): a sequence waiting for its tool is paused in its KV
      slot while every other one goes on decoding;
    - `turn_sync` (the serial loop, the headline baseline): generate a turn for every sequence, wait for all their
      tools (run in parallel), generate the next turn. Sequences that ended their turn wait, paused in their KV
      slots, for the batch; no history is prefilled again (a real serial loop would re-prefill it, so this
      baseline is a generous one);
    - `step_sync`: the batch stops whenever a call runs (the calls made at one step run in parallel, then the
      batch goes on).
    `--num-sequences` (256) sequences, `--max-running` (64) KV slots: the engine takes every sequence at once and
    keeps its slots busy (a sequence paused for its tool gives its slot to a queued one when every slot is taken, and
    is prefilled again after its reply: `tool_evictions`); the serial loops run static batches of `--max-running`.
    With `--max-running` >= `--num-sequences` all three run one batch. Model tokens (tool replies excluded) per wall
    second; the runs alternate, `--repeats` times, medians reported. `concurrent_vs_serial_ratio` = concurrent /
    turn_sync.
(b) C3PO++ against sync at equal trained samples through the real controller (benchmarks.c3po.real: Redis, the
    reward service, the controller's job runner, a real rollout engine and trainer over gRPC), the same tool task
    and environment, reward = the `tool_use` verifier with min_calls 1 (1 when the trajectory made a well-formed
    call, else 0): `c3po_rollout_speedup` (sync rollout seconds per trained sample over C3PO++'s) and
    `c3po_reward_ratio`: the final policies' held-out reward, c3po/sync. Both jobs run the controller's evaluation
    (spec.evaluation) before and after training: `--eval-prompts` x `--eval-samples-per-prompt` (128 x 8) fresh
    samples at the training temperature, with the job's tools. The mean reward of the samples a run trained is a
    biased and noisy measure of its policy under C3PO++ (an iteration trains what finished first: here the short
    trajectories, which called nothing and score 0; the long ones are carried over or purged), so it is reported
    beside, not as the headline: `reward_ratio_last_20pct` (the former headline) and `reward_ratio_trained` (every
    trained sample). The two step-0 evaluations score the same base model: `base_reward_ratio` is the evaluation's
    own noise.

    `--pairs N` runs (b) N times, seeds `--seed`, `--seed` + 1, ..., each pair sync then c3po, so that the jobs
    alternate (sync, c3po, sync, c3po, ...) and load that comes and goes falls on both modes. Then
    `c3po_rollout_speedup` is the median of the pairs' speedups, and `c3po_reward_ratio` the pooled held-out ratio
    (the sum of c3po's final rewards over sync's) with a standard error that is the larger of the pairs' spread
    (paired, delta method: seed-to-seed training noise included) and the evaluations' own binomial error.
    `--target-se` stops after the third pair or later, once that error is at most the target. `reward_verdict`:
    `holds` (no loss at two standard errors: ratio + 2 se >= 1), `loses`, or `undecided` while the error is above
    0.03.

The last line of output is one JSON object with `concurrent_vs_serial_ratio`, `c3po_rollout_speedup`,
`c3po_reward_ratio`, every run, the settings and the load average before and after.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import logging
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("benchmarks.multi_turn")

REPO = Path(__file__).resolve().parents[1]
CALCULATE = ["<tool_call>", '{"name":', '"calculate",', '"arguments":', '{"expression":', '"6*7"}}', "</tool_call>",
             "<|im_end|>"]
MODES = ("concurrent", "turn_sync", "step_sync")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.multi_turn", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes (a minute or two)")
    p.add_argument("--tool-latency", type=float, default=0.2, help="seconds every environment step takes")
    p.add_argument("--think", type=float, default=0.9, help="probability that a thinking token is followed by another")
    p.add_argument("--call-share", type=float, default=0.7, help="probability that a turn ends with a call")
    p.add_argument("--max-turns", type=int, default=None, help="model turns per trajectory (default 6; quick 4)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="per trajectory, replies included (default 320)")
    p.add_argument("--num-sequences", type=int, default=None, help="(a): sequences (default 256; quick 32)")
    p.add_argument("--max-running", type=int, default=None,
                   help="(a): KV slots (default 64; quick 8); fewer than the sequences: the engine refills its slots "
                        "(a paused sequence gives its slot to a queued one and is prefilled again after its reply), "
                        "the serial loops run static batches of this many")
    p.add_argument("--repeats", type=int, default=None, help="(a): runs of each mode (default 3; quick 1)")
    p.add_argument("--group-size", type=int, default=None, help="(b): G (default 8; quick 4)")
    p.add_argument("--prompts-per-iteration", type=int, default=None, help="(b): prompts per step (default 8; quick 4)")
    p.add_argument("--trained-samples", type=int, default=None, help="(b): samples each run trains (default 640; "
                                                                      "quick 48)")
    p.add_argument("--eval-prompts", type=int, default=None,
                   help="(b): held-out prompts evaluated before and after each run (default 128; quick 16)")
    p.add_argument("--eval-samples-per-prompt", type=int, default=None,
                   help="(b): samples per held-out prompt (default 8; quick 4)")
    p.add_argument("--retention", type=int, default=2, help="(b): sigma")
    p.add_argument("--learning-rate", type=float, default=1e-4, help="(b) (1e-3 destabilised the tool model)")
    p.add_argument("--pairs", type=int, default=1,
                   help="(b): sync/c3po pairs, seeds --seed, --seed + 1, ... (jobs alternate sync, c3po, sync, ...); "
                        "the speedup is their median, the reward ratio pooled")
    p.add_argument("--target-se", type=float, default=0.0,
                   help="(b): stop once at least 3 pairs ran and the pooled reward ratio's standard error is at most "
                        "this (0: run every pair)")
    p.add_argument("--skip-c3po", action="store_true", help="run (a) only")
    p.add_argument("--skip-loop", action="store_true", help="run (b) only")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", type=Path, default=None, help="also write the JSON result here")
    args = p.parse_args(argv)
    quick = args.quick
    defaults = {"max_turns": 4 if quick else 6, "max_new_tokens": 320,
                "num_sequences": 32 if quick else 256, "max_running": 8 if quick else 64,
                "repeats": 1 if quick else 3, "group_size": 4 if quick else 8,
                "prompts_per_iteration": 4 if quick else 8, "trained_samples": 48 if quick else 640,
                "eval_prompts": 16 if quick else 128, "eval_samples_per_prompt": 4 if quick else 8}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 < args.think < 1:
        p.error("--think must be in (0, 1)")
    if not 0 < args.call_share < 1:
        p.error("--call-share must be in (0, 1)")
    if args.tool_latency < 0:
        p.error("--tool-latency must be >= 0")
    if args.pairs < 1:
        p.error("--pairs must be >= 1")
    if args.target_se < 0:
        p.error("--target-se must be >= 0")
    return args


def build_model(out: Path, *, think: float, call_share: float) -> Path:
    """The tool task's model (see the module docstring): the model's final norm scales the one-hot hidden state by
    sqrt(hidden) (8), so a head weight of 20 + log(p) / 8 gives the logit 160 + log(p); every other word 0."""
    sys.path.insert(0, str(REPO / "tests"))
    from tool_fixtures import make_successor_model

    def logit(probability: float) -> float:
        return 20.0 + math.log(probability) / 8.0

    successor: dict[str, str | dict[str, float]] = {
        **dict(zip(CALCULATE, CALCULATE[1:], strict=False)), "assistant": "S", "answer": "42", "42": "<|im_end|>",
        "S": {"S": logit(think), "<tool_call>": logit((1 - think) * call_share),
              "answer": logit((1 - think) * (1 - call_share))}}
    return make_successor_model(out, successor)


class Calculator:
    """examples/environments/calculator.py in its own process."""

    def __init__(self, delay_seconds: float) -> None:
        from everstep.processes import free_port

        port = free_port()
        self.process = subprocess.Popen(
            [sys.executable, str(REPO / "examples/environments/calculator.py"), "--port", str(port),
             "--step-delay-seconds", str(delay_seconds)], stdout=subprocess.PIPE, text=True, start_new_session=True)
        assert self.process.stdout is not None
        if "calculator environment" not in self.process.stdout.readline():
            raise RuntimeError("the calculator environment did not start")
        self.url = f"http://127.0.0.1:{port}"

    def __enter__(self) -> Calculator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.process.terminate()
        self.process.wait(10)


def tools_section(url: str, max_turns: int) -> dict[str, Any]:
    sys.path.insert(0, str(REPO / "examples/environments"))
    from calculator import TOOLS

    return {"environment": "http", "url": url, "functions": TOOLS, "max_turns": max_turns,
            "max_tool_calls": max_turns, "tool_timeout_seconds": 30}


# -- (a) ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class LoopRun:
    mode: str
    model_tokens: int
    tool_tokens: int
    turns: int
    tool_calls: int
    tool_errors: int
    """Calls whose reply was an error (none expected: the environment answers every call)."""
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.model_tokens / self.seconds if self.seconds > 0 else 0.0


class _DeferredCalls:
    """Tool calls held back until the whole batch ended its turn (turn_sync), or run at once and waited for after
    each step (step_sync): the engine's tool runtime's `submit`, replaced for the run."""

    def __init__(self, mode: str, pool: concurrent.futures.ThreadPoolExecutor) -> None:
        self.mode, self.pool = mode, pool
        self.held: list[tuple[concurrent.futures.Future, Callable[..., Any], tuple[Any, ...]]] = []
        self.running: list[concurrent.futures.Future] = []

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        if self.mode == "step_sync":
            future = self.pool.submit(fn, *args)
            self.running.append(future)
            return future
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.held.append((future, fn, args))
        return future

    def after_step(self, engine: Any) -> None:
        if self.mode == "turn_sync":
            stats = engine.last_step
            if not self.held or engine.num_queued or stats.num_paused < engine.num_running:
                return  # some sequence is still writing its turn
            held, self.held = self.held, []
            for future, fn, args in held:
                self.running.append(self.pool.submit(lambda f=future, fn=fn, a=args: f.set_result(fn(*a))))
        concurrent.futures.wait(self.running)
        for future in self.running:
            future.result()  # raise what a call raised
        self.running = []


def run_loop(engine: Any, prompts: list[list[int]], tools: Any, *, mode: str, max_new_tokens: int, seed: int,
             tag: str) -> tuple[LoopRun, dict[int, list[int]]]:
    from everstep_rollout.sequence import GenerationRequest, SamplingOptions

    runtime = engine._turns.runtime  # noqa: SLF001 - the baselines hold the engine's own tool calls back
    deferred = _DeferredCalls(mode, runtime._pool) if mode != "concurrent" else None  # noqa: SLF001
    if deferred is not None:
        runtime.submit = deferred.submit
    try:
        requests = [GenerationRequest(id=f"{tag}-{i}", prompt_ids=p, tools=tools, sampling=SamplingOptions(
            temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=max_new_tokens, seed=seed * 100_003 + i + 1))
            for i, p in enumerate(prompts)]
        # the engine takes every sequence at once and refills its slots; a serial loop runs static batches
        batch = len(requests) if deferred is None else engine.config.max_running
        start = time.perf_counter()
        results = []
        for first in range(0, len(requests), batch):
            engine.add(requests[first : first + batch])
            while engine.has_work:
                results += engine.step()
                if deferred is not None:
                    deferred.after_step(engine)
        seconds = time.perf_counter() - start
    finally:
        if deferred is not None:
            del runtime.submit  # the class's own again
    tool_tokens = sum(sum(r.output_tool_mask) for r in results)
    run = LoopRun(mode=mode, model_tokens=sum(len(r.output_ids) for r in results) - tool_tokens,
                  tool_tokens=tool_tokens, turns=sum(r.tool_trajectory.num_turns for r in results),
                  tool_calls=sum(r.tool_trajectory.num_tool_calls for r in results),
                  tool_errors=sum(1 for r in results for call in r.tool_trajectory.calls if call.error),
                  seconds=seconds)
    return run, {int(r.id.rsplit("-", 1)[1]): r.output_ids for r in results}


def bench_loop(args: argparse.Namespace, model: Path, url: str) -> dict[str, Any]:
    import torch
    from transformers import AutoTokenizer

    from everstep.settings.tools import ToolSettings
    from everstep_rollout.config import EngineConfig
    from everstep_rollout.engine import Engine

    torch.set_num_threads(1)
    tools = ToolSettings.model_validate(tools_section(url, args.max_turns))
    tokenizer = AutoTokenizer.from_pretrained(model)
    tools_json = [t.model_dump() for t in tools.offered()]
    prompts = [list(tokenizer.apply_chat_template([{"role": "user", "content": "U " * (1 + i % 8)}], tools=tools_json,
                                                  add_generation_prompt=True, tokenize=True, return_dict=False))
               for i in range(args.num_sequences)]
    engine = Engine(model, EngineConfig(max_running=min(args.max_running, args.num_sequences), max_queued=len(prompts),
                                        max_seq_len=max(map(len, prompts)) + args.max_new_tokens))
    try:
        run_loop(engine, prompts[:2], tools, mode="concurrent", max_new_tokens=args.max_new_tokens, seed=0,
                 tag="warmup")
        runs: list[LoopRun] = []
        same = True
        for repeat in range(args.repeats):
            outputs = {}
            for mode in MODES:
                run, outputs[mode] = run_loop(engine, prompts, tools, mode=mode, max_new_tokens=args.max_new_tokens,
                                              seed=args.seed + repeat, tag=f"{mode}-{repeat}")
                runs.append(run)
                log.info("(a) %s run %d/%d: %d model tokens (+%d tool), %d turns, %d calls (%d errors) in %.2fs = "
                         "%.0f tokens/s", mode, repeat + 1, args.repeats, run.model_tokens, run.tool_tokens, run.turns,
                         run.tool_calls, run.tool_errors, run.seconds, run.tokens_per_s)
            same = same and outputs["concurrent"] == outputs["turn_sync"] == outputs["step_sync"]
    finally:
        engine.shutdown()

    def median(mode: str) -> float:
        return statistics.median(r.tokens_per_s for r in runs if r.mode == mode)

    return {
        "tokens_per_s": {mode: round(median(mode), 1) for mode in MODES},
        "concurrent_vs_serial_ratio": round(median("concurrent") / median("turn_sync"), 3),
        "concurrent_vs_step_sync_ratio": round(median("concurrent") / median("step_sync"), 3),
        "same_sequences": same,
        "runs": [{**asdict(r), "tokens_per_s": round(r.tokens_per_s, 1)} for r in runs],
        "num_sequences": args.num_sequences, "max_running": engine.config.max_running,
        "tool_evictions": engine.num_tool_evictions, "repeats": args.repeats,
        "mean_prompt_tokens": round(sum(map(len, prompts)) / len(prompts), 1),
    }


# -- (b) ------------------------------------------------------------------------------------------------------


def bench_c3po(args: argparse.Namespace, model: Path, url: str, work: Path, *, seed: int) -> dict[str, Any]:
    from benchmarks.c3po.real import RealConfig, run_real

    dataset = work / "rows.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": "U " * (1 + i % 8), "answer": "42"}) + "\n" for i in range(64)))
    # the model's next token depends on its current token only, so any prompt is as good as another: held out means
    # sampled afresh from the final policy, apart from what the scheduler chose to train
    eval_rows = work / "eval.jsonl"
    eval_rows.write_text("".join(json.dumps({"prompt": "U " * (1 + i % 8), "answer": "42"}) + "\n"
                                 for i in range(args.eval_prompts)))
    config = RealConfig(
        model=str(model), dataset=str(dataset), group_size=args.group_size,
        prompts_per_iteration=args.prompts_per_iteration, trained_samples=args.trained_samples,
        max_new_tokens=args.max_new_tokens, retention=args.retention, learning_rate=args.learning_rate,
        seed=seed, workers="shared", threads_per_worker=1, keep_zero_signal_groups=True,
        verifiers=(("tool_use", 1.0),), verifier_params={"tool_use": {"min_calls": 1}},
        tools=tools_section(url, args.max_turns), eval_dataset=str(eval_rows), eval_prompts=args.eval_prompts,
        eval_samples_per_prompt=args.eval_samples_per_prompt)
    return run_real(config)


VERDICT_SE = 0.03
"""The reward ratio's standard error above which `reward_verdict` is `undecided`."""


def pooled_ratio(pairs: list[dict[str, Any]], when: str) -> tuple[float | None, float | None]:
    """c3po's over sync's held-out reward (`when`: eval_before or eval_after), summed over the pairs, and its
    standard error: the larger of the pairs' spread (the paired ratio estimator's delta method; two pairs or more)
    and the evaluations' binomial errors."""
    sync = [p["sync"][when] for p in pairs]
    c3po = [p["c3po"][when] for p in pairs]
    n = len(pairs)
    sync_mean = statistics.fmean(e["reward"] for e in sync)
    c3po_mean = statistics.fmean(e["reward"] for e in c3po)
    if not sync_mean:
        return None, None
    ratio = c3po_mean / sync_mean
    binomial = ratio * math.hypot(
        math.sqrt(sum(e["standard_error"] ** 2 for e in c3po)) / n / c3po_mean if c3po_mean else 0.0,
        math.sqrt(sum(e["standard_error"] ** 2 for e in sync)) / n / sync_mean)
    spread = 0.0
    if n >= 2:
        residuals = [c["reward"] - ratio * s["reward"] for c, s in zip(c3po, sync, strict=True)]
        spread = math.sqrt(sum(r * r for r in residuals) / (n - 1) / n) / sync_mean
    return round(ratio, 3), round(max(binomial, spread), 3)


def reward_verdict(ratio: float | None, se: float | None) -> str:
    """`holds`: no loss of reward at two standard errors; `loses`: a loss; `undecided`: the error is too large."""
    if ratio is None or se is None or se > VERDICT_SE:
        return "undecided"
    return "holds" if ratio + 2 * se >= 1.0 else "loses"


def summarize_pairs(pairs: list[dict[str, Any]]) -> dict[str, Any]:
    """(b) over its pairs: the median speedups, the pooled reward ratios, the verdict and each pair's figures."""
    evaluated = all("reward_ratio_eval" in p for p in pairs)
    ratio, se = pooled_ratio(pairs, "eval_after") if evaluated else (None, None)
    base_ratio, base_se = pooled_ratio(pairs, "eval_before") if evaluated else (None, None)
    return {
        "num_pairs": len(pairs),
        "rollout_speedup_median": round(statistics.median(p["rollout_speedup"] for p in pairs), 3),
        "e2e_speedup_median": round(statistics.median(p["e2e_speedup"] for p in pairs), 3),
        "reward_ratio": ratio, "reward_ratio_se": se, "base_reward_ratio": base_ratio, "base_reward_ratio_se": base_se,
        "reward_verdict": reward_verdict(ratio, se),
        "per_pair": [{"seed": p["config"]["seed"], "rollout_speedup": p["rollout_speedup"],
                      "e2e_speedup": p["e2e_speedup"], "reward_ratio_eval": p.get("reward_ratio_eval"),
                      "sync_eval_after": p["sync"].get("eval_after", {}).get("reward"),
                      "c3po_eval_after": p["c3po"].get("eval_after", {}).get("reward"),
                      "sync_max_staleness": p["sync"]["max_staleness"],
                      "c3po_max_staleness": p["c3po"]["max_staleness"]} for p in pairs],
    }


def run_pairs(args: argparse.Namespace, model: Path, url: str, work: Path) -> tuple[list[dict[str, Any]], dict]:
    """(b) `--pairs` times (fewer with `--target-se`), each pair in its own folder with its own seed."""
    pairs: list[dict[str, Any]] = []
    summary: dict[str, Any] = {}
    for i in range(args.pairs):
        folder = work / f"pair-{i}"
        folder.mkdir()
        log.info("(b) pair %d/%d, seed %d", i + 1, args.pairs, args.seed + i)
        pairs.append(bench_c3po(args, model, url, folder, seed=args.seed + i))
        summary = summarize_pairs(pairs)
        print(f"(b) after {len(pairs)} pair(s): rollout speedup median {summary['rollout_speedup_median']} "
              f"(pairs {[p['rollout_speedup'] for p in summary['per_pair']]}); reward ratio "
              f"{summary['reward_ratio']} +- {summary['reward_ratio_se']} (base {summary['base_reward_ratio']} +- "
              f"{summary['base_reward_ratio_se']}): {summary['reward_verdict']}; load {os.getloadavg()[0]:.1f}",
              flush=True)
        se = summary["reward_ratio_se"]
        if args.target_se and len(pairs) >= 3 and se is not None and se <= args.target_se:
            break
    return pairs, summary


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(message)s")
    load_before = os.getloadavg()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="multi-turn-bench-") as tmp, Calculator(args.tool_latency) as calculator:
        model = build_model(Path(tmp) / "model", think=args.think, call_share=args.call_share)
        loop = None
        if not args.skip_loop:
            log.info("(a) the engine's tool loop against serial loops: %d sequences", args.num_sequences)
            loop = bench_loop(args, model, calculator.url)
            print(f"(a) model tokens/s: {loop['tokens_per_s']}; concurrent / turn_sync = "
                  f"{loop['concurrent_vs_serial_ratio']}, concurrent / step_sync = "
                  f"{loop['concurrent_vs_step_sync_ratio']}", flush=True)
        c3po = pairs = None
        if not args.skip_c3po:
            log.info("(b) C3PO++ against sync, %d trained samples each", args.trained_samples)
            runs, pairs = run_pairs(args, model, calculator.url, Path(tmp))
            c3po = runs[0]
            sync_eval, c3po_eval = c3po["sync"]["eval_after"], c3po["c3po"]["eval_after"]
            print(f"(b) {'first pair: ' if args.pairs > 1 else ''}c3po rollout speedup {c3po['rollout_speedup']}; "
                  f"held-out reward of the final policies: sync "
                  f"{sync_eval['reward']}, c3po {c3po_eval['reward']}, ratio {c3po['reward_ratio_eval']} +- "
                  f"{c3po['reward_ratio_eval_se']} (base models: {c3po['base_reward_ratio_eval']}); trained samples' "
                  f"reward ratio: last 20% {c3po['reward_ratio']}, all {c3po['reward_ratio_trained']}", flush=True)
    # one pair: its own figures, as before --pairs; more: the median speedup and the pooled ratio
    many = pairs is not None and args.pairs > 1
    report = {
        "benchmark": "multi_turn",
        "concurrent_vs_serial_ratio": loop["concurrent_vs_serial_ratio"] if loop else None,
        "c3po_rollout_speedup": (pairs["rollout_speedup_median"] if many else c3po["rollout_speedup"]) if c3po
        else None,
        "c3po_reward_ratio": (pairs["reward_ratio"] if many else c3po["reward_ratio_eval"]) if c3po else None,
        "c3po_reward_ratio_se": (pairs["reward_ratio_se"] if many else c3po["reward_ratio_eval_se"]) if c3po
        else None,
        "base_reward_ratio": (pairs["base_reward_ratio"] if many else c3po["base_reward_ratio_eval"]) if c3po
        else None,
        "reward_verdict": pairs["reward_verdict"] if pairs else None,
        "reward_ratio_last_20pct": c3po["reward_ratio"] if c3po else None,
        "reward_ratio_trained": c3po["reward_ratio_trained"] if c3po else None,
        "loop": loop, "c3po": c3po, "pairs": pairs,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "wall_seconds": round(time.monotonic() - started, 1),
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
    }
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
