r"""Every GPU check in one run: `python -m benchmarks.gpu_check [--device cuda|cpu] [--size 100m|tiny] [--out DIR]`.

Parts, in order (each wrapped: a failure is recorded as "error" in its entry and the rest still run):

1. model        a random Llama made here (100m: hidden 768, 12 layers, ~104M parameters; tiny: ~100k) with
                the demo task's word-level tokenizer, saved in Hugging Face format.
2. throughput   our torch engine (bf16, continuous batching, max_running slots) on >= 256 demo-task prompts
                (100m: 1024) with long-tailed max_new_tokens (lognormal, capped). The engine has no
                ignore-EOS option, so its EOS set is cleared for this part: every sequence runs to its
                length, and finish_reasons says what stopped them.
3. mismatch     k3 KL(pi_engine || pi_trainer), mean and max |delta logp| between the engine's bf16 log-probs
                and the trainer's float32 log-probs (and bf16-autocast ones) on the same tokens.
4. train_step   one bf16-autocast PolicyTrainer.train_step on engine samples (advantages +1/-1 alternating:
                a random model earns no reward), and `losses.policy_loss` on the same batch (at ratio 1 the
                two losses agree).
5. weight_push  trainer process -> a second process running its own engine on the same device. On CUDA the
                parameters travel through everstep's own CUDA IPC transport (`everstep.tensors.cuda_ipc`, the
                module the trainer's `cuda_ipc` push and the engine's receiver use: encode once per
                receiver, the handles as plain data, rebuild on the GPU with that UUID, no copy on the
                sender); the receiver also checks that torch refuses to re-share a received tensor and
                accepts its `owned` clone (what the sglang engine relies on). On CPU, where CUDA IPC cannot
                run, torch's shared memory carries them. The receiver copies into its engine with
                update_weights; checksums of every tensor (as the engine's dtype) are compared on both
                sides. One cold push, then warm ones, GB/s of bytes sent.
6. broadcast    the weight-broadcast group across hosts, as the trainer's nccl/gloo push forms it
                (`everstep.tensors.process_group`, sglang's store keys): this process as rank 0 and a second
                process as the engine's rank 1, every trained tensor broadcast, checksums compared, GB/s. NCCL
                on CUDA (one GPU per rank: with one GPU it is reported as skipped, with the reason); gloo on CPU.
7. lora_push    adapter-only pushes, as a LoRA trainer sends them (rank 16, alpha 32, on every linear layer of the
                decoder), to the same kind of engine process over the same transport (CUDA IPC on CUDA, shared
                memory on CPU): the receiver rebuilds each version from its kept base with the rollout engine's
                `AdapterMerger` (W = W_base + alpha/rank * B @ A, in float32 on the engine's device) and copies the
                result in with update_weights; checksums of the merged weights (as the engine's dtype) against the
                sender's own merge, over several versions; adapter bytes and seconds against the full push's.
                (The adapters are random here: peft is not on the GPU machine; tests/trainer checks the trainer's.)
8. rl           a short supervised warm start (own loop: bf16 autocast, label smoothing) on easy chains, then
                a few GRPO steps: engine rollouts (T=1, EOS on), reward = the demo task's boxed-answer check,
                group-normalised advantages, train_step, update_weights into the engine. Reward per step.

Optional, only when asked for with --parts (it runs in the sglang environment, not in the main check's):

9. sglang_tools the sglang engine's multi-turn tool loop on sglang's offline Engine (radix cache on) against the
                example calculator environment in its own process, compared with our torch engine on the same
                requests: same trajectories, tool masks and versions, log-prob gap, the share of each continuation
                request's input that sglang's prefix cache held (benchmarks/gpu_check_sglang_tools.py)::

    PYTHONPATH=common:services/rollout .venv-sglang/bin/python -m benchmarks.gpu_check --device cuda \
        --parts sglang_tools --out "$OUT" 2> "$OUT/gpu_check.log"

On the GPU machine, from the repository root (torch and transformers >= 4.56 installed; nothing else: no
grpc, no protobuf, no stubs, no network; `common` on the path makes the torch-only `everstep.tensors.cuda_ipc`
importable)::

    PYTHONPATH=common:services/rollout:services/trainer:tools python -m benchmarks.gpu_check --device cuda \
        --size 100m --out "$OUT" 2> "$OUT/gpu_check.log"

A global time budget (--time-budget-seconds, 210 s by default) bounds every loop; a watchdog writes and
prints the report so far and exits if the run overruns it by 40 s, so the whole check ends within 5
minutes. OUT/gpu_check.json is written at the start and rewritten after every part and by the watchdog,
so a crash or a kill leaves the parts done so far. Progress goes to stderr; the last stdout line is one
JSON object: {"ok", "device", "size", "torch", "transformers", ..., "parts": {"model": {...}, ...}}. Exit
status 0 iff every part is ok; 2 when the machine cannot run the check at all (no CUDA, or transformers
older than 4.56, whose from_pretrained does not take dtype=).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import queue
import random
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("benchmarks.gpu_check")

_WATCHDOG_GRACE_SECONDS = 40.0
_DEFAULT_TIME_BUDGET_SECONDS = 210.0
_PUSH_WARM_REPEATS = 2
_LORA_RANK, _LORA_ALPHA, _LORA_PUSHES = 16, 32.0, 4
TRANSFORMERS_FLOOR = (4, 56)
"""from_pretrained(..., dtype=) (the trainer and the engine pass dtype=) needs transformers 4.56."""


@dataclass(frozen=True, kw_only=True)
class CheckSize:
    """Model shape and workload of one check size."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    max_position_embeddings: int
    num_prompts: int
    """Throughput prompts."""
    median_new_tokens: int
    """Median of the long-tailed (lognormal) max_new_tokens."""
    max_new_tokens: int
    """Cap of that distribution."""
    max_running: int
    """Engine KV cache slots (sequences decoded together)."""
    num_scored_samples: int
    """Throughput outputs used for the mismatch and the train step."""
    warm_start_steps: int
    warm_start_batch: int
    warm_start_learning_rate: float
    rl_steps: int
    rl_prompts: int
    rl_group_size: int
    rl_max_ops: int
    """Longest chain of the RL prompts (easy chains: rewards above zero after a short warm start)."""
    tool_requests: int = 4
    """sglang_tools: requests that call the calculator (and half as many plain ones beside them)."""
    tool_hidden_size: int = 64
    """sglang_tools: hidden size of the tool model (4 heads: 512 gives head dim 128)."""


SIZES: dict[str, CheckSize] = {
    "100m": CheckSize(
        hidden_size=768, intermediate_size=3072, num_layers=12, num_heads=12, num_kv_heads=4,
        max_position_embeddings=2048, num_prompts=1024, median_new_tokens=128, max_new_tokens=1024,
        max_running=256, num_scored_samples=64, warm_start_steps=300, warm_start_batch=128,
        warm_start_learning_rate=5e-4, rl_steps=4, rl_prompts=64, rl_group_size=8, rl_max_ops=4,
        tool_requests=64, tool_hidden_size=512),
    "tiny": CheckSize(
        hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
        max_position_embeddings=256, num_prompts=16, median_new_tokens=6, max_new_tokens=24, max_running=8,
        num_scored_samples=8, warm_start_steps=10, warm_start_batch=16, warm_start_learning_rate=3e-3,
        rl_steps=2, rl_prompts=4, rl_group_size=4, rl_max_ops=2),
}


class Deadline:
    """The run's time budget; parts take a fraction of it and loops stop at their part's deadline."""

    def __init__(self, budget_seconds: float) -> None:
        self.budget_seconds = budget_seconds
        self.start = time.monotonic()

    def remaining(self) -> float:
        return self.start + self.budget_seconds - time.monotonic()

    def part(self, fraction: float) -> float:
        """Absolute monotonic deadline: now + fraction of the budget, never past the end of the run."""
        return time.monotonic() + max(0.0, min(self.remaining(), fraction * self.budget_seconds))


def long_tailed_lengths(num: int, *, median: int, cap: int, seed: int, sigma: float = 0.9) -> list[int]:
    """Lognormal lengths in [1, cap] with the given median: most short, a few near the cap."""
    rng = random.Random(seed)
    return [min(cap, max(1, round(rng.lognormvariate(math.log(median), sigma)))) for _ in range(num)]


def make_model_dir(out: Path, size: CheckSize, *, seed: int = 0) -> int:
    """A random Llama with the demo task's tokenizer in Hugging Face format; returns its parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from everstep_tools.demo.task import TaskConfig
    from everstep_tools.demo.tokenizer import save_tokenizer

    tokenizer = save_tokenizer(TaskConfig().words(), out)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=size.hidden_size, intermediate_size=size.intermediate_size,
        num_hidden_layers=size.num_layers, num_attention_heads=size.num_heads,
        num_key_value_heads=size.num_kv_heads, max_position_embeddings=size.max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


@dataclass
class GenerationRun:
    results: list
    """SequenceResults, in finishing order (drained ones last)."""
    seconds: float
    num_steps: int
    decode_seconds: float
    mean_running: float
    truncated: bool
    """The deadline came first and unfinished sequences were drained."""


def run_engine(engine, requests: Sequence, *, until: float) -> GenerationRun:
    """Add every request, step the engine until none is left (or `until`), collect the results."""
    start = time.perf_counter()
    engine.add(requests)
    results, num_steps, decode_seconds, running_sum = [], 0, 0.0, 0
    while engine.has_work and time.monotonic() < until:
        results += engine.step()
        num_steps += 1
        decode_seconds += engine.last_step.decode_seconds
        running_sum += engine.last_step.num_decoded
    truncated = engine.has_work
    results += engine.drain()
    return GenerationRun(results, time.perf_counter() - start, num_steps, decode_seconds,
                         running_sum / max(num_steps, 1), truncated)


def weight_checksums(named: Mapping[str, Any], dtype) -> dict[str, float]:
    """Position-weighted float64 sum of each tensor cast to `dtype` (the engine's): equal values, equal sums."""
    import torch

    sums = {}
    for name, tensor in named.items():
        flat = tensor.detach().to(dtype).double().reshape(-1)
        position_weight = torch.arange(flat.numel(), device=flat.device, dtype=torch.float64) % 251 + 1
        sums[name] = float((flat * position_weight).sum())
    return sums


def _broadcast_receiver(backend: str, device: str, port: int, layout: list, replies: Any) -> None:
    """Rank 1 of a weight-broadcast group (an engine's side): joins, takes every tensor of `layout` (name, shape,
    dtype) from rank 0, and replies with their checksums."""
    import datetime

    import torch
    import torch.distributed as dist

    from everstep.tensors import process_group

    try:
        timeout = datetime.timedelta(seconds=120)
        store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=timeout)
        group = process_group.new_group(backend, store, group_name="gpu-check-broadcast", rank=1, world_size=2,
                                        timeout=timeout)
        process_group.warm_up(group, device=torch.device(device), timeout=timeout)
        received = {}
        for name, shape, dtype in layout:
            tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
            group.broadcast(tensor, 0).wait()
            received[name] = tensor
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
        replies.put(("checksums", weight_checksums(received, getattr(torch, layout[0][2]))))
        process_group.shutdown_group(group)
    except Exception:  # noqa: BLE001 - reported to the parent, which fails the part with it
        replies.put(("error", traceback.format_exc()))


def _engine_process(model_dir: str, engine_config, num_threads: int, requests: Any, replies: Any) -> None:
    """The receiving side of the weight push: an engine in its own process, updated from shared tensors."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s engine-process %(message)s")
    try:
        import torch

        from everstep_rollout.engine import Engine

        torch.set_num_threads(num_threads)
        engine = Engine(model_dir, engine_config)
        dtype = engine.config.torch_dtype
        merger = None
        replies.put(("ready", weight_checksums(engine.weights.named, dtype)))
        while True:
            message = requests.get()
            if message[0] == "stop":
                return
            version, named = message[1], message[2]
            lora = message[3] if len(message) > 3 else None  # (rank, alpha): the tensors are LoRA adapters
            del message
            start = time.perf_counter()
            reshare = None
            if isinstance(named, list):  # CUDA IPC handles from everstep.tensors.cuda_ipc.encode
                named, reshare = _rebuild_handles(named)
            if lora is not None:  # as the rollout server does with an adapter update
                from everstep_rollout.weights.lora import AdapterMerger

                merger = merger or AdapterMerger(model_dir, engine.config.device)
                received_bytes = sum(t.numel() * t.element_size() for t in named.values())
                named = merger.merged(named, rank=lora[0], alpha=lora[1])
            num_bytes = engine.update_weights(named, version)
            if lora is not None:
                num_bytes = received_bytes
            if engine.config.device.startswith("cuda"):
                torch.cuda.synchronize()
            copy_seconds = time.perf_counter() - start
            names = [n for n in named if n in engine.weights.named]
            del named  # drops the IPC references, so the sender may free or reuse that memory
            replies.put(("pushed", {"version": engine.version, "num_bytes": num_bytes, "copy_seconds": copy_seconds,
                                    "reshare": reshare}))
            # Checksummed after the reply, so that the sender's timing is the push's alone.
            replies.put(("checksums", weight_checksums({n: engine.weights.named[n] for n in names}, dtype)))
    except Exception:
        replies.put(("error", traceback.format_exc()))


def _rebuild_handles(handles: list) -> tuple[dict, dict]:
    """The receiver's half of everstep's CUDA IPC transport, and whether torch refuses to re-share what came
    (and accepts `cuda_ipc.owned` of it): the premise of the sglang engine's clone."""
    import io
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401 - registers torch's reductions with ForkingPickler

    from everstep.tensors import cuda_ipc

    named = {h.name: cuda_ipc.rebuild(h) for h in handles}
    probe = next(iter(named.values()))
    reshare: dict[str, Any] = {"received_refused": False, "owned_accepted": False}
    try:
        ForkingPickler(io.BytesIO()).dump(probe)
    except RuntimeError as e:
        reshare["received_refused"] = "received from another process" in str(e)
        reshare["message"] = str(e)[:200]
    try:
        ForkingPickler(io.BytesIO()).dump(cuda_ipc.owned(probe))
        reshare["owned_accepted"] = True
    except RuntimeError as e:
        reshare["owned_error"] = str(e)[:200]
    return named, reshare


def grpo_advantages(rewards: Sequence[float], group_size: int) -> list[float]:
    """(r - group mean) / (group std + 1e-6), groups of consecutive samples; 0 where a group agrees."""
    out: list[float] = []
    for start in range(0, len(rewards), group_size):
        group = rewards[start:start + group_size]
        mean, std = statistics.fmean(group), statistics.pstdev(group)
        out += [(r - mean) / (std + 1e-6) for r in group]
    return out


def to_samples(results: Sequence, advantages: Sequence[float]) -> list:
    from everstep_trainer.batch.samples import TrainSample

    return [TrainSample(prompt_ids=r.prompt_ids, output_ids=r.output_ids, rollout_logprobs=r.output_logprobs,
                        advantage=a) for r, a in zip(results, advantages, strict=True)]


def trainer_logp(trainer, batch, *, autocast_bf16: bool):
    """[B, L] float32 log-probs of batch's output tokens under trainer.model, no gradient, micro-batched."""
    import torch

    from everstep_trainer.batch.packing import split_micro_batches
    from everstep_trainer.model.hf_model import autocast_context, compute_token_logprobs

    logp = torch.zeros_like(batch.rollout_logp)
    lengths = batch.attention_mask.sum(dim=1).tolist()
    with torch.no_grad():
        for group in split_micro_batches(lengths, trainer.config.micro_batch_tokens):
            micro = batch.select(group)
            with autocast_context(trainer.device, "bfloat16" if autocast_bf16 else "float32"):
                micro_logp = compute_token_logprobs(trainer.model, micro.input_ids, micro.attention_mask,
                                                    micro.output_mask, trainer.config.temperature)
            rows = torch.as_tensor(group, device=trainer.device)
            logp[rows, : micro_logp.shape[1]] = micro_logp.float()
    return logp


def warm_start(model, tokenizer, examples: Sequence[tuple[str, str]], *, steps: int, batch_size: int,
               learning_rate: float, device, autocast_bf16: bool, until: float) -> dict[str, float]:
    """Supervised steps on (prompt, solution + EOS), loss on the solution only; the model is trained in place.

    Not `everstep_tools.demo.sft.train_supervised`: that one keeps its batches on the CPU.
    """
    import torch

    from everstep_trainer.model.hf_model import autocast_context

    encoded = [(tokenizer(p).input_ids, tokenizer(c, add_special_tokens=False).input_ids + [tokenizer.eos_token_id])
               for p, c in examples]
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate)
    rng = random.Random(0)
    model.train()
    losses: list[float] = []
    start = time.perf_counter()
    for step in range(steps):
        if time.monotonic() >= until:
            break
        for group in optimizer.param_groups:
            group["lr"] = learning_rate * min(1.0, (step + 1) / 10)
        batch = rng.sample(encoded, min(batch_size, len(encoded)))
        length = max(len(p) + len(c) for p, c in batch)
        input_ids = torch.full((len(batch), length), tokenizer.pad_token_id, dtype=torch.long)
        labels = torch.full((len(batch), length), -100, dtype=torch.long)
        attention_mask = torch.zeros((len(batch), length), dtype=torch.long)
        for i, (p, c) in enumerate(batch):
            input_ids[i, : len(p) + len(c)] = torch.tensor(p + c)
            labels[i, len(p): len(p) + len(c)] = torch.tensor(c)
            attention_mask[i, : len(p) + len(c)] = 1
        input_ids, labels, attention_mask = input_ids.to(device), labels.to(device), attention_mask.to(device)
        with autocast_context(torch.device(device), "bfloat16" if autocast_bf16 else "float32"):
            logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                                                 labels[:, 1:].reshape(-1), ignore_index=-100, label_smoothing=0.05)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    model.eval()
    return {"steps": len(losses), "seconds": round(time.perf_counter() - start, 2),
            "first_loss": losses[0] if losses else float("nan"), "final_loss": losses[-1] if losses else float("nan")}


class GpuCheck:
    """Shared state of one run: the model directory, one engine and one trainer (built when first needed)."""

    def __init__(self, *, device: str, size: CheckSize, dtype: str, work_dir: Path, deadline: Deadline) -> None:
        import torch

        self.device, self.size, self.dtype, self.deadline = device, size, dtype, deadline
        self.model_dir = work_dir / "model"
        self.num_threads = 1
        if device == "cpu":
            from everstep_rollout.config import default_num_threads

            self.num_threads = default_num_threads()
            torch.set_num_threads(self.num_threads)
        self._engine = None
        self._trainer = None
        self.scored_results: list = []
        self.engine_process: Any = None

    def engine_config(self, max_running: int):
        from everstep_rollout.config import EngineConfig

        return EngineConfig(max_running=max_running, max_queued=max(4096, self.size.num_prompts),
                            max_seq_len=self.size.max_position_embeddings, dtype=self.dtype, device=self.device)

    def engine(self):
        if self._engine is None:
            from everstep_rollout.engine import Engine

            self._engine = Engine(self.model_dir, self.engine_config(self.size.max_running))
        return self._engine

    def trainer(self, *, fresh: bool = False):
        """The PolicyTrainer (bf16 autocast on CUDA); `fresh` reloads it from the model directory."""
        if self._trainer is None or fresh:
            from everstep.settings.training import TrainerConfig
            from everstep_trainer.step.trainer import PolicyTrainer

            self._trainer = None
            self._empty_cache()
            self._trainer = PolicyTrainer(self.model_dir, TrainerConfig(learning_rate=2e-5, dtype="bfloat16"),
                                          device=self.device)
        return self._trainer

    def _synchronize(self) -> None:
        import torch

        if self.device.startswith("cuda"):
            torch.cuda.synchronize()

    def _empty_cache(self) -> None:
        import torch

        if self.device.startswith("cuda"):
            torch.cuda.empty_cache()

    def _sampling(self, max_new_tokens: int):
        from everstep_rollout.sequence import SamplingOptions

        return SamplingOptions(temperature=1.0, max_new_tokens=max_new_tokens)

    # -- parts ------------------------------------------------------------------------------------------

    def part_model(self) -> dict:
        start = time.perf_counter()
        num_parameters = make_model_dir(self.model_dir, self.size)
        return {"num_parameters": num_parameters, "seconds": round(time.perf_counter() - start, 2),
                "hidden_size": self.size.hidden_size, "num_layers": self.size.num_layers,
                "vocab_size": json.loads((self.model_dir / "config.json").read_text())["vocab_size"]}

    def part_throughput(self) -> dict:
        import torch

        from everstep_rollout.sequence import GenerationRequest
        from everstep_tools.demo.task import generate_problems

        size, engine = self.size, self.engine()
        problems = generate_problems(size.num_prompts, seed=1, distinct=False)
        lengths = long_tailed_lengths(size.num_prompts, median=size.median_new_tokens, cap=size.max_new_tokens,
                                      seed=2)
        prompts = [engine.tokenizer(p.prompt).input_ids for p in problems]
        eos_token_ids, engine.eos_token_ids = engine.eos_token_ids, frozenset()  # no ignore-EOS option
        try:
            warmup = [GenerationRequest(id=f"warmup-{i}", prompt_ids=prompts[i], sampling=self._sampling(4))
                      for i in range(min(8, len(prompts)))]
            run_engine(engine, warmup, until=self.deadline.part(0.05))
            if self.device.startswith("cuda"):
                torch.cuda.reset_peak_memory_stats()
            requests = [GenerationRequest(id=f"bench-{i}", prompt_ids=ids, sampling=self._sampling(n))
                        for i, (ids, n) in enumerate(zip(prompts, lengths, strict=True))]
            run = run_engine(engine, requests, until=self.deadline.part(0.3))
        finally:
            engine.eos_token_ids = eos_token_ids
        num_tokens = sum(len(r.output_ids) for r in run.results)
        by_id = sorted((r for r in run.results if r.output_ids), key=lambda r: int(r.id.split("-")[1]))
        self.scored_results = by_id[: size.num_scored_samples]
        report = {
            "tokens_per_s": round(num_tokens / run.seconds, 1),
            "decode_tokens_per_s": round(num_tokens / max(run.decode_seconds, 1e-9), 1),
            "num_tokens": num_tokens, "num_prompts": len(requests), "seconds": round(run.seconds, 2),
            "num_steps": run.num_steps, "mean_running": round(run.mean_running, 1), "max_running": size.max_running,
            "dtype": self.dtype, "ignore_eos": True, "truncated": run.truncated,
            "finish_reasons": dict(Counter(r.finish_reason.name for r in run.results)),
            "max_new_tokens": {"median": int(statistics.median(lengths)), "mean": round(statistics.fmean(lengths), 1),
                               "max": max(lengths), "sum": sum(lengths)},
            "prompt_tokens_mean": round(statistics.fmean(len(p) for p in prompts), 1),
        }
        if self.device.startswith("cuda"):
            report["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        return report

    def _scored_samples(self, advantages: Sequence[float] | None = None) -> list:
        if not self.scored_results:
            raise RuntimeError("no engine samples: the throughput part produced none")
        if advantages is None:
            advantages = [1.0 if i % 2 == 0 else -1.0 for i in range(len(self.scored_results))]
        return to_samples(self.scored_results, advantages)

    def part_mismatch(self) -> dict:
        from everstep_trainer.batch.samples import pad_samples
        from everstep_trainer.step.losses import mismatch_diagnostics

        trainer = self.trainer()
        if trainer.version != 0:
            raise RuntimeError("the trainer has trained already: its weights are not the engine's")
        batch = pad_samples(self._scored_samples(), pad_token_id=trainer.pad_token_id, device=trainer.device)
        report: dict[str, Any] = {"engine_dtype": self.dtype, "num_tokens": int(batch.output_mask.sum())}
        for label, autocast in (("trainer_float32", False), ("trainer_bf16_autocast", True)):
            if autocast and not self.device.startswith("cuda"):
                continue  # autocast is CUDA-only in the trainer
            d = mismatch_diagnostics(trainer_logp(trainer, batch, autocast_bf16=autocast), batch.rollout_logp,
                                     batch.output_mask, alpha=trainer.config.alpha, beta=trainer.config.beta)
            if not autocast:
                report.update(mismatch_kl=d.mismatch_kl, logp_diff_max=d.logp_diff_max,
                              logp_diff_abs_mean=d.logp_diff_abs_mean, masked_fraction=d.masked_fraction)
            else:
                report[label] = asdict(d)
        return report

    def part_train_step(self) -> dict:
        from everstep_trainer.batch.samples import pad_samples
        from everstep_trainer.step.losses import policy_loss

        trainer = self.trainer()
        samples = self._scored_samples()
        cfg = trainer.config
        batch = pad_samples(samples, pad_token_id=trainer.pad_token_id, device=trainer.device)
        logp = trainer_logp(trainer, batch, autocast_bf16=True)
        loss, loss_stats = policy_loss(logp, logp, batch.rollout_logp, batch.advantages, batch.output_mask,
                                       correction=cfg.correction, alpha=cfg.alpha, beta=cfg.beta,
                                       tis_cap=cfg.tis_cap, clip_low=cfg.clip_low, clip_high=cfg.clip_high,
                                       aggregation=cfg.aggregation)
        self._synchronize()  # the timing below is the step's alone
        start = time.perf_counter()
        version, stats = trainer.train_step(samples)
        self._synchronize()
        seconds = time.perf_counter() - start
        return {"seconds": round(seconds, 3), "loss": stats.loss, "policy_loss": float(loss),
                "loss_difference": abs(stats.loss - float(loss)), "grad_norm": stats.grad_norm,
                "num_tokens": stats.num_tokens, "num_samples": len(samples), "version": version,
                "tokens_per_s": round(stats.num_tokens / seconds, 1), "compute_dtype": cfg.dtype,
                "autocast": self.device.startswith("cuda"), "masked_fraction": loss_stats.masked_fraction,
                "forward_backward_seconds": round(stats.forward_backward_seconds, 3),
                "optimizer_seconds": round(stats.optimizer_seconds, 3)}

    def part_weight_push(self) -> dict:
        import torch
        import torch.multiprocessing as mp

        trainer = self.trainer()
        on_cuda = self.device.startswith("cuda")
        if on_cuda:
            from everstep.tensors import cuda_ipc
        context = mp.get_context("spawn")
        requests, replies = context.Queue(), context.Queue()
        until = self.deadline.part(0.25)
        start = time.perf_counter()
        self.engine_process = context.Process(
            target=_engine_process, daemon=True,
            args=(str(self.model_dir), self.engine_config(max_running=2), self.num_threads, requests, replies))
        self.engine_process.start()
        try:
            loaded = self._reply(replies, "ready", until)
            startup_seconds = time.perf_counter() - start
            pushes = []
            for attempt in range(1 + _PUSH_WARM_REPEATS):
                held = {name: t.detach() for name, t in trainer.named_weights()}
                self._synchronize()
                start = time.perf_counter()
                named: Any = held
                if on_cuda:  # everstep's transport: handles encoded for this one receiver, sent as plain data
                    named = [cuda_ipc.encode(name, t) for name, t in held.items()]
                requests.put(("push", trainer.version + attempt, named))
                reply = self._reply(replies, "pushed", until)
                seconds = time.perf_counter() - start
                pushes.append((seconds, reply, self._reply(replies, "checksums", until)))
                del named, held
                if on_cuda:
                    torch.cuda.ipc_collect()
            requests.put(("stop",))
            self.engine_process.join(timeout=max(1.0, until - time.monotonic()))
        finally:
            self._reap_engine_process()
        first_seconds, first, received = pushes[0]
        warm_seconds = statistics.median(p[0] for p in pushes[1:])
        sent = weight_checksums({n: t for n, t in trainer.named_weights() if n in received}, getattr(torch, self.dtype))
        mismatched = sorted({n for _, _, checksums in pushes for n in sent
                             if not math.isclose(sent[n], checksums[n], rel_tol=1e-9, abs_tol=1e-9)})
        num_bytes = first["num_bytes"]
        return {
            "transport": "everstep_cuda_ipc" if on_cuda else "cpu_shared_memory",
            "reshare": first.get("reshare"),
            "verified": not mismatched and len(sent) == len(received) > 0,
            "mismatched_tensors": mismatched[:5], "num_tensors": len(sent),
            "changed_tensors": sum(loaded[n] != received[n] for n in received),
            "num_bytes": num_bytes, "seconds": round(warm_seconds, 4),
            "gb_per_s": round(num_bytes / warm_seconds / 1e9, 2),
            "first_push_seconds": round(first_seconds, 4),
            "first_push_gb_per_s": round(num_bytes / first_seconds / 1e9, 2),
            "receiver_copy_seconds": round(statistics.median(p[1]["copy_seconds"] for p in pushes[1:]), 4),
            "num_pushes": len(pushes), "engine_process_start_seconds": round(startup_seconds, 2),
            "sent_dtype": str(next(iter(trainer.model.parameters())).dtype).removeprefix("torch."),
        }

    def part_broadcast(self) -> dict:
        """The weight-broadcast group across hosts (the trainer's `nccl`/`gloo` push): this process as rank 0 and a
        second one as the engine's rank 1, formed with `everstep.tensors.process_group` (the keys sglang uses),
        every trained tensor broadcast, checksums compared. NCCL on CUDA needs two GPUs (one device per rank);
        with one it is reported as skipped, with the reason. On CPU the same path runs over gloo."""
        import datetime

        import torch
        import torch.distributed as dist
        import torch.multiprocessing as mp

        from everstep.tensors import process_group

        on_cuda = self.device.startswith("cuda")
        backend = "nccl" if on_cuda else "gloo"
        if on_cuda and torch.cuda.device_count() < 2:
            return {"backend": backend, "skipped": f"NCCL puts each rank on its own GPU; this machine has "
                                                   f"{torch.cuda.device_count()}"}
        sender_device, receiver_device = ("cuda:0", "cuda:1") if on_cuda else ("cpu", "cpu")
        held = {name: t.detach().to(sender_device) for name, t in self.trainer().named_weights()}
        layout = [(name, list(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in held.items()]
        timeout = datetime.timedelta(seconds=max(10.0, self.deadline.part(0.1)))
        store = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=timeout, wait_for_workers=False)
        context = mp.get_context("spawn")
        replies = context.Queue()
        receiver = context.Process(target=_broadcast_receiver, daemon=True,
                                   args=(backend, receiver_device, store.port, layout, replies))
        receiver.start()
        try:
            group = process_group.new_group(backend, store, group_name="gpu-check-broadcast", rank=0, world_size=2,
                                            timeout=timeout)
            process_group.warm_up(group, device=torch.device(sender_device), timeout=timeout)
            start = time.perf_counter()
            for tensor in held.values():
                group.broadcast(tensor.contiguous(), 0).wait()
            self._synchronize()
            seconds = time.perf_counter() - start
            kind, payload = replies.get(timeout=timeout.total_seconds())
            process_group.shutdown_group(group)
        finally:
            receiver.join(timeout=30)
            if receiver.is_alive():
                receiver.kill()
        if kind != "checksums":
            raise RuntimeError(f"the receiving rank failed: {payload[-2000:]}")
        sent = weight_checksums(held, getattr(torch, layout[0][2]))
        mismatched = sorted(n for n in sent if not math.isclose(sent[n], payload[n], rel_tol=1e-9, abs_tol=1e-9))
        num_bytes = sum(t.numel() * t.element_size() for t in held.values())
        return {"backend": backend, "verified": not mismatched and len(payload) == len(sent) > 0,
                "mismatched_tensors": mismatched[:5], "num_tensors": len(sent), "num_bytes": num_bytes,
                "seconds": round(seconds, 4), "gb_per_s": round(num_bytes / seconds / 1e9, 3)}

    def part_lora_push(self) -> dict:
        import torch
        import torch.multiprocessing as mp

        from everstep_rollout.weights.lora import read_base_weights

        on_cuda = self.device.startswith("cuda")
        if on_cuda:
            from everstep.tensors import cuda_ipc
        from safetensors import safe_open

        names, full_bytes = set(), 0
        for path in sorted(self.model_dir.glob("*.safetensors")):
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - a safetensors file, not a dict
                    shape = f.get_slice(name).get_shape()
                    full_bytes += 4 * math.prod(shape)  # the trainer's float32, as the full push sends
                    if name.startswith("model.layers.") and name.endswith("_proj.weight"):
                        names.add(name)
        base = {n: t.to(self.device, torch.float32) for n, t in read_base_weights(self.model_dir, names).items()}
        context = mp.get_context("spawn")
        requests, replies = context.Queue(), context.Queue()
        until = self.deadline.part(0.2)
        self.engine_process = context.Process(
            target=_engine_process, daemon=True,
            args=(str(self.model_dir), self.engine_config(max_running=2), self.num_threads, requests, replies))
        self.engine_process.start()
        dtype = getattr(torch, self.dtype)
        pushes, mismatched = [], set()
        try:
            self._reply(replies, "ready", until)
            for version in range(1, _LORA_PUSHES + 1):
                generator = torch.Generator(device=self.device).manual_seed(version)
                held, expected = {}, {}
                for name, weight in base.items():
                    module = name.removesuffix(".weight")
                    a = 0.02 * torch.randn(_LORA_RANK, weight.shape[1], generator=generator, device=self.device)
                    b = 0.02 * torch.randn(weight.shape[0], _LORA_RANK, generator=generator, device=self.device)
                    held[f"{module}.lora_A"], held[f"{module}.lora_B"] = a, b
                    expected[name] = torch.addmm(weight, b, a, alpha=_LORA_ALPHA / _LORA_RANK)
                self._synchronize()
                start = time.perf_counter()
                named: Any = [cuda_ipc.encode(n, t) for n, t in held.items()] if on_cuda else held
                requests.put(("push", version, named, (_LORA_RANK, _LORA_ALPHA)))
                reply = self._reply(replies, "pushed", until)
                seconds = time.perf_counter() - start
                received = self._reply(replies, "checksums", until)
                sent = weight_checksums(expected, dtype)
                mismatched |= {n for n in sent if not math.isclose(sent[n], received.get(n, math.nan), rel_tol=1e-4,
                                                                   abs_tol=1e-6)}
                pushes.append((seconds, reply))
                del named, held
                if on_cuda:
                    torch.cuda.ipc_collect()
            requests.put(("stop",))
            self.engine_process.join(timeout=max(1.0, until - time.monotonic()))
        finally:
            self._reap_engine_process()
        warm_seconds = statistics.median(p[0] for p in pushes[1:])
        adapter_bytes = pushes[0][1]["num_bytes"]
        return {
            "transport": "everstep_cuda_ipc" if on_cuda else "cpu_shared_memory",
            "verified": not mismatched and len(pushes) == _LORA_PUSHES, "mismatched_tensors": sorted(mismatched)[:5],
            "rank": _LORA_RANK, "alpha": _LORA_ALPHA, "num_adapted_modules": len(base), "num_pushes": len(pushes),
            "adapter_bytes": adapter_bytes, "full_bytes": full_bytes, "adapter_seconds": round(warm_seconds, 4),
            "first_push_seconds": round(pushes[0][0], 4),
            "receiver_merge_and_copy_seconds": round(statistics.median(p[1]["copy_seconds"] for p in pushes[1:]), 4),
        }

    def part_sglang_tools(self) -> dict:
        from benchmarks.gpu_check_sglang_tools import run_sglang_tool_check

        return run_sglang_tool_check(self.model_dir.parent, device=self.device,
                                     num_tool_requests=self.size.tool_requests, hidden=self.size.tool_hidden_size,
                                     until=self.deadline.part(0.6))

    def _reap_engine_process(self) -> None:
        """Terminates the push parts' engine process if it is still running (it was asked to stop), and forgets it."""
        if self.engine_process.is_alive():
            self.engine_process.terminate()
            self.engine_process.join(timeout=10)
        self.engine_process = None

    def _reply(self, replies: Any, expected: str, until: float) -> Any:
        while True:
            timeout = until - time.monotonic()
            if timeout <= 0:
                raise TimeoutError(f"engine process: no '{expected}' reply before the part's deadline")
            try:
                kind, payload = replies.get(timeout=min(timeout, 1.0))
            except queue.Empty:
                if not self.engine_process.is_alive():
                    raise RuntimeError(f"engine process exited ({self.engine_process.exitcode})") from None
                continue
            if kind == "error":
                raise RuntimeError(f"engine process failed:\n{payload}")
            if kind != expected:
                raise RuntimeError(f"engine process: expected '{expected}', got '{kind}'")
            return payload

    def part_rl(self) -> dict:
        from everstep_rollout.sequence import GenerationRequest
        from everstep_tools.demo.evaluation import is_correct
        from everstep_tools.demo.task import TaskConfig, generate_problems, solution_text

        size = self.size
        task = TaskConfig(max_ops=size.rl_max_ops)
        max_new_tokens = 6 * task.max_ops + 8
        trainer, engine = self.trainer(fresh=True), self.engine()
        examples = [(p.prompt, solution_text(p)) for p in generate_problems(4096, seed=10, config=task, distinct=False)]
        warm = warm_start(trainer.model, engine.tokenizer, examples, steps=size.warm_start_steps,
                          batch_size=size.warm_start_batch, learning_rate=size.warm_start_learning_rate,
                          device=trainer.device, autocast_bf16=self.device.startswith("cuda"),
                          until=self.deadline.part(0.12))
        engine.update_weights(dict(trainer.named_weights()), trainer.version)
        until = self.deadline.part(0.3)
        steps = []
        for step in range(size.rl_steps):
            if time.monotonic() >= until:
                break
            problems = generate_problems(size.rl_prompts, seed=100 + step, config=task)
            requests = [GenerationRequest(id=f"rl{step}-{i}-{g}", prompt_ids=engine.tokenizer(p.prompt).input_ids,
                                          sampling=self._sampling(max_new_tokens))
                        for i, p in enumerate(problems) for g in range(size.rl_group_size)]
            answers = {f"rl{step}-{i}-{g}": str(p.answer) for i, p in enumerate(problems)
                       for g in range(size.rl_group_size)}
            run = run_engine(engine, requests, until=until)
            order = {r.id: k for k, r in enumerate(requests)}
            results = sorted(run.results, key=lambda r: order[r.id])
            rewards = [1.0 if is_correct(r.output_text, answers[r.id]) else 0.0 for r in results]
            advantages = grpo_advantages(rewards, size.rl_group_size)
            start = time.perf_counter()
            version, stats = trainer.train_step(to_samples(results, advantages))
            self._synchronize()
            train_seconds = time.perf_counter() - start
            start = time.perf_counter()
            engine.update_weights(dict(trainer.named_weights()), version)
            self._synchronize()
            push_seconds = time.perf_counter() - start
            groups = [rewards[k:k + size.rl_group_size] for k in range(0, len(rewards), size.rl_group_size)]
            steps.append({
                "step": step, "version": version, "reward_mean": statistics.fmean(rewards),
                "mixed_groups": sum(0 < sum(g) < len(g) for g in groups), "num_groups": len(groups),
                "loss": stats.loss, "grad_norm": stats.grad_norm, "mismatch_kl": stats.mismatch_kl,
                "masked_fraction": stats.masked_fraction, "truncated": run.truncated,
                "mean_output_tokens": round(statistics.fmean(len(r.output_ids) for r in results), 1),
                "generate_seconds": round(run.seconds, 2), "train_seconds": round(train_seconds, 2),
                "update_weights_seconds": round(push_seconds, 4)})
        if not steps:
            raise TimeoutError("no RL step fitted in the time budget")
        return {"warm_start": warm, "steps": steps, "reward_per_step": [s["reward_mean"] for s in steps],
                "group_size": size.rl_group_size, "prompts_per_step": size.rl_prompts, "max_ops": task.max_ops}


PARTS: tuple[str, ...] = ("model", "throughput", "mismatch", "train_step", "weight_push", "broadcast", "lora_push",
                          "rl")
OPTIONAL_PARTS: tuple[str, ...] = ("sglang_tools",)
"""Run only when named in --parts."""


def run_parts(check: GpuCheck, report: dict, parts: Sequence[str] = PARTS,
              after_part: Callable[[], None] = lambda: None) -> None:
    """Run each part into report["parts"][name]; an exception becomes that part's "error". `after_part` runs
    after each (it saves the report so far)."""
    for name in parts:
        part: Callable[[], dict] = getattr(check, f"part_{name}")
        if check.deadline.remaining() <= 0:
            report["parts"][name] = {"ok": False, "error": "skipped: the time budget is spent"}
            after_part()
            continue
        log.info("part %s: starting (%.0f s left)", name, check.deadline.remaining())
        start = time.perf_counter()
        try:
            result = {"ok": True, **part()}
        except Exception as e:
            log.exception("part %s failed", name)
            result = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        result["part_seconds"] = round(time.perf_counter() - start, 2)
        report["parts"][name] = result
        log.info("part %s: %s", name, json.dumps(result, default=str)[:400])
        after_part()


def transformers_floor_error(version: str) -> str | None:
    """Why this transformers cannot run the check (below TRANSFORMERS_FLOOR), or None."""
    parts = []
    for piece in version.split(".")[:2]:
        digits = "".join(c for c in piece if c.isdigit()) if piece else ""
        parts.append(int(digits) if digits else 0)
    if tuple(parts) >= TRANSFORMERS_FLOOR:
        return None
    floor = ".".join(map(str, TRANSFORMERS_FLOOR))
    return (f"transformers {version} is older than {floor}: its from_pretrained passes dtype= on to the model "
            f"constructor (TypeError); install transformers>={floor}")


def save_report(out: Path | None, line: str) -> None:
    """Write OUT/gpu_check.json (whole or not at all: a temporary file renamed over it)."""
    if out is None:
        return
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "gpu_check.json.tmp"
    tmp.write_text(json.dumps(json.loads(line), indent=2) + "\n")
    tmp.replace(out / "gpu_check.json")


def _finish(report: dict, started: float) -> str:
    report["total_seconds"] = round(time.monotonic() - started, 1)
    report["ok"] = bool(report["parts"]) and all(p.get("ok") for p in report["parts"].values()) \
        and "error" not in report
    return json.dumps(report, default=str)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks.gpu_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--size", choices=tuple(SIZES), default="100m")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="engine dtype")
    parser.add_argument("--watchdog-seconds", type=float, default=0.0,
                        help=f"when the watchdog stops the run; 0: {_WATCHDOG_GRACE_SECONDS:.0f} s after the budget")
    parser.add_argument("--out", type=Path, default=None,
                        help="also write the report to OUT/gpu_check.json, rewritten after every part (the model "
                             "lives in a temporary directory)")
    parser.add_argument("--time-budget-seconds", type=float, default=_DEFAULT_TIME_BUDGET_SECONDS,
                        help=f"parts and loops stop at this budget; the watchdog exits {_WATCHDOG_GRACE_SECONDS:.0f} s "
                             f"after it")
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"comma-separated parts to run, in order (default: every part but the optional "
                             f"{', '.join(OPTIONAL_PARTS)})")
    args = parser.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    unknown = [p for p in parts if p not in (*PARTS, *OPTIONAL_PARTS)]
    if unknown:
        parser.error(f"--parts: unknown part(s) {unknown}; the parts are {', '.join((*PARTS, *OPTIONAL_PARTS))}")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    started = time.monotonic()
    import torch
    import transformers

    report: dict[str, Any] = {"device": args.device, "size": args.size, "torch": torch.__version__,
                              "transformers": transformers.__version__,
                              "time_budget_seconds": args.time_budget_seconds, "parts": {}}
    refusal = transformers_floor_error(transformers.__version__)
    if refusal is None and args.device == "cuda" and not torch.cuda.is_available():
        refusal = "--device cuda, but torch.cuda.is_available() is False"
    if refusal is not None:
        log.error("cannot run the check: %s", refusal)
        report["error"] = refusal
        line = _finish(report, started)
        save_report(args.out, line)
        print(line, flush=True)
        return 2
    if args.device == "cuda":
        report["gpu"] = torch.cuda.get_device_name(0)

    printed = threading.Lock()

    def save_so_far() -> None:
        with printed:
            try:
                save_report(args.out, json.dumps(report, default=str))
            except (OSError, RuntimeError) as e:  # RuntimeError: the report changed while it was written
                log.warning("could not save the report so far: %s", e)

    save_so_far()
    check: GpuCheck | None = None

    def watchdog() -> None:
        with printed:
            report["error"] = "watchdog: the run overran its time budget; parts not listed did not finish"
            if check is not None and check.engine_process is not None:
                check.engine_process.terminate()
            try:
                line = _finish(report, started)
            except RuntimeError:  # the main thread changed the report while it was being written
                line = _finish(report, started)
            try:
                save_report(args.out, line)
            finally:
                print(line, flush=True)
                os._exit(3)

    timer = threading.Timer(args.watchdog_seconds or args.time_budget_seconds + _WATCHDOG_GRACE_SECONDS, watchdog)
    timer.daemon = True
    timer.start()
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        check = GpuCheck(device=args.device, size=SIZES[args.size], dtype=args.dtype, work_dir=Path(tmp),
                         deadline=Deadline(args.time_budget_seconds))
        run_parts(check, report, parts, after_part=save_so_far)
    with printed:
        timer.cancel()
        line = _finish(report, started)
        save_report(args.out, line)
        print(line, flush=True)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
