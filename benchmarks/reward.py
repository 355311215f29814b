"""Reward throughput: `python -m benchmarks.reward [--math-items N] [--code-samples N] [--workers W] [--depth D]`.

- Math: the same items (answer pairs: integers, as most RL math sets have, then fractions,
  decimals, percentages, expressions, intervals, sets, matrices, roots) scored through the
  service's path (`RewardScorer` -> `MathVerifier` -> `ProcessWorkerPool`, W workers, D calls
  pipelined per worker, per-item timeouts, up to 64 items at once) against the same check called
  serially in this one process. Both are warm (one answer of each form checked first, in every
  worker and in this process: first uses of sympy machinery cost up to 0.5 s once per process and
  are not what a long job pays per item), and they alternate over slices of the items, so a change
  in the machine's load hits both alike.
- Code: end to end through a real reward service and a real sandbox service (bubblewrap when it
  works here): Score batches of Python samples with 10 stdin/stdout tests each, half of them
  correct, one RunTests call per sample.
The last line of output is one JSON object with math_items_per_s, math_serial_items_per_s,
math_ratio, code_samples_per_s, the settings, and the load average at the start and the end (the
pool can only beat the serial run by as many cores as are idle).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from fractions import Fraction
from pathlib import Path

import grpc

from everstep.processes import ManagedProcess, free_port, spawn, stop_processes, wait_grpc_serving
from everstep.v1 import reward_pb2, reward_pb2_grpc
from everstep_reward.scoring import RewardScorer
from everstep_reward.verifiers import VerifierRegistry
from everstep_reward.verifiers.math import MathVerifier, check_math_answer, prepare_math_worker
from everstep_reward.worker_pool import ProcessWorkerPool

_ROUNDS = 6
_WARM_UP = (("13", "13"), ("\\frac{1}{2}", "0.5"), ("50\\%", "1/2"), ("[1, 2)", "[1,2)"),
            ("\\{1, 2\\}", "\\{2, 1\\}"), ("(1, 2) \\cup (3, 4)", "(1,2)\\cup(3,4)"),
            ("\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}", "\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}"),
            ("\\sqrt{8}", "2\\sqrt{2}"), ("(x+1)^2", "x^2+2x+1"), ("90^\\circ", "90"))


def warm_math_process() -> None:
    """Worker initializer, and the serial side's warm-up: imports, then one answer of each form."""
    prepare_math_worker()
    for answer, reference in _WARM_UP:
        check_math_answer(f"\\boxed{{{answer}}}", reference)


def _math_items(count: int) -> list[tuple[str, str]]:
    """(response, reference) pairs, about half of them equivalent; 4 in 10 have integer answers."""
    forms = []
    for i in range(1, count + 1):
        p, q = i % 17 + 1, i % 13 + 2
        value = Fraction(p, q)
        kind = i % 10
        if kind < 4:
            forms.append((f"{7 * i + kind}", f"{7 * i + kind + i % 2}"))
        elif kind == 4:
            forms.append((f"\\frac{{{2 * p}}}{{{2 * q}}}", f"{value.numerator}/{value.denominator}"))
        elif kind == 5:
            forms.append((f"{p / 8:.3f}", f"\\frac{{{p}}}{{8}}"))
        elif kind == 6:
            forms.append((f"{5 * i}\\%", f"{5 * i + i % 2}/100"))
        elif kind == 7:
            forms.append((f"(x+{p})^2", f"x^2+{2 * p}x+{p * p + i % 2}"))
        elif kind == 8:
            forms.append((f"[{-p}, {q})", f"[{-p},{q + i % 2})") if i % 20 < 10 else
                         (f"\\{{{p}, {q}, {p + q}\\}}", f"\\{{{p + q}, {q}, {p + i % 2}\\}}"))
        else:
            forms.append((f"\\begin{{pmatrix}} {p} & {q} \\\\ 0 & 1 \\end{{pmatrix}}",
                          f"\\begin{{pmatrix}} {p} & {q + i % 2} \\\\ 0 & 1 \\end{{pmatrix}}") if i % 20 < 10 else
                         (f"\\sqrt{{{4 * p}}}", f"{2 + i % 2}\\sqrt{{{p}}}"))
    return [(f"<think> work </think> so the answer is \\boxed{{{answer}}}", reference) for answer, reference in forms]


def _bench_math(num_items: int, workers: int, depth: int) -> dict[str, float | int]:
    items = _math_items(num_items)
    requests = [reward_pb2.RewardItem(id=str(index), response=response, verifiers=[
        reward_pb2.VerifierSpec(name="math", weight=1.0, answer=reference)])
        for index, (response, reference) in enumerate(items)]
    slices = [range(start, num_items, _ROUNDS) for start in range(_ROUNDS)]
    pool = ProcessWorkerPool(workers, depth=depth, initializer=warm_math_process)
    scorer = RewardScorer(VerifierRegistry([MathVerifier(pool, timeout_seconds=30)]), max_concurrent_items=64)
    pool_scores: dict[int, float] = {}
    serial_scores: dict[int, float] = {}
    pool_seconds = serial_seconds = 0.0

    def run_pool(indices: range) -> float:
        start = time.perf_counter()
        for result in scorer.score_batch(requests[i] for i in indices):
            if result.error:
                raise RuntimeError(f"math item {result.id} failed: {result.error}")
            pool_scores[int(result.id)] = result.reward
        return time.perf_counter() - start

    def run_serial(indices: range) -> float:
        start = time.perf_counter()
        for i in indices:
            serial_scores[i] = 1.0 if check_math_answer(*items[i]).correct else 0.0
        return time.perf_counter() - start

    try:
        pool.start()
        warm_math_process()
        for round_index, indices in enumerate(slices):  # alternate which goes first
            if round_index % 2 == 0:
                pool_seconds += run_pool(indices)
                serial_seconds += run_serial(indices)
            else:
                serial_seconds += run_serial(indices)
                pool_seconds += run_pool(indices)
    finally:
        scorer.close()
        pool.close()
    if pool_scores != serial_scores:
        raise RuntimeError("pool and serial scores differ")
    pool_rate, serial_rate = num_items / pool_seconds, num_items / serial_seconds
    return {"math_items": num_items, "math_workers": workers, "math_pipeline_depth": depth,
            "math_correct_fraction": round(sum(pool_scores.values()) / num_items, 3),
            "math_items_per_s": round(pool_rate, 1), "math_serial_items_per_s": round(serial_rate, 1),
            "math_ratio": round(pool_rate / serial_rate, 2)}


def _start(name: str, log_dir: Path, *args: str) -> ManagedProcess:
    http_port, grpc_port = free_port(), free_port()
    process = spawn(name, ["-m", f"everstep_{name}", "--host", "127.0.0.1", "--port", str(http_port),
                           "--grpc-port", str(grpc_port), *args], log_dir / f"{name}.log",
                    http_port=http_port, grpc_port=grpc_port)
    try:
        wait_grpc_serving(process, 90)
    except BaseException:
        stop_processes([process])
        raise
    return process


def _code_items(count: int, offset: int) -> tuple[list[reward_pb2.RewardItem], dict[str, float]]:
    items, expected = [], {}
    for i in range(count):
        k = offset + i  # distinct programs: the sandbox's compile cache must not turn runs into lookups
        correct = i % 2 == 0
        body = f"print(sum(map(int, input().split())) + {0 if correct else 1})  # sample {k}"
        tests = [reward_pb2.CodeTest(stdin=f"{t} {k}\n", expected_stdout=f"{t + k}\n") for t in range(10)]
        item_id = f"code-{k}"
        items.append(reward_pb2.RewardItem(id=item_id, response=f"```python\n{body}\n```", verifiers=[
            reward_pb2.VerifierSpec(name="code", weight=1.0, language="python", tests=tests)]))
        expected[item_id] = 1.0 if correct else 0.0
    return items, expected


def _bench_code(num_samples: int) -> dict[str, float | int]:
    log_dir = Path(tempfile.mkdtemp(prefix="everstep-bench-reward-"))
    sandbox = _start("sandbox", log_dir)
    try:
        reward = _start("reward", log_dir, "--math-workers", "1", "--sandbox-endpoint", sandbox.grpc_address)
        try:
            with grpc.insecure_channel(reward.grpc_address) as channel:
                stub = reward_pb2_grpc.RewardStub(channel)
                warm_items, _ = _code_items(2, offset=10_000)
                list(stub.Score(reward_pb2.ScoreRequest(items=warm_items), timeout=120))
                items, expected = _code_items(num_samples, offset=0)
                start = time.perf_counter()
                results = list(stub.Score(reward_pb2.ScoreRequest(items=items), timeout=600))
                seconds = time.perf_counter() - start
        finally:
            stop_processes([reward])
    finally:
        stop_processes([sandbox])
    got = {r.id: r.reward for r in results}
    errors = [r.error for r in results if r.error]
    if errors or got != expected:
        raise RuntimeError(f"unexpected code rewards: errors {errors[:3]}")
    return {"code_samples": num_samples, "code_tests_per_sample": 10, "code_language": "python",
            "code_samples_per_s": round(num_samples / seconds, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(prog="benchmarks.reward", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--math-items", type=int, default=240)
    parser.add_argument("--code-samples", type=int, default=24)
    parser.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1), help="math pool workers")
    parser.add_argument("--depth", type=int, default=2, help="math calls pipelined per worker (1: none)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    # Other work on the machine decides whether W workers get W cores: record it with the result.
    summary: dict[str, float | int | str] = {"cpu_count": os.cpu_count() or 1,
                                             "load_avg_1m_at_start": round(os.getloadavg()[0], 2)}
    summary.update(_bench_math(args.math_items, args.workers, args.depth))
    print(f"math: {summary['math_items_per_s']} items/s pool vs {summary['math_serial_items_per_s']} serial",
          file=sys.stderr, flush=True)
    summary.update(_bench_code(args.code_samples))
    print(f"code: {summary['code_samples_per_s']} samples/s", file=sys.stderr, flush=True)
    summary["load_avg_1m_at_end"] = round(os.getloadavg()[0], 2)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
