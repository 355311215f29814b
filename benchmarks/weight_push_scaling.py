"""Weight push to a pool of engines: `python -m benchmarks.weight_push_scaling [--mb 100] [--engines 1,2,4]
[--transport shm,grpc] [--repeats 5] [--quick]`.

As the controller does it for a job with `resources.rollout.replicas: N`: a real trainer process
(`python -m everstep_trainer`) holding a random Llama of about --mb MB (float32, `benchmarks.weight_push.make_model`)
and max(--engines) real rollout processes (`python -m everstep_rollout`, one torch thread each) holding the same
model, on this machine; one `Trainer.PushWeights(endpoints=[the first N engines])` call per push, for each N of
--engines and each transport of --transport. The goal (issue 41): 4 engines take at most 1.3x the time of one.
With shm the trainer writes one segment, once, and every engine on the host maps it (one copy per host, none per
engine); with grpc the trainer serialises and sends every byte to every engine.

Pushes alternate: a cycle is every (transport, N) once, in order (shm 1, 2, 4, then grpc 1, 2, 4); two untimed
cycles warm up (channels, and the shm segments: with one-copy pushes the trainer writes each version into a
segment no engine still runs on, and over the 1, 2, 4 cycle three segments come to alternate, so that the timed
cycles allocate none), then --repeats timed cycles. Each figure is the median wall time of the PushWeights call
over the timed cycles; `trainer_seconds` is the trainer's own timing of the same pushes. Every push is checked:
all the bytes to every engine, over the transport named, and with shm every engine keeping the segment's pages
in place (`num_kept_in_place`). Each push also records the CPU seconds the pushed engines and the trainer spent
on it (from /proc): on a machine with fewer free cores than engines, the engines' share of the work (mapping the
segment, filling its page tables, swapping the weights in) is what a push to more engines waits for.

Output: a table, then, as the last line, one JSON object: `seconds[transport][N]`, `ratio_to_one[transport][N]`
(median seconds at N over median seconds at 1), `ratio_4_to_1` (at the largest N, per transport), `goal_met`
(each transport: ratio_4_to_1 <= 1.3), the settings, every push, and the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc

from benchmarks.rollout_scaling.real_engines import process_cpu_seconds
from benchmarks.weight_push import make_model
from everstep.processes import ManagedProcess, free_port, spawn, stop_processes, wait_grpc_serving
from everstep.v1 import rollout_pb2, rollout_pb2_grpc, trainer_pb2, trainer_pb2_grpc
from everstep_trainer.weight_push.plan import Transport

GOAL_RATIO = 1.3
"""Issue 41: a push to 4 engines takes at most 1.3x the time of a push to one."""
_READY_TIMEOUT_SECONDS = 300
_WARMUP_CYCLES = 2
QUICK_MB, QUICK_REPEATS = 4.0, 2
"""--quick: a 4 MB model, two timed cycles (for tests; the ratios of so small a push are mostly call overhead)."""


@dataclass(frozen=True, kw_only=True)
class Push:
    transport: str
    num_engines: int
    cycle: int
    seconds: float
    """Wall time of the PushWeights call."""
    trainer_seconds: float
    num_bytes: int
    """Tensor bytes delivered, summed over engines."""
    num_kept_in_place: int
    engine_cpu_seconds: float
    """CPU seconds of the pushed engines, summed, during the call."""
    trainer_cpu_seconds: float


def _start(name: str, module: str, log_path: Path, *extra: str, threads: int = 0) -> ManagedProcess:
    http_port, grpc_port = free_port(), free_port()
    env = {"OMP_NUM_THREADS": str(threads)} if threads else None
    return spawn(name, ["-m", module, "--host", "127.0.0.1", "--port", str(http_port), "--grpc-port",
                        str(grpc_port), *extra], log_path, http_port=http_port, grpc_port=grpc_port, env=env)


def push(trainer: trainer_pb2_grpc.TrainerStub, engines: list[ManagedProcess], trainer_pid: int, setting: str,
         num_bytes: int, *, cycle: int) -> Push:
    endpoints = [e.grpc_address for e in engines]
    request = trainer_pb2.PushWeightsRequest(endpoints=endpoints, transport=Transport(setting).to_proto())
    engine_cpu, trainer_cpu = sum(process_cpu_seconds(e.pid) for e in engines), process_cpu_seconds(trainer_pid)
    start = time.perf_counter()
    response = trainer.PushWeights(request, timeout=600)
    seconds = time.perf_counter() - start
    engine_cpu = sum(process_cpu_seconds(e.pid) for e in engines) - engine_cpu
    trainer_cpu = process_cpu_seconds(trainer_pid) - trainer_cpu
    used = set(response.transports.values())
    if response.num_bytes != num_bytes * len(endpoints) or used != {setting}:
        raise RuntimeError(f"{setting} to {len(endpoints)} engine(s): pushed {response.num_bytes} bytes over "
                           f"{dict(response.transports)}; expected {num_bytes * len(endpoints)} over {setting}")
    if setting == Transport.SHM and response.num_kept_in_place != len(endpoints):
        raise RuntimeError(f"shm to {len(endpoints)} engine(s): {response.num_kept_in_place} kept the segment in "
                           "place (one copy per host expects all)")
    return Push(transport=setting, num_engines=len(endpoints), cycle=cycle, seconds=seconds,
                trainer_seconds=response.seconds, num_bytes=response.num_bytes,
                num_kept_in_place=response.num_kept_in_place, engine_cpu_seconds=engine_cpu,
                trainer_cpu_seconds=trainer_cpu)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.weight_push_scaling", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=None, help=f"size of the weights, MB (default 100; --quick "
                        f"{QUICK_MB:g})")
    parser.add_argument("--engines", default="1,2,4", help="engine counts, comma-separated (must hold 1)")
    parser.add_argument("--transport", default="shm,grpc", help="comma-separated: shm, grpc")
    parser.add_argument("--repeats", type=int, default=None,
                        help=f"timed cycles (default 5; --quick {QUICK_REPEATS})")
    parser.add_argument("--quick", action="store_true", help="a small model and two timed cycles (for tests)")
    args = parser.parse_args(argv)
    args.mb = args.mb if args.mb is not None else QUICK_MB if args.quick else 100.0
    args.repeats = args.repeats if args.repeats is not None else QUICK_REPEATS if args.quick else 5
    try:
        args.engine_counts = sorted({int(n) for n in args.engines.split(",")})
    except ValueError:
        parser.error(f"--engines: {args.engines!r} is not a list of integers")
    if 1 not in args.engine_counts or min(args.engine_counts) < 1:
        parser.error("--engines must hold 1 (the baseline) and no count below 1")
    args.transports = [t.strip() for t in args.transport.split(",") if t.strip()]
    if not args.transports or set(args.transports) - {Transport.SHM.value, Transport.GRPC.value}:
        parser.error(f"--transport: {args.transport!r} is not a list of shm, grpc")
    if args.repeats < 1 or args.mb <= 0:
        parser.error("--repeats must be >= 1 and --mb > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load_before = os.getloadavg()
    started = time.perf_counter()
    pushes: list[Push] = []
    with tempfile.TemporaryDirectory(prefix="everstep-weight-push-scaling-") as tmp:
        work = Path(tmp)
        model_dir = work / "model"
        num_bytes = make_model(model_dir, args.mb)
        print(f"model: {num_bytes / 1e6:.1f} MB of float32 weights; engines {args.engine_counts}", file=sys.stderr,
              flush=True)
        processes = [_start(f"rollout-{i}", "everstep_rollout", work / f"rollout-{i}.log", "--model", str(model_dir),
                            "--num-threads", "1", threads=1) for i in range(max(args.engine_counts))]
        processes.append(_start("trainer", "everstep_trainer", work / "trainer.log"))
        try:
            for process in processes:
                wait_grpc_serving(process, _READY_TIMEOUT_SECONDS)
            *engines, trainer_process = processes
            endpoints = [e.grpc_address for e in engines]
            with grpc.insecure_channel(trainer_process.grpc_address) as channel:
                trainer = trainer_pb2_grpc.TrainerStub(channel)
                trainer.Load(trainer_pb2.TrainerLoadRequest(model_path=str(model_dir), version=1), timeout=600)
                for cycle in range(-_WARMUP_CYCLES, args.repeats):
                    for setting in args.transports:
                        for count in args.engine_counts:
                            result = push(trainer, engines[:count], trainer_process.pid, setting, num_bytes,
                                          cycle=cycle)
                            if cycle >= 0:
                                pushes.append(result)
                    if cycle >= 0:
                        print(f"cycle {cycle + 1}/{args.repeats}: " + ", ".join(
                            f"{p.transport} x{p.num_engines} {p.seconds:.3f}s" for p in pushes
                            if p.cycle == cycle), file=sys.stderr, flush=True)
            for endpoint in endpoints:
                with grpc.insecure_channel(endpoint) as channel:
                    status = rollout_pb2_grpc.RolloutStub(channel).GetStatus(rollout_pb2.GetStatusRequest(), timeout=30)
                if status.version != 1:
                    raise RuntimeError(f"engine {endpoint} reports version {status.version} after pushes of version 1")
        finally:
            stop_processes(processes, grace_seconds=30)
    summary = summarize(pushes, args, num_bytes=num_bytes, load_before=load_before, load_after=os.getloadavg(),
                        seconds=time.perf_counter() - started)
    print(json.dumps(summary))
    return 0


def summarize(pushes: list[Push], args: argparse.Namespace, *, num_bytes: int, load_before: tuple[float, ...],
              load_after: tuple[float, ...], seconds: float) -> dict:
    def median(field: str, transport: str, count: int) -> float:
        return statistics.median(getattr(p, field) for p in pushes
                                 if p.transport == transport and p.num_engines == count)

    medians = {t: {str(n): median("seconds", t, n) for n in args.engine_counts} for t in args.transports}
    trainer_medians = {t: {str(n): round(median("trainer_seconds", t, n), 4) for n in args.engine_counts}
                       for t in args.transports}
    cpu = {t: {str(n): {"engines": round(median("engine_cpu_seconds", t, n), 4),
                        "trainer": round(median("trainer_cpu_seconds", t, n), 4)} for n in args.engine_counts}
           for t in args.transports}
    ratios = {t: {n: round(s / by_count["1"], 3) for n, s in by_count.items()} for t, by_count in medians.items()}
    largest = str(max(args.engine_counts))
    print(f"\nWeight push of {num_bytes / 1e6:.1f} MB to N engines (median of {args.repeats} alternating cycles)")
    print(f"{'transport':<9} {'engines':>7} {'seconds':>8} {'x one':>6} {'trainer s':>9} {'GB/s per engine':>15} "
          f"{'engine CPU s':>12} {'trainer CPU s':>13}")
    for transport, by_count in medians.items():
        for count, value in by_count.items():
            print(f"{transport:<9} {count:>7} {value:>8.3f} {ratios[transport][count]:>6.2f} "
                  f"{trainer_medians[transport][count]:>9.3f} {num_bytes / value / 1e9:>15.3f} "
                  f"{cpu[transport][count]['engines']:>12.3f} {cpu[transport][count]['trainer']:>13.3f}")
    goal = {t: ratios[t][largest] <= GOAL_RATIO for t in args.transports}
    print(f"ratio {largest} engines / 1: " + ", ".join(f"{t} {ratios[t][largest]}" for t in args.transports)
          + f" (goal <= {GOAL_RATIO})")
    return {
        "seconds": {t: {n: round(s, 4) for n, s in by_count.items()} for t, by_count in medians.items()},
        "trainer_seconds": trainer_medians, "ratio_to_one": ratios, "cpu_seconds": cpu,
        f"ratio_{largest}_to_1": {t: ratios[t][largest] for t in args.transports},
        "goal_ratio": GOAL_RATIO, "goal_met": goal, "num_bytes": num_bytes, "mb": args.mb,
        "engine_counts": args.engine_counts, "transports": args.transports, "repeats": args.repeats,
        "warmup_cycles": _WARMUP_CYCLES, "engine_threads": 1, "cpu_count": os.cpu_count(),
        "loadavg_before": [round(x, 2) for x in load_before], "loadavg_after": [round(x, 2) for x in load_after],
        "wall_seconds": round(seconds, 1),
        "pushes": [{**asdict(p), "seconds": round(p.seconds, 4), "trainer_seconds": round(p.trainer_seconds, 4),
                    "engine_cpu_seconds": round(p.engine_cpu_seconds, 4),
                    "trainer_cpu_seconds": round(p.trainer_cpu_seconds, 4)} for p in pushes],
    }


if __name__ == "__main__":
    sys.exit(main())
