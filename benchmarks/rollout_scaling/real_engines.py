"""Real engines: rollout tokens/s of one engine against a pool of two, on the same work, on this machine.

Two rollout engine processes (`python -m everstep_rollout`, the torch engine on CPU, `--num-threads` torch threads
each and OMP_NUM_THREADS to match, as the local launcher starts a pool) serve one workload over gRPC:
`num_prompts` prompts of the demo task (examples/demo-model/train.jsonl), each sampled `group_size` times (a
group, kept on one engine), temperature 1, no top-k/top-p, up to `max_new_tokens` output tokens.

The model: by default a random Llama of `random_model_mb` MB (float32; hidden 256, the demo tokenizer), built on the
spot by `benchmarks.weight_push.make_model`. Its output is noise over the 54-token vocabulary, so a sequence ends
at EOS after a geometric number of tokens (mean about 54) or at max_new_tokens: a long tail, and a decode step
that costs compute rather than Python and gRPC overhead. The demo model (`model`=examples/demo-model: hidden 128,
answers of a dozen tokens) measures mostly that overhead: its steps take well under a millisecond.

Every sequence carries its own seed (its index + 1), so a sequence samples the same tokens whichever engine serves
it and the two runs decode the same work up to float noise of batching (the token counts of both are reported).

The controller's own pool places the groups: `everstep_controller.run.engine_pool.PoolStream` sends each group
to the engine with the fewest outstanding tokens. A feeder keeps at most `max_running` sequences in flight per
engine (the pool's capacity, as C3PO++ fills it) and sends the next group as soon as it fits. The one-engine run
uses the first engine of the same pair, the other idle. Runs alternate (1, 2, 2, 1, 1, 2, ...) so that a change of
the machine's load hits both alike; the figures are medians. `speedup_2` is the median tokens/s of two engines
over that of one.

Each run also records every engine's CPU seconds (from /proc), so that a run on a machine shared with other work
can be told apart from one that lacked cores: `tokens_per_engine_cpu_s` hardly moves with other processes' load,
and `engine_core_share` (engine CPU seconds / wall seconds / engines: 1.0 when every engine had a core to itself)
says how much of a core each engine got. `client_cpu_seconds` is this process's (the pool's gRPC streams).
`speedup_2_cpu_normalized` = 2 x (tokens per engine CPU second of two engines / that of one) is a derived figure,
not a measurement: what speedup_2 would be if every engine had a core to itself and kept its measured cost per
token; it tells a pool that wastes work (below 2) from a machine that lacked the cores (speedup_2 far below it).
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_PROMPTS = Path(__file__).resolve().parents[2] / "examples" / "demo-model" / "train.jsonl"
_READY_TIMEOUT_SECONDS = 300
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True, kw_only=True)
class EngineWorkload:
    """One workload, the same for every run."""

    model: Path | None = None
    """Hugging Face model directory; None: a random Llama of `random_model_mb` MB, built for the run."""
    random_model_mb: float = 16.0
    prompts: Path = DEFAULT_PROMPTS
    """JSONL of {"prompt": text} rows, tokenized as raw text by the model's tokenizer."""
    num_prompts: int = 32
    group_size: int = 8
    """Samples per prompt (G), sent together to one engine."""
    max_new_tokens: int = 128
    max_running: int = 64
    """KV cache slots of each engine: the pool's capacity is this times the engines."""
    threads_per_engine: int = 1
    repeats: int = 3
    """Runs of each pool size, alternating."""

    def __post_init__(self) -> None:
        for name in ("num_prompts", "group_size", "max_new_tokens", "max_running", "threads_per_engine", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.random_model_mb <= 0:
            raise ValueError(f"random_model_mb: must be > 0, got {self.random_model_mb}")
        if self.group_size > self.max_running:
            raise ValueError(f"group_size ({self.group_size}) must fit in max_running ({self.max_running})")


@dataclass(frozen=True, kw_only=True)
class PoolRun:
    """One pass of the workload through a pool of `num_engines` engines."""

    num_engines: int
    repeat: int
    num_tokens: int
    """Output tokens generated, up to and including EOS."""
    num_sequences: int
    seconds: float
    """Wall time from the first group sent to the last sequence back."""
    engine_cpu_seconds: float
    """CPU seconds of the pool's engine processes during the run."""
    client_cpu_seconds: float
    """CPU seconds of this process (the pool's streams and the feeder) during the run."""
    tokens_by_engine: dict[str, int] = field(default_factory=dict)
    sequences_by_engine: dict[str, int] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def tokens_per_engine_cpu_s(self) -> float:
        return self.num_tokens / self.engine_cpu_seconds if self.engine_cpu_seconds > 0 else 0.0

    @property
    def engine_core_share(self) -> float:
        """Cores each engine kept busy on average: 1.0 when every engine had one to itself."""
        return self.engine_cpu_seconds / self.seconds / self.num_engines if self.seconds > 0 else 0.0


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS  # utime + stime


def read_prompt_ids(model: Path, prompts_path: Path, num_prompts: int) -> list[list[int]]:
    """The first `num_prompts` prompts of `prompts_path` (`rollout_throughput.read_prompts`), tokenized as raw text
    by the model's tokenizer."""
    from transformers import AutoTokenizer

    from benchmarks.rollout_throughput import read_prompts

    tokenizer = AutoTokenizer.from_pretrained(model)
    return [list(tokenizer(str(p)).input_ids) for p in read_prompts(prompts_path, num_prompts)]


def run_pool(clients: list, pids: list[int], prompt_ids: list[list[int]], workload: EngineWorkload, *,
             repeat: int, tag: str) -> PoolRun:
    """Every group of the workload through a `PoolStream` over `clients`, at most max_running sequences in flight
    per engine."""
    from everstep.v1 import common_pb2
    from everstep_controller.run.engine_pool import PoolStream

    sampling = common_pb2.SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=workload.max_new_tokens)
    groups = [[common_pb2.Sequence(id=f"{tag}-{p}-{g}", prompt_ids=ids, seed=p * workload.group_size + g + 1)
               for g in range(workload.group_size)] for p, ids in enumerate(prompt_ids)]
    capacity = workload.max_running * len(clients)
    tokens = Counter(dict.fromkeys((c.address for c in clients), 0))  # pool order
    sequences = Counter(dict.fromkeys((c.address for c in clients), 0))
    cpu_before, client_cpu_before = sum(process_cpu_seconds(pid) for pid in pids), time.process_time()
    start = time.perf_counter()
    pool = PoolStream(clients)
    in_flight, next_group = 0, 0

    def feed() -> None:
        nonlocal in_flight, next_group
        while next_group < len(groups) and in_flight + workload.group_size <= capacity:
            pool.send(groups[next_group], sampling)
            in_flight += workload.group_size
            next_group += 1
        if next_group == len(groups):
            pool.close()

    try:
        feed()
        for address, seq in pool.results():
            tokens[address] += len(seq.output_ids)
            sequences[address] += 1
            in_flight -= 1
            if next_group < len(groups):
                feed()
    except BaseException:
        pool.cancel()
        raise
    seconds = time.perf_counter() - start
    cpu_seconds = sum(process_cpu_seconds(pid) for pid in pids) - cpu_before
    expected = len(groups) * workload.group_size
    if sum(sequences.values()) != expected:
        raise RuntimeError(f"{sum(sequences.values())} sequences came back, {expected} sent")
    return PoolRun(num_engines=len(clients), repeat=repeat, num_tokens=sum(tokens.values()),
                   num_sequences=expected, seconds=seconds, engine_cpu_seconds=cpu_seconds,
                   client_cpu_seconds=time.process_time() - client_cpu_before,
                   tokens_by_engine=dict(tokens), sequences_by_engine=dict(sequences))


def measure_real_engines(workload: EngineWorkload, *, num_engines: int = 2) -> dict[str, Any]:
    """Starts `num_engines` engines, runs the workload on the first one and on all of them alternately, stops
    them; returns the summary keys (speedup_<N>, real_engines)."""
    from everstep.processes import free_port, spawn, stop_processes, wait_grpc_serving
    from everstep_controller.run.clients import RolloutClient

    if workload.model is not None and not (workload.model / "config.json").exists():
        raise FileNotFoundError(f"no model at {workload.model} (the demo model: `python -m everstep_tools.demo "
                                f"--out {workload.model}`)")
    load_before = os.getloadavg()
    threads = str(workload.threads_per_engine)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="everstep-rollout-scaling-") as tmp:
        model = workload.model
        if model is None:
            from benchmarks.weight_push import make_model

            model = Path(tmp) / "model"
            make_model(model, workload.random_model_mb)
        prompt_ids = read_prompt_ids(model, workload.prompts, workload.num_prompts)
        longest = max(map(len, prompt_ids))
        engines = []
        try:
            for index in range(num_engines):
                http_port, grpc_port = free_port(), free_port()
                engines.append(spawn(f"rollout-{index}", [
                    "-m", "everstep_rollout", "--host", "127.0.0.1", "--port", str(http_port), "--grpc-port",
                    str(grpc_port), "--model", str(model), "--max-running", str(workload.max_running),
                    "--max-seq-len", str(longest + workload.max_new_tokens), "--num-threads", threads,
                    "--seed", "0"], Path(tmp) / f"rollout-{index}.log", http_port=http_port, grpc_port=grpc_port,
                    env={"OMP_NUM_THREADS": threads}))
            for engine in engines:
                wait_grpc_serving(engine, _READY_TIMEOUT_SECONDS)
            clients = [RolloutClient(engine.grpc_address) for engine in engines]
            pids = [engine.pid for engine in engines]
            warmup = EngineWorkload(**{**asdict(workload), "max_new_tokens": 8})
            for client, pid in zip(clients, pids, strict=True):
                run_pool([client], [pid], prompt_ids[:2], warmup, repeat=-1, tag=f"warmup-{client.address}")
            runs: list[PoolRun] = []
            for repeat in range(workload.repeats):
                order = (1, num_engines) if repeat % 2 == 0 else (num_engines, 1)
                for size in order:
                    run = run_pool(clients[:size], pids[:size], prompt_ids, workload, repeat=repeat,
                                   tag=f"r{repeat}-n{size}")
                    runs.append(run)
                    print(f"[engines] {size} engine(s), run {repeat + 1}/{workload.repeats}: {run.num_tokens} tokens "
                          f"in {run.seconds:.2f}s = {run.tokens_per_s:.0f} tokens/s ({run.engine_cpu_seconds:.1f} "
                          f"engine CPU s; tokens by engine {list(run.tokens_by_engine.values())})",
                          file=sys.stderr, flush=True)
            for client in clients:
                client.close()
        finally:
            stop_processes(engines, grace_seconds=30)
    load_after = os.getloadavg()
    return summarize(runs, workload, num_engines=num_engines, load_before=load_before, load_after=load_after,
                     seconds=time.perf_counter() - started)


def summarize(runs: list[PoolRun], workload: EngineWorkload, *, num_engines: int, load_before: tuple[float, ...],
              load_after: tuple[float, ...], seconds: float) -> dict[str, Any]:
    by_size: dict[str, dict[str, Any]] = {}
    for size in (1, num_engines):
        mine = [r for r in runs if r.num_engines == size]
        by_size[str(size)] = {
            "tokens_per_s": round(statistics.median(r.tokens_per_s for r in mine), 1),
            "tokens_per_engine_cpu_s": round(statistics.median(r.tokens_per_engine_cpu_s for r in mine), 1),
            "engine_core_share": round(statistics.median(r.engine_core_share for r in mine), 3),
            "client_cpu_seconds": round(statistics.median(r.client_cpu_seconds for r in mine), 2),
            "num_tokens": int(statistics.median(r.num_tokens for r in mine)),
            "seconds": round(statistics.median(r.seconds for r in mine), 3),
            # each engine's share of the tokens, median over runs, in pool order
            "token_share_by_engine": [round(statistics.median(
                list(r.tokens_by_engine.values())[i] / r.num_tokens if r.num_tokens else 0.0 for r in mine), 3)
                for i in range(size)],
            "sequence_share_by_engine": [round(statistics.median(
                list(r.sequences_by_engine.values())[i] / r.num_sequences for r in mine), 3) for i in range(size)],
        }
    one, many = by_size["1"]["tokens_per_s"], by_size[str(num_engines)]["tokens_per_s"]
    speedup = round(many / one, 3) if one > 0 else None
    one_cpu, many_cpu = (by_size["1"]["tokens_per_engine_cpu_s"],
                         by_size[str(num_engines)]["tokens_per_engine_cpu_s"])
    normalized = round(num_engines * many_cpu / one_cpu, 3) if one_cpu > 0 else None
    print(f"\nReal engines ({workload.threads_per_engine} thread(s) each, {os.cpu_count()} cores): "
          f"{workload.num_prompts} prompts x {workload.group_size}, max_new_tokens {workload.max_new_tokens}, "
          f"medians of {workload.repeats}")
    print(f"{'engines':>7} {'tokens/s':>9} {'tokens/engine CPU s':>20} {'core share':>10} {'tokens':>7} "
          f"{'seconds':>8}  token share")
    for size, figures in by_size.items():
        print(f"{size:>7} {figures['tokens_per_s']:>9.1f} {figures['tokens_per_engine_cpu_s']:>20.1f} "
              f"{figures['engine_core_share']:>10.3f} {figures['num_tokens']:>7} {figures['seconds']:>8.2f}  "
              f"{figures['token_share_by_engine']}")
    print(f"speedup_{num_engines} (tokens/s of {num_engines} engines / 1): {speedup}; with a core per engine "
          f"(derived from tokens per engine CPU second): {normalized}; load average {load_before[0]:.2f} before, "
          f"{load_after[0]:.2f} after")
    settings = {**asdict(workload), "model": str(workload.model or f"random Llama, {workload.random_model_mb:g} MB"),
                "prompts": str(workload.prompts), "num_engines": num_engines,
                "cpu_count": os.cpu_count(), "placement": "PoolStream (least outstanding tokens)",
                "omp_num_threads": workload.threads_per_engine}
    return {
        f"speedup_{num_engines}": speedup,
        f"speedup_{num_engines}_cpu_normalized": normalized,
        "real_engines": {
            "by_engines": by_size, "settings": settings, "seconds": round(seconds, 1),
            "loadavg_before": [round(x, 2) for x in load_before], "loadavg_after": [round(x, 2) for x in load_after],
            "runs": [{**asdict(r), "seconds": round(r.seconds, 4), "engine_cpu_seconds": round(r.engine_cpu_seconds, 2),
                      "client_cpu_seconds": round(r.client_cpu_seconds, 2), "tokens_per_s": round(r.tokens_per_s, 1),
                      "tokens_per_engine_cpu_s": round(r.tokens_per_engine_cpu_s, 1),
                      "engine_core_share": round(r.engine_core_share, 3)} for r in runs],
        },
    }
