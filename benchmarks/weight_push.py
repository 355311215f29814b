"""Weight push throughput: `python -m benchmarks.weight_push [--mb 500] [--repeats 5] [--transport auto,grpc]
[--lora-rank R] [--shm-copies 1|2]`.

As the platform does it: a real trainer process (`python -m everstep_trainer`) holding a random
Llama of about --mb MB (float32), and a real rollout process (`python -m everstep_rollout`)
holding the same model, on this machine; the benchmark calls `Trainer.PushWeights` as the
controller does, once to warm up, then --repeats times per transport, and takes the median wall
time of the call. Baseline, same run: `memcpy`, a plain in-process `dst.copy_(src)` of the same
tensors into preallocated ones, after every timed push (so that both see the same load), with one
torch thread and with torch's default count; the faster median of the two is memcpy_gb_per_s.

--shm-copies 1|2: the trainer's setting of the same name: full shm pushes with one copy (the trainer writes the
segment, the engine runs on it; the default) or two (the engine copies out of it). Each transport's result says
`engine_copies`: 0 when the engine kept every timed push in place, else 1.

Transports: comma-separated PushWeights settings; "auto" (the platform default) is reported under
what it resolves to (shm on one host with a CPU engine). The engine's own metrics are read back to
check that every push arrived whole over the transport named. With --device cuda the engine runs
on the GPU (the trainer uses it whenever it has one), auto resolves to cuda_ipc, and nccl can be
asked for; the baseline is then a device-to-device copy. (The GPU variant has not been run: no
GPU where it was written.)

--lora-rank R: then the trainer reloads the same model with LoRA adapters of rank R (alpha 2R) on every linear
layer but the head, and the pushes are timed again over the default transport: each carries the adapters alone,
and the engine rebuilds the adapted weights from its kept base (W_base + alpha/R * B @ A). Besides the push, two
ways of applying an adapter are measured in this process on the same weights: merging it (`AdapterMerger`, what
the engine does, once per push) and leaving it beside W as two low-rank matmuls (the cost added to every decode
step of --decode-batch tokens); `merge_breakeven_decode_steps` is how many decode steps per push make the
unmerged way the dearer one.

Output: one line per transport, then, as the last line, one JSON object with gb_per_s (the default
transport), memcpy_gb_per_s, ratio_to_memcpy (the full push), default_transport, per-transport results, the model
size and the machine's load average at the start (other work on the machine slows both sides); with --lora-rank
also full_bytes, full_seconds, adapter_bytes, adapter_seconds and the merge / low-rank figures.
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

from everstep.processes import ManagedProcess, free_port, spawn, stop_processes, wait_grpc_serving
from everstep.settings.codec import TRAINER_CONFIG
from everstep.settings.training import ALL_LINEAR, LoraSettings, TrainerConfig
from everstep.v1 import rollout_pb2, rollout_pb2_grpc, trainer_pb2, trainer_pb2_grpc
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

    from everstep_tools.demo.task import TaskConfig
    from everstep_tools.demo.tokenizer import save_tokenizer

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


def adapter_bytes(mb: float, rank: int) -> int:
    """float32 bytes of rank-`rank` adapters on every linear layer of `model_shape(mb)`'s Llama but the head."""
    hidden, intermediate, layers = model_shape(mb)
    per_layer = 4 * (hidden + hidden) + 2 * (hidden + intermediate) + (intermediate + hidden)  # q k v o; gate up; down
    return 4 * rank * per_layer * layers


def apply_cost(model_dir: Path, rank: int, decode_batch: int, repeats: int) -> dict:
    """Seconds to merge one adapter version into the kept base (`AdapterMerger`, all adapted modules), and seconds
    the same adapters add to one decode step of `decode_batch` tokens when applied unmerged (x A^T B^T beside
    x W^T), medians over `repeats`."""
    import torch

    from everstep_rollout.weights.lora import AdapterMerger, read_base_weights

    names = set(_linear_weight_names(model_dir))
    base = read_base_weights(model_dir, names)
    generator = torch.Generator().manual_seed(0)
    adapter = {}
    for name, weight in base.items():
        module = name.removesuffix(".weight")
        adapter[f"{module}.lora_A"] = torch.randn(rank, weight.shape[1], generator=generator) * 0.01
        adapter[f"{module}.lora_B"] = torch.randn(weight.shape[0], rank, generator=generator) * 0.01
    merger = AdapterMerger(model_dir)
    merger.merged(adapter, rank=rank, alpha=2.0 * rank)  # reads and keeps the base, as an engine at its first adapter
    merge_seconds, dense_seconds, lowrank_seconds = [], [], []
    for _ in range(repeats):
        start = time.perf_counter()
        merger.merged(adapter, rank=rank, alpha=2.0 * rank)
        merge_seconds.append(time.perf_counter() - start)
    linear = torch.nn.functional.linear
    with torch.inference_mode():
        inputs = {n: torch.randn(decode_batch, w.shape[1], generator=generator) for n, w in base.items()}
        outputs = {n: linear(inputs[n], w) for n, w in base.items()}
        # The extra work of unmerged adapters, timed by itself (a difference of two noisy timings is not):
        # x A^T, then (x A^T) B^T added into the layer's output, for every adapted module of one decode step.
        for _ in range(max(repeats, 20)):
            start = time.perf_counter()
            for name, weight in base.items():
                linear(inputs[name], weight)
            dense_seconds.append(time.perf_counter() - start)
            start = time.perf_counter()
            for name in base:
                module = name.removesuffix(".weight")
                low = linear(inputs[name], adapter[f"{module}.lora_A"])
                outputs[name].add_(linear(low, adapter[f"{module}.lora_B"]), alpha=2.0)
            lowrank_seconds.append(time.perf_counter() - start)
    merge = statistics.median(merge_seconds)
    overhead = statistics.median(lowrank_seconds)
    return {"merge_seconds": round(merge, 5), "lowrank_decode_step_overhead_seconds": round(overhead, 6),
            "dense_linear_seconds_per_decode_step": round(statistics.median(dense_seconds), 6),
            "decode_batch": decode_batch, "merge_breakeven_decode_steps": round(merge / overhead, 1),
            "num_adapted_modules": len(base)}


def _linear_weight_names(model_dir: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        return [n for n in f.keys() if n.startswith("model.layers.") and n.endswith("_proj.weight")]  # noqa: SIM118


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
    wall, server, kept = [], [], []
    for _ in range(repeats):
        start = time.perf_counter()
        response = trainer.PushWeights(request, timeout=600)
        wall.append(time.perf_counter() - start)
        server.append(response.seconds)
        kept.append(response.num_kept_in_place)
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
            "min_seconds": round(min(wall), 4), "max_seconds": round(max(wall), 4), "median_seconds": seconds,
            "engine_copies": 0 if kept and min(kept) == 1 else 1}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks.weight_push", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=500, help="size of the weights, MB (float32)")
    parser.add_argument("--repeats", type=int, default=5, help="timed pushes per transport (after one warm-up)")
    parser.add_argument("--transport", default="auto,grpc",
                        help="comma-separated PushWeights settings: auto, shm, grpc, gloo, nccl, cuda_ipc "
                             "(auto is the default one)")
    parser.add_argument("--lora-rank", type=int, default=0,
                        help="also time adapter-only pushes of LoRA adapters of this rank (0: off)")
    parser.add_argument("--decode-batch", type=int, default=16,
                        help="--lora-rank: tokens of the decode step the unmerged adapters are timed on")
    parser.add_argument("--shm-copies", type=int, default=1, choices=[1, 2],
                        help="the trainer's --shm-copies: full shm pushes with one copy (the engine runs on the "
                             "segment) or two (it copies out of it)")
    parser.add_argument("--device", default="cpu",
                        help="the rollout engine's device (cpu, cuda[:N]); the trainer uses CUDA whenever it has one")
    args = parser.parse_args(argv)
    settings = [s.strip() for s in args.transport.split(",") if s.strip()]
    unknown = sorted(set(settings) - {t.value for t in Transport})
    if unknown or not settings:
        parser.error(f"--transport: unknown or empty settings {unknown or args.transport!r}")
    if args.repeats < 1 or args.mb <= 0:
        parser.error("--repeats must be >= 1 and --mb > 0")
    if args.lora_rank < 0 or args.decode_batch < 1:
        parser.error("--lora-rank must be >= 0 and --decode-batch >= 1")

    load_at_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="everstep-weight-push-") as tmp:
        work = Path(tmp)
        model_dir = work / "model"
        num_bytes = make_model(model_dir, args.mb)
        print(f"model: {num_bytes / 1e6:.1f} MB of float32 weights in {model_dir}", file=sys.stderr, flush=True)
        rollout = start_service("rollout", work / "rollout.log", "--model", str(model_dir), "--device", args.device)
        trainer_service = start_service("trainer", work / "trainer.log", "--shm-copies", str(args.shm_copies))
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
                if args.lora_rank:
                    lora = LoraSettings(rank=args.lora_rank, alpha=2.0 * args.lora_rank, target_modules=[ALL_LINEAR])
                    config = TRAINER_CONFIG.to_proto(TrainerConfig(lora=lora))
                    trainer.Load(trainer_pb2.TrainerLoadRequest(model_path=str(model_dir), version=1, config=config),
                                 timeout=600)
                    # A fresh engine: its base is then the model directory's (the full pushes replaced it)
                    with grpc.insecure_channel(rollout.grpc_address) as rollout_channel:
                        rollout_pb2_grpc.RolloutStub(rollout_channel).Load(rollout_pb2.LoadModelRequest(
                            model_path=str(model_dir), version=1), timeout=600)
                    lora_bytes = adapter_bytes(args.mb, args.lora_rank)
                    lora_results = {}
                    for setting in settings:
                        lora_results[setting] = bench_transport(trainer, rollout, setting, args.repeats, lora_bytes,
                                                                baseline)
                        print(f"adapters (rank {args.lora_rank}) {setting:>5} -> "
                              f"{lora_results[setting]['transport']:<5}: {lora_bytes / 1e6:.2f} MB in "
                              f"{lora_results[setting]['seconds']:.4f}s (median of {args.repeats}; full push "
                              f"{results[setting]['seconds']:.4f}s)", flush=True)
                    lora_result = lora_results.get("auto") or next(iter(lora_results.values()))
            with grpc.insecure_channel(rollout.grpc_address) as channel:
                status = rollout_pb2_grpc.RolloutStub(channel).GetStatus(rollout_pb2.GetStatusRequest(), timeout=30)
                if status.version != 1:
                    raise RuntimeError(f"the engine reports version {status.version} after pushes of version 1")
            applying = (apply_cost(model_dir, args.lora_rank, args.decode_batch, args.repeats) if args.lora_rank
                        else None)
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
        "repeats": args.repeats, "memcpy_threads": threads, "shm_copies_setting": args.shm_copies,
        "memcpy_gb_per_s_by_threads": {str(t): _significant(num_bytes / s / 1e9) for t, s in memcpy.items()},
        "cpu_count": os.cpu_count() or 1,
        "load_avg_1m_at_start": round(load_at_start, 2),
    }
    if args.lora_rank:
        summary.update({
            "lora_rank": args.lora_rank, "full_bytes": num_bytes, "full_seconds": default["seconds"],
            "adapter_bytes": lora_bytes, "adapter_seconds": lora_result["seconds"],
            "adapter_transport": lora_result["transport"],
            "adapter_transports": {r["transport"]: {"adapter_seconds": r["seconds"],
                                                    "full_seconds": results[r["setting"]]["seconds"]}
                                   for r in lora_results.values()},
            "bytes_ratio": _significant(num_bytes / lora_bytes), "seconds_ratio": _significant(
                default["seconds"] / lora_result["seconds"]),
            **applying,
        })
        print(f"merge one adapter version: {applying['merge_seconds']:.4f}s; unmerged adapters add "
              f"{applying['lowrank_decode_step_overhead_seconds'] * 1e3:.3f} ms to a {args.decode_batch}-token decode "
              f"step (break-even: {applying['merge_breakeven_decode_steps']} decode steps per push)", flush=True)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
