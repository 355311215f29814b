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


def bench_c3po(args: argparse.Namespace, model: Path, url: str, work: Path) -> dict[str, Any]:
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
        seed=args.seed, workers="shared", threads_per_worker=1, keep_zero_signal_groups=True,
        verifiers=(("tool_use", 1.0),), verifier_params={"tool_use": {"min_calls": 1}},
        tools=tools_section(url, args.max_turns), eval_dataset=str(eval_rows), eval_prompts=args.eval_prompts,
        eval_samples_per_prompt=args.eval_samples_per_prompt)
    return run_real(config)


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
        c3po = None
        if not args.skip_c3po:
            log.info("(b) C3PO++ against sync, %d trained samples each", args.trained_samples)
            c3po = bench_c3po(args, model, calculator.url, Path(tmp))
            sync_eval, c3po_eval = c3po["sync"]["eval_after"], c3po["c3po"]["eval_after"]
            print(f"(b) c3po rollout speedup {c3po['rollout_speedup']}; held-out reward of the final policies: sync "
                  f"{sync_eval['reward']}, c3po {c3po_eval['reward']}, ratio {c3po['reward_ratio_eval']} +- "
                  f"{c3po['reward_ratio_eval_se']} (base models: {c3po['base_reward_ratio_eval']}); trained samples' "
                  f"reward ratio: last 20% {c3po['reward_ratio']}, all {c3po['reward_ratio_trained']}", flush=True)
    report = {
        "benchmark": "multi_turn",
        "concurrent_vs_serial_ratio": loop["concurrent_vs_serial_ratio"] if loop else None,
        "c3po_rollout_speedup": c3po["rollout_speedup"] if c3po else None,
        "c3po_reward_ratio": c3po["reward_ratio_eval"] if c3po else None,
        "c3po_reward_ratio_se": c3po["reward_ratio_eval_se"] if c3po else None,
        "base_reward_ratio": c3po["base_reward_ratio_eval"] if c3po else None,
        "reward_ratio_last_20pct": c3po["reward_ratio"] if c3po else None,
        "reward_ratio_trained": c3po["reward_ratio_trained"] if c3po else None,
        "loop": loop, "c3po": c3po,
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
