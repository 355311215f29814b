"""Weight push throughput: `python -m benchmarks.weight_push [--mb 500] [--repeats 5] [--transport auto,grpc]`.

As the platform does it: a real trainer process (`python -m everstep_trainer`) holding a random
Llama of about --mb MB (float32), and a real rollout process (`python -m everstep_rollout`)
holding the same model, on this machine; the benchmark calls `Trainer.PushWeights` as the
controller does, once to warm up, then --repeats times per transport, and takes the median wall
time of the call. Baseline, same run: `memcpy`, a plain in-process `dst.copy_(src)` of the same
tensors into preallocated ones, after every timed push (so that both see the same load), with one
torch thread and with torch's default count; the faster median of the two is memcpy_gb_per_s.

Transports: comma-separated PushWeights settings; "auto" (the platform default) is reported under
what it resolves to (shm on one host with a CPU engine). The engine's own metrics are read back to
check that every push arrived whole over the transport named. With --device cuda the engine runs
on the GPU (the trainer uses it whenever it has one), auto resolves to cuda_ipc, and nccl can be
asked for; the baseline is then a device-to-device copy. (The GPU variant has not been run: no
GPU where it was written.)

Output: one line per transport, then, as the last line, one JSON object with gb_per_s (the default
transport), memcpy_gb_per_s, ratio_to_memcpy, default_transport, per-transport results, the model
size and the machine's load average at the start (other work on the machine slows both sides).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import grpc

from everstep.v1 import rollout_pb2, rollout_pb2_grpc, trainer_pb2, trainer_pb2_grpc
from everstep_controller.launchers.processes import ManagedProcess, free_port, spawn, stop_processes, wait_grpc_serving
from everstep_trainer.weight_push.plan import Transport

_READY_TIMEOUT_SECONDS = 300


def _significant(value: float, digits: int = 4) -> float:
    return float(f"{value:.{digits}g}")


def model_shape(mb: float) -> tuple[int, int, int]:
    """(hidden, intermediate, layers) of a Llama whose float32 weights are about `mb` MB (the tiny vocabulary
    makes the embeddings negligible): 4 h^2 + 3 h i parameters per layer."""
    hidden = 1024 if mb >= 100 else 256 if mb >= 4 else 64
    intermediate = 3 * hidden
    per_layer_bytes = 4 * (4 * hidden * hidden + 3 * hidden * intermediate)
    return hidden, intermediate, max(1, round(mb * 1e6 / per_layer_bytes))


def make_model(out: Path, mb: float) -> int:
    """A random Llama with the demo tokenizer, saved in Hugging Face format; returns its weight bytes."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from everstep_trainer.demo.task import TaskConfig
    from everstep_trainer.demo.tokenizer import save_tokenizer

    hidden, intermediate, layers = model_shape(mb)
    tokenizer = save_tokenizer(TaskConfig().words(), out)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64, max_position_embeddings=256,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.no_grad():
        model = LlamaForCausalLM(config)
    model.save_pretrained(out)
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def start_service(name: str, log_path: Path, *extra: str) -> ManagedProcess:
    http_port, grpc_port = free_port(), free_port()
    return spawn(name, ["-m", f"everstep_{name}", "--host", "127.0.0.1", "--port", str(http_port),
                        "--grpc-port", str(grpc_port), *extra], log_path, http_port=http_port, grpc_port=grpc_port)


def _metrics_url(service: ManagedProcess) -> str:
    return f"http://127.0.0.1:{service.http_port}/metrics"


class MemcpyBaseline:
    """Copies of the model's tensors into preallocated, already touched ones, in this process: with one torch
    thread (a plain memcpy) and with torch's default thread count. Timed between pushes, so that both see
    the same load on the machine."""

    def __init__(self, model_dir: Path, device: str) -> None:
        import torch
        from safetensors.torch import load_file

        self.device = device
        self.sources = list(load_file(str(model_dir / "model.safetensors"), device=device).values())
        self.targets = [torch.empty_like(t) for t in self.sources]
        self.default_threads = torch.get_num_threads()
        self.seconds: dict[int, list[float]] = {threads: [] for threads in sorted({1, self.default_threads})}
        self._copy()  # touch the targets' pages

    def _copy(self) -> float:
        import torch

        start = time.perf_counter()
        for target, source in zip(self.targets, self.sources, strict=True):
            target.copy_(source)
        if self.device.startswith("cuda"):
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - start

    def measure(self) -> None:
        import torch

        try:
            for threads, times in self.seconds.items():
                torch.set_num_threads(threads)
                times.append(self._copy())
        finally:
            torch.set_num_threads(self.default_threads)

    def medians(self) -> dict[int, float]:
        return {threads: statistics.median(times) for threads, times in self.seconds.items()}


def applied_bytes(metrics_url: str, transport: str) -> float:
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    match = re.search(rf'^everstep_rollout_weight_update_bytes_total{{transport="{transport}"}} (\S+)$', text, re.M)
    return float(match.group(1)) if match else 0.0


def bench_transport(trainer: trainer_pb2_grpc.TrainerStub, rollout: ManagedProcess, setting: str, repeats: int,
                    num_bytes: int, baseline: MemcpyBaseline) -> dict:
    request = trainer_pb2.PushWeightsRequest(endpoints=[rollout.grpc_address], transport=Transport(setting).to_proto())
    warm = trainer.PushWeights(request, timeout=600)  # channels, segments, groups: set up once
    transport = warm.transports[rollout.grpc_address]
    before = applied_bytes(_metrics_url(rollout), transport)
    wall, server = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        response = trainer.PushWeights(request, timeout=600)
        wall.append(time.perf_counter() - start)
        server.append(response.seconds)
        if response.num_bytes != num_bytes or response.transports[rollout.grpc_address] != transport:
            raise RuntimeError(f"{setting}: pushed {response.num_bytes} bytes over {dict(response.transports)}")
        baseline.measure()
    arrived = applied_bytes(_metrics_url(rollout), transport) - before
    if arrived != repeats * num_bytes:
        raise RuntimeError(f"{setting}: the engine applied {arrived} bytes over {transport}, "
                           f"expected {repeats * num_bytes}")
    seconds = statistics.median(wall)
    return {"transport": transport, "setting": setting, "seconds": round(seconds, 4),
            "gb_per_s": _significant(num_bytes / seconds / 1e9), "trainer_seconds": round(statistics.median(server), 4),
            "min_seconds": round(min(wall), 4), "max_seconds": round(max(wall), 4), "median_seconds": seconds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks.weight_push", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=500, help="size of the weights, MB (float32)")
    parser.add_argument("--repeats", type=int, default=5, help="timed pushes per transport (after one warm-up)")
    parser.add_argument("--transport", default="auto,grpc",
                        help="comma-separated PushWeights settings: auto, shm, grpc, gloo, nccl, cuda_ipc "
                             "(auto is the default one)")
    parser.add_argument("--device", default="cpu",
                        help="the rollout engine's device (cpu, cuda[:N]); the trainer uses CUDA whenever it has one")
    args = parser.parse_args(argv)
    settings = [s.strip() for s in args.transport.split(",") if s.strip()]
    unknown = sorted(set(settings) - {t.value for t in Transport})
    if unknown or not settings:
        parser.error(f"--transport: unknown or empty settings {unknown or args.transport!r}")
    if args.repeats < 1 or args.mb <= 0:
        parser.error("--repeats must be >= 1 and --mb > 0")

    load_at_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="everstep-weight-push-") as tmp:
        work = Path(tmp)
        model_dir = work / "model"
        num_bytes = make_model(model_dir, args.mb)
        print(f"model: {num_bytes / 1e6:.1f} MB of float32 weights in {model_dir}", file=sys.stderr, flush=True)
        rollout = start_service("rollout", work / "rollout.log", "--model", str(model_dir), "--device", args.device)
        trainer_service = start_service("trainer", work / "trainer.log")
        results: dict[str, dict] = {}
        baseline = MemcpyBaseline(model_dir, args.device)
        try:
            wait_grpc_serving(rollout, _READY_TIMEOUT_SECONDS)
            wait_grpc_serving(trainer_service, _READY_TIMEOUT_SECONDS)
            with grpc.insecure_channel(trainer_service.grpc_address) as channel:
                trainer = trainer_pb2_grpc.TrainerStub(channel)
                trainer.Load(trainer_pb2.TrainerLoadRequest(model_path=str(model_dir), version=1), timeout=600)
                for setting in settings:
                    result = bench_transport(trainer, rollout, setting, args.repeats, num_bytes, baseline)
                    results[setting] = result
                    print(f"{setting:>5} -> {result['transport']:<5} {result['gb_per_s']:7.3f} GB/s "
                          f"(median {result['seconds']:.3f}s of {args.repeats}, trainer-side "
                          f"{result['trainer_seconds']:.3f}s)", flush=True)
            with grpc.insecure_channel(rollout.grpc_address) as channel:
                status = rollout_pb2_grpc.RolloutStub(channel).GetStatus(rollout_pb2.GetStatusRequest(), timeout=30)
                if status.version != 1:
                    raise RuntimeError(f"the engine reports version {status.version} after pushes of version 1")
        finally:
            stop_processes([rollout, trainer_service], grace_seconds=30)
    memcpy = baseline.medians()
    for threads, seconds in memcpy.items():
        print(f"memcpy        {num_bytes / seconds / 1e9:7.3f} GB/s (median {seconds:.3f}s, {threads} torch thread(s))",
              flush=True)
    threads = min(memcpy, key=memcpy.get)  # the faster copy is the baseline
    memcpy_gb_per_s = num_bytes / memcpy[threads] / 1e9
    for result in results.values():
        result["ratio_to_memcpy"] = _significant(num_bytes / result.pop("median_seconds") / 1e9 / memcpy_gb_per_s)
    default = results.get("auto") or next(iter(results.values()))
    summary = {
        "gb_per_s": default["gb_per_s"], "memcpy_gb_per_s": _significant(memcpy_gb_per_s),
        "ratio_to_memcpy": default["ratio_to_memcpy"], "default_transport": default["transport"],
        "transports": {r["transport"]: r for r in results.values()}, "num_bytes": num_bytes,
        "repeats": args.repeats, "memcpy_threads": threads,
        "memcpy_gb_per_s_by_threads": {str(t): _significant(num_bytes / s / 1e9) for t, s in memcpy.items()},
        "cpu_count": os.cpu_count() or 1,
        "load_avg_1m_at_start": round(load_at_start, 2),
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
