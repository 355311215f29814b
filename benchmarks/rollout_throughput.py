"""Rollout throughput: `python -m benchmarks.rollout_throughput [--model DIR] [--quick] [--num-prompts N] ...`.

One model (the demo model shipped in `examples/demo-model`, built by `python -m everstep_tools.demo`;
its build.json records how), one workload: N sequences (default 256) from the first prompts of the demo task's
train.jsonl, each prompt sampled `--samples-per-prompt` G times (default 8, the RL case: a group of G samples per
prompt; N / G prompts, rounded up, the last group cut to make N), sampled at temperature 1 (no top-k/top-p) until
EOS or max_new_tokens. The default workload was one sample per prompt (G = 1) before prompt sharing; figures
measured before then are G = 1 figures. The warm-started demo model
writes worked solutions whose length follows the task's long-tailed chain lengths (most a few tokens,
a few a couple of hundred), which is the case continuous batching is for.

A chat model (its tokenizer has a chat template, e.g. `--model outputs/smollm2-135m-instruct` from
`make real-model`) gets chat prompts: by default 128 sequences (16 prompts x 8) from the first rows of
examples/data/arith-word-problems/train.parquet (verl's schema: `prompt` is a list of messages), each
rendered with the model's template and `add_generation_prompt=True`, as a job would send them.

The same workload runs through

(a) transformers' `generate` on static batches: sequences in workload order (the G copies of a prompt next to
    each other), `--batch-size` rows at a time, left-padded, KV cache on, `do_sample=True, temperature=1.0,
    top_k=0, top_p=1.0`, the same max_new_tokens; every batch runs until its longest sequence ends. The default
    batch size, 128, is the fastest of 32/64/128/256 for transformers on the demo workload (measured on the 2-core
    machine). The G copies are repeated rows: `num_return_sequences=G` does the same computation (generate expands
    the input with `repeat_interleave` before the first forward pass and prefills every copy), and repeated rows
    let the batch size stay a row count whatever G is;
(b) our torch engine: every sequence queued at once, `--max-running` sequences decoded together,
    sequences joining and leaving at every step; copies of a prompt admitted in the same step are prefilled
    once (`EngineConfig.share_prompt_prefill`).

Both count the tokens they generated up to and including EOS, in float32 with the same torch thread
count, after a small warm-up run. The runs alternate (a, b, a, b, ...) `--repeats` times so that a
change in machine load hits both alike; the figures are medians. Progress goes to stderr; the last line of
stdout is one JSON object with ours_tokens_per_s, hf_tokens_per_s, ratio (of the medians), every run,
the settings and the load average before and after. It also reports tokens per CPU second of this process
(ours_tokens_per_cpu_s, hf_tokens_per_cpu_s, cpu_ratio): on a shared machine those vary far less with
other processes' load than wall-clock figures do.

`--quick` runs the same workload once on each side instead of `--repeats` (3) times: a third of the time, and the
same ratio up to the noise of single runs (on a loaded machine read `cpu_ratio`); see QUICK_REPEATS for why it does
not shrink the workload. The report also gives each run's decode row-steps and `hf_useful_row_fraction` (the part
of transformers' rows that produced a counted token: 1 / it is what static batching alone explains). Issue 29's
three models: `--model examples/demo-moe-model`, `--model outputs/smollm2-135m-instruct` and a random Qwen3 dense
model built by `python -m benchmarks.qwen3_dense_model`; docs/benchmarks.md has their figures.

`--quantization none,int8` (any of none, int8, int8-tensor, fp8, int4, comma-separated) runs our engine once per
setting in every repeat (hf, ours-none, ours-int8, hf, ...), each engine built once; the report's
`quantization` object gives, per setting, the median tokens/s and tokens per CPU second, the bytes of the
weights on the device and of the KV cache, and the ratio of its tokens/s to the first setting's.
ours_tokens_per_s and ratio are those of the first setting.

`--prompt-sharing on,off` (default on) likewise runs our engine once per setting of `share_prompt_prefill` in every
repeat (with several quantizations, every pair); the report's `prompt_sharing` object gives, per setting (at the
first quantization), the median tokens/s and tokens per CPU second, the ratio of its tokens/s to the first
setting's, and the token positions prefilled and shared per run. ours_tokens_per_s and ratio are those of the first
setting of each flag.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger("benchmarks.rollout_throughput")

DEFAULT_MODEL = Path("examples/demo-model")
CHAT_PROMPTS = Path(__file__).resolve().parents[1] / "examples" / "data" / "arith-word-problems" / "train.parquet"
DEFAULT_NUM_PROMPTS = {"raw": 256, "chat": 128}
DEFAULT_BATCH_SIZE = 128
DEFAULT_REPEATS = 3
DEFAULT_SAMPLES_PER_PROMPT = 8
QUICK_REPEATS = 1
"""--quick runs the default workload once on each side instead of DEFAULT_REPEATS times. It keeps the prompts, the
batch size and max_running: a scaled-down workload does not give the same ratio. Smaller static batches hold
shorter longest sequences (the maximum of fewer draws from a long-tailed length distribution), so transformers
wastes fewer rows: on the MoE demo model a quarter of everything (64 prompts, batches of 32) measured 3.5x where
the full run measured 5.6x."""


@dataclass(frozen=True, kw_only=True)
class Run:
    system: str
    """"hf" or "ours"."""
    quantization: str
    """Our engine's weight quantization ("none" for hf)."""
    prompt_sharing: bool
    """Our engine's share_prompt_prefill (False for hf, which prefills every row)."""
    num_tokens: int
    seconds: float
    cpu_seconds: float
    """CPU time of this process during the run: far less sensitive to other processes' load than wall time."""
    num_row_steps: int
    """Sequence rows the decode steps computed: for transformers every row of a static batch at every step of
    it (finished and padded rows too), for our engine the running sequences of every step."""
    prefill_tokens: int = 0
    """Our engine: token positions its prefill passes computed (0 for hf)."""
    prefill_tokens_shared: int = 0
    """Our engine: prompt positions not prefilled because a copy of the prompt was."""

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def tokens_per_cpu_s(self) -> float:
        return self.num_tokens / self.cpu_seconds if self.cpu_seconds > 0 else 0.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="benchmarks.rollout_throughput", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="Hugging Face model directory")
    p.add_argument("--prompts", type=Path, default=None,
                   help="JSONL or Parquet with a 'prompt' field (text, or a list of chat messages); default "
                        "MODEL/train.jsonl, or for a chat model examples/data/arith-word-problems/train.parquet")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="sequences of the workload (default 256; chat: 128): the first prompts, each "
                        "--samples-per-prompt times")
    p.add_argument("--samples-per-prompt", type=int, default=DEFAULT_SAMPLES_PER_PROMPT,
                   help=f"G: samples of each prompt, the group size of RL (default {DEFAULT_SAMPLES_PER_PROMPT}; "
                        "1: every sequence a different prompt, the workload before prompt sharing)")
    p.add_argument("--prompt-sharing", default="on",
                   help="our engine's share_prompt_prefill: on, off, or both comma-separated (each runs side by "
                        "side in every repeat)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="output tokens per sequence at most")
    p.add_argument("--batch-size", type=int, default=None,
                   help=f"transformers generate: prompts per static batch (default {DEFAULT_BATCH_SIZE})")
    p.add_argument("--max-running", type=int, default=None,
                   help=f"our engine: sequences decoded together (default {DEFAULT_BATCH_SIZE})")
    p.add_argument("--quick", action="store_true",
                   help=f"a shorter run whose ratio agrees with the full one: the same workload, {QUICK_REPEATS} "
                        f"run of each system instead of {DEFAULT_REPEATS} (an explicit --repeats wins)")
    p.add_argument("--repeats", type=int, default=None,
                   help=f"runs of each system (alternating); medians reported (default {DEFAULT_REPEATS}; --quick: "
                        f"{QUICK_REPEATS})")
    p.add_argument("--num-threads", type=int, default=0, help="torch CPU threads; 0: all cores but one")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quantization", default="none",
                   help="our engine's weight quantization, or several comma-separated (none, int8, int8-tensor, "
                        "fp8, int4): each runs side by side in every repeat")
    args = p.parse_args(argv)
    args.quantization = args.quantization.split(",")
    for quantization in args.quantization:
        if quantization not in ("none", "int8", "int8-tensor", "fp8", "int4"):
            p.error(f"--quantization: {quantization!r} is not one of none, int8, int8-tensor, fp8, int4")
    if len(set(args.quantization)) != len(args.quantization):
        p.error("--quantization: a setting is listed twice")
    sharing = args.prompt_sharing.split(",")
    for setting in sharing:
        if setting not in ("on", "off"):
            p.error(f"--prompt-sharing: {setting!r} is not one of on, off")
    if len(set(sharing)) != len(sharing):
        p.error("--prompt-sharing: a setting is listed twice")
    args.prompt_sharing = [setting == "on" for setting in sharing]
    for name in ("num_prompts", "max_new_tokens", "batch_size", "max_running", "repeats", "samples_per_prompt"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def workload_size(args: argparse.Namespace, prompt_format: str) -> tuple[int, int, int, int]:
    """(num_prompts, batch_size, max_running, repeats) of the run: the flags given, else the full or --quick
    defaults."""
    return (args.num_prompts or DEFAULT_NUM_PROMPTS[prompt_format], args.batch_size or DEFAULT_BATCH_SIZE,
            args.max_running or DEFAULT_BATCH_SIZE, args.repeats or (QUICK_REPEATS if args.quick else DEFAULT_REPEATS))


def grouped(prompts: list, num_sequences: int, samples_per_prompt: int) -> list:
    """Each prompt `samples_per_prompt` times in a row, the first `num_sequences` of them."""
    return [p for p in prompts for _ in range(samples_per_prompt)][:num_sequences]


def read_prompts(path: Path, num_prompts: int) -> list[str | list[dict]]:
    """The 'prompt' field of the first rows: text, or a list of {role, content} messages."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        prompts = pq.read_table(path, columns=["prompt"]).column("prompt").to_pylist()[:num_prompts]
    else:
        prompts = []
        with path.open() as f:
            for line in f:
                if line.strip():
                    prompts.append(json.loads(line)["prompt"])
                if len(prompts) == num_prompts:
                    break
    if len(prompts) < num_prompts:
        raise ValueError(f"{path} has {len(prompts)} prompts, --num-prompts asks for {num_prompts}")
    return [p if isinstance(p, list) else str(p) for p in prompts]


def tokenize_prompts(tokenizer, prompts: list[str | list[dict]]) -> list[list[int]]:
    """Chat models: the template with the generation prompt (a text prompt is one user message); else raw."""
    if not tokenizer.chat_template:
        return [tokenizer(p if isinstance(p, str) else p[-1]["content"]).input_ids for p in prompts]
    return [list(tokenizer.apply_chat_template([{"role": "user", "content": p}] if isinstance(p, str) else p,
                                               add_generation_prompt=True, return_dict=True)["input_ids"])
            for p in prompts]


def count_until_eos(row: list[int], eos_token_ids: frozenset[int]) -> int:
    """Generated tokens up to and including the first EOS (all of them when there is none)."""
    for i, token in enumerate(row):
        if token in eos_token_ids:
            return i + 1
    return len(row)


def run_hf(model, prompt_ids: list[list[int]], *, batch_size: int, max_new_tokens: int, pad_token_id: int,
           eos_token_ids: frozenset[int], seed: int) -> Run:
    import torch

    torch.manual_seed(seed)
    num_tokens = num_row_steps = 0
    start, cpu_start = time.perf_counter(), time.process_time()
    with torch.inference_mode():
        for i in range(0, len(prompt_ids), batch_size):
            batch = prompt_ids[i : i + batch_size]
            width = max(map(len, batch))
            input_ids = torch.tensor([[pad_token_id] * (width - len(p)) + p for p in batch])
            attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            out = model.generate(
                input_ids=input_ids, attention_mask=attention_mask, do_sample=True, temperature=1.0, top_k=0,
                top_p=1.0, max_new_tokens=max_new_tokens, pad_token_id=pad_token_id,
                eos_token_id=sorted(eos_token_ids), use_cache=True,
            )
            num_tokens += sum(count_until_eos(row, eos_token_ids) for row in out[:, width:].tolist())
            num_row_steps += out.shape[0] * (out.shape[1] - width)
    return Run(system="hf", quantization="none", prompt_sharing=False, num_tokens=num_tokens,
               seconds=time.perf_counter() - start, cpu_seconds=time.process_time() - cpu_start,
               num_row_steps=num_row_steps)


def run_ours(engine, prompt_ids: list[list[int]], *, max_new_tokens: int, tag: str) -> Run:
    """Every prompt through `engine` (its config.quantization and share_prompt_prefill are recorded)."""
    from everstep_rollout.sequence import GenerationRequest, SamplingOptions

    sampling = SamplingOptions(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=max_new_tokens)
    prefilled, shared = engine.num_prefill_tokens_total, engine.num_prefill_tokens_shared_total
    start, cpu_start = time.perf_counter(), time.process_time()
    engine.add(GenerationRequest(id=f"{tag}-{i}", prompt_ids=p, sampling=sampling) for i, p in enumerate(prompt_ids))
    num_tokens = num_row_steps = 0
    while engine.has_work:
        num_tokens += sum(len(r.output_ids) for r in engine.step())
        num_row_steps += engine.last_step.num_decoded if engine.last_step else 0
    return Run(system="ours", quantization=engine.config.quantization.value,
               prompt_sharing=engine.config.share_prompt_prefill, num_tokens=num_tokens,
               seconds=time.perf_counter() - start, cpu_seconds=time.process_time() - cpu_start,
               num_row_steps=num_row_steps, prefill_tokens=engine.num_prefill_tokens_total - prefilled,
               prefill_tokens_shared=engine.num_prefill_tokens_shared_total - shared)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(message)s")
    if not (args.model / "config.json").exists():
        print(f"no model at {args.model}: build the demo model first with "
              f"`python -m everstep_tools.demo --out {args.model}`, or pass --model (examples/demo-moe-model; "
              "outputs/smollm2-135m-instruct from `make real-model`; a random Qwen3 from "
              "`python -m benchmarks.qwen3_dense_model`)", file=sys.stderr)
        return 2
    started = time.perf_counter()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from everstep_rollout.config import EngineConfig, default_num_threads
    from everstep_rollout.engine import Engine

    torch.set_num_threads(args.num_threads or default_num_threads())
    load_before = os.getloadavg()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    prompt_format = "chat" if tokenizer.chat_template else "raw"
    num_prompts, batch_size, max_running, repeats = workload_size(args, prompt_format)
    default_prompts = CHAT_PROMPTS if prompt_format == "chat" else args.model / "train.jsonl"
    group = args.samples_per_prompt
    prompts = read_prompts(args.prompts or default_prompts, -(-num_prompts // group))
    prompt_ids = grouped(tokenize_prompts(tokenizer, prompts), num_prompts, group)
    longest_prompt = max(map(len, prompt_ids))

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    engines = {(q, share): Engine(args.model, EngineConfig(
        max_running=max_running, max_seq_len=longest_prompt + args.max_new_tokens, seed=args.seed, quantization=q,
        share_prompt_prefill=share)) for q in args.quantization for share in args.prompt_sharing}
    first = (args.quantization[0], args.prompt_sharing[0])
    engine = engines[first]
    eos_token_ids = engine.eos_token_ids
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos_token_ids)
    hf_kwargs = dict(batch_size=batch_size, max_new_tokens=args.max_new_tokens, pad_token_id=pad_token_id,
                     eos_token_ids=eos_token_ids)

    log.info("warm-up")
    run_hf(model, prompt_ids[:4], **{**hf_kwargs, "max_new_tokens": 4}, seed=args.seed)
    for each in engines.values():
        run_ours(each, prompt_ids[:4], max_new_tokens=4, tag="warmup")
    runs: list[Run] = []
    for repeat in range(repeats):
        for system in ("hf", *engines):
            if system == "hf":
                run = run_hf(model, prompt_ids, **hf_kwargs, seed=args.seed + repeat)
            else:
                run = run_ours(engines[system], prompt_ids, max_new_tokens=args.max_new_tokens, tag=f"r{repeat}")
            runs.append(run)
            name = run.system if run.system == "hf" or len(engines) == 1 else "-".join(
                ["ours", *([run.quantization] if len(args.quantization) > 1 else []),
                 *([sharing_name(run.prompt_sharing)] if len(args.prompt_sharing) > 1 else [])])
            print(f"{name:5s} run {repeat + 1}/{repeats}: {run.num_tokens} tokens in {run.seconds:.2f}s = "
                  f"{run.tokens_per_s:.0f} tokens/s ({run.cpu_seconds:.2f} CPU s)", flush=True)

    def median(field: str, system: str, quantization: str = "none", sharing: bool = False) -> float:
        return statistics.median(getattr(r, field) for r in runs if r.system == system
                                 and r.quantization == quantization and r.prompt_sharing == sharing)

    hf, hf_cpu = median("tokens_per_s", "hf"), median("tokens_per_cpu_s", "hf")
    ours = median("tokens_per_s", "ours", *first)
    ours_cpu = median("tokens_per_cpu_s", "ours", *first)
    sharing0 = args.prompt_sharing[0]
    quantized = {q: {"tokens_per_s": round(median("tokens_per_s", "ours", q, sharing0), 1),
                     "tokens_per_cpu_s": round(median("tokens_per_cpu_s", "ours", q, sharing0), 1),
                     "speed_ratio": round(median("tokens_per_s", "ours", q, sharing0) / ours, 3) if ours > 0 else None,
                     "weight_bytes": e.weights.num_bytes, "kv_cache_bytes": e.executor.cache_bytes}
                 for (q, share), e in engines.items() if share == sharing0}
    q0 = args.quantization[0]
    sharing = {sharing_name(share): {
        "tokens_per_s": round(median("tokens_per_s", "ours", q0, share), 1),
        "tokens_per_cpu_s": round(median("tokens_per_cpu_s", "ours", q0, share), 1),
        "speed_ratio": round(median("tokens_per_s", "ours", q0, share) / ours, 3) if ours > 0 else None,
        "cpu_speed_ratio": round(median("tokens_per_cpu_s", "ours", q0, share) / ours_cpu, 3) if ours_cpu > 0 else None,
        "prefill_tokens": int(median("prefill_tokens", "ours", q0, share)),
        "prefill_tokens_shared": int(median("prefill_tokens_shared", "ours", q0, share)),
    } for share in args.prompt_sharing}
    for q, figures in quantized.items():
        print(f"everstep torch engine, quantization {q}: {figures['tokens_per_s']:.0f} tokens/s (median), "
              f"weights {figures['weight_bytes'] / 2**20:.2f} MiB", flush=True)
    for name, figures in sharing.items():
        print(f"everstep torch engine, prompt sharing {name}: {figures['tokens_per_s']:.0f} tokens/s (median), "
              f"{figures['prefill_tokens']} positions prefilled, {figures['prefill_tokens_shared']} shared", flush=True)
    print(f"transformers generate (static batches of {batch_size}): {hf:.0f} tokens/s (median)")
    print(f"everstep torch engine (max_running {max_running}): {ours:.0f} tokens/s (median)")
    report = {
        "ours_tokens_per_s": round(ours, 1), "hf_tokens_per_s": round(hf, 1),
        "ratio": round(ours / hf, 3) if hf > 0 else None,
        "ours_tokens_per_cpu_s": round(ours_cpu, 1), "hf_tokens_per_cpu_s": round(hf_cpu, 1),
        "cpu_ratio": round(ours_cpu / hf_cpu, 3) if hf_cpu > 0 else None,
        # The share of transformers' decode rows that produced a counted token: 1 / it is the ratio that static
        # batching alone explains; ratio / (1 / it) is what the engine's cost per row-step adds.
        "hf_useful_row_fraction": round(median("num_tokens", "hf") / median("num_row_steps", "hf"), 3)
        if median("num_row_steps", "hf") > 0 else None,
        "runs": [{**asdict(r), "tokens_per_s": round(r.tokens_per_s, 1)} for r in runs],
        "quantization": quantized, "prompt_sharing": sharing,
        "mode": "quick" if args.quick else "full", "seconds": round(time.perf_counter() - started, 1),
        "model": str(args.model), "prompt_format": prompt_format, "num_prompts": num_prompts,
        "samples_per_prompt": group, "num_distinct_prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
        "batch_size": batch_size, "max_running": max_running, "repeats": repeats,
        "executor": type(engine.executor).__name__, "num_threads": torch.get_num_threads(),
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
    }
    print(json.dumps(report))
    return 0


def sharing_name(share: bool) -> str:
    return "on" if share else "off"


if __name__ == "__main__":
    sys.exit(main())
