"""Engine configuration."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

import torch

from everstep.settings.quantization import Quantization
from everstep.settings.training import Dtype

DEFAULT_MAX_SEQ_LEN = 2048
"""The KV cache length per slot when neither the job nor the server sets max_seq_len (and the model allows it)."""


def resolve_max_seq_len(requested: int | None, position_limit: int | None) -> int:
    """The tokens per slot an engine takes: `requested`, or the default within the model's position limit.

    ValueError naming max_seq_len when `requested` exceeds the limit: a longer sequence would run past the
    positions the model was trained on, and capping it would cut the job's sequences without a word.
    """
    if requested is None:
        return min(DEFAULT_MAX_SEQ_LEN, position_limit or DEFAULT_MAX_SEQ_LEN)
    if position_limit and requested > position_limit:
        raise ValueError(f"max_seq_len ({requested}) exceeds the model's max_position_embeddings ({position_limit})")
    return requested


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Settings of one generation engine (the torch engine; the sglang engine reads the fields it can use)."""

    engine: Literal["torch", "sglang"] = "torch"
    """"torch": our continuous-batching engine (CPU or GPU). "sglang": sglang's offline engine (GPU; needs the
    sglang environment of its own, `make sglang-venv`; see docs/rollout.md)."""
    executor: Literal["auto", "native", "transformers"] = "auto"
    """Torch engine only. "native": our own Llama/Qwen2/Qwen3/Qwen3-MoE forward pass (fastest); "transformers":
    the model's Hugging Face modeling code (any causal LM); "auto": native when the model's config.json is one it
    supports (model_type llama, qwen2, qwen3 or qwen3_moe, default or llama3 RoPE, no sliding window, no shared
    experts), transformers otherwise."""

    max_running: int = 64
    """Sequences decoded together: the number of KV cache slots."""
    max_queued: int = 4096
    """Sequences that may wait for a slot; an `add` that would make more wait is refused (QueueFullError)."""
    max_seq_len: int | None = None
    """Prompt + output tokens a sequence may hold (the KV cache's length per slot). None: the model's
    max_position_embeddings, at most DEFAULT_MAX_SEQ_LEN. A value above the model's position limit is
    refused at load (ValueError), never capped."""
    dtype: Dtype = Dtype.float32
    """Weights, activations and KV cache dtype (sampling is always float32)."""
    quantization: Quantization = Quantization.none
    """Weight-only quantization of the linear layers (native executor only): "int8" (per output channel),
    "int8-tensor" (per tensor), "fp8" (e4m3, per output channel), "int4" (per output channel and group of 32
    inputs); applied at load and to every weight update."""
    device: str = "cpu"
    """torch device: "cpu" or "cuda" (or "cuda:N")."""
    seed: int = 0
    """Seed of the engine's torch.Generator, used by every sequence without its own seed."""
    version: int = 0
    """Policy version of the loaded weights; recorded on every output token until update_weights."""
    prefill_max_tokens: int = 8192
    """Padded tokens (rows x longest row) per prefill batch; bounds prefill activation memory."""
    recompute_kv_on_update: bool = True
    """After update_weights, recompute the KV cache of running sequences with the new weights, so that
    every recorded log-prob is exactly that of the version it is tagged with."""
    share_prompt_prefill: bool = True
    """Torch engine only. Sequences with identical prompt token ids (G samples of one prompt) that are admitted in
    the same step and have no output yet are prefilled once: one copy's prompt keys and values (and routed
    experts) are copied into the others' KV cache slots, then each decodes and samples on its own. Log-probs and
    routes equal those of separate prefills (within float tolerance). Continued (carried-over) sequences and copies
    admitted in different steps are prefilled separately. False: every sequence prefills its own prompt."""
    mem_fraction_static: float = 0.0
    """sglang engine only: the fraction of the GPU's memory sglang takes for weights and KV cache
    (sglang's `mem_fraction_static`); 0: sglang's own default, which takes most of the GPU. Set it when a
    trainer shares the GPU."""
    sandbox_endpoint: str = ""
    """Sandbox gRPC target (HOST:PORT, dns:///HOST:PORT or ipv4:A:P,B:P: round robin over its addresses): where
    the built-in `python` tool runs code (a job's ToolConfig.sandbox_address, when set, wins)."""

    def __post_init__(self) -> None:
        for name in ("max_running", "prefill_max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_seq_len is not None and self.max_seq_len < 2:
            raise ValueError(f"max_seq_len must be >= 2, got {self.max_seq_len}")
        if self.max_queued < 0:
            raise ValueError(f"max_queued must be >= 0, got {self.max_queued}")
        if self.engine not in ("torch", "sglang"):
            raise ValueError(f"engine must be 'torch' or 'sglang', got {self.engine!r}")
        if self.executor not in ("auto", "native", "transformers"):
            raise ValueError(f"executor must be 'auto', 'native' or 'transformers', got {self.executor!r}")
        try:
            object.__setattr__(self, "dtype", Dtype(self.dtype))
        except ValueError:
            raise ValueError(f"dtype must be one of {[d.value for d in Dtype]}, got {self.dtype!r}") from None
        try:
            object.__setattr__(self, "quantization", Quantization(self.quantization))
        except ValueError:
            raise ValueError(f"quantization must be one of {[q.value for q in Quantization]}, "
                             f"got {self.quantization!r}") from None
        if not 0.0 <= self.mem_fraction_static < 1.0:
            raise ValueError(f"mem_fraction_static must be in [0, 1), got {self.mem_fraction_static}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


def default_num_threads() -> int:
    """Intra-op threads for CPU decoding: all cores but one, which is left to the gRPC threads.

    On small machines oversubscription is catastrophic rather than merely slow (OpenMP workers
    spin-wait: a 256x256 multiply went from 0.04 ms to 4 ms with 2 threads on 2 busy cores).
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores - 1)
