"""The executor for any causal LM transformers loads: its own modeling code over our per-slot KV storage.

The model runs as `AutoModelForCausalLM` (SDPA attention where the model supports it, else eager). Its
cache is a `transformers.Cache` whose layers are ours (`_SlotLayer`): each layer's keys and values live in
a tensor `[slots, kv_heads, max_seq_len, head_dim]` allocated at load time, so that sequences join and
leave the batch at any step like with the native executor.

- Prefill (right-padded rows, positions 0..T-1, a causal 4-D mask): the layer writes the fresh keys and
  values into the rows' slots and attention uses the fresh ones.
- Decode (one token per row; row i is slot i): the layer writes the token's key and value at the row's
  position and hands attention the slots' first L positions; a 4-D additive mask keeps each row to its own
  positions 0..position. transformers passes a 4-D mask through unchanged.

Prefill and decode are separate forward passes (prefill first), so a row's padded prefill positions are
overwritten by its decode token before anything reads them.

Not supported (a clear error at load): sliding-window attention shorter than max_seq_len, and models
whose cache is not plain attention keys and values (recurrent/state-space layers). Built against the
transformers 5 cache API (`Cache(layers=...)`, `DynamicLayer`).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping
from pathlib import Path

import torch

from everstep_rollout.config import resolve_max_seq_len
from everstep_rollout.executor import rebind
from everstep_rollout.executor.interface import ExecutorOptions, ForwardBatch
from everstep_rollout.executor.tensors import long_tensor

log = logging.getLogger(__name__)


class TransformersWeights:
    """The model's state dict by name (tied weights under each of their names), copied into in place."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._model = model
        self.named: dict[str, torch.Tensor] = dict(model.state_dict(keep_vars=True))
        self._adopted: set[int] = set()
        """ids of the parameters that are views into memory a push brought (`adopt`)."""
        self._rebind_layout: rebind.StoreLayout | None = None

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self._model.parameters())

    @property
    def num_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self._model.parameters())

    def copy_in(self, tensors: Mapping[str, torch.Tensor], *, require_all: bool) -> int:
        self._check(tensors, require_all=require_all)
        self.own_memory()
        return self._copy(tensors)

    def adopt(self, tensors: Mapping[str, torch.Tensor]) -> int:
        """As the native executor's: the parameters whose pushed tensors can be used as they are run on them (no
        copy), the others are copied in; returns the bytes copied."""
        self._check(tensors, require_all=False)
        self._adopted, kept, reason = rebind.adopt(self._layout(), tensors, self._adopted)
        if reason is not None:
            log.info("weights copied, not kept in the pushed memory: %s", reason)
        return self._copy({name: t for name, t in tensors.items() if name not in kept})

    @property
    def kept_in_place(self) -> bool:
        return bool(self._adopted)

    def own_memory(self) -> None:
        if self._adopted:
            rebind.apply(rebind.private_plan(self._layout(), self._adopted))
        self._adopted = set()

    def _layout(self) -> rebind.StoreLayout:
        """Which names lie in which parameter (worked out on the first push that needs it, then kept)."""
        held = self._held()
        if self._rebind_layout is None or not self._rebind_layout.matches(held, self.named):
            self._rebind_layout = rebind.StoreLayout(held, self.named)
        return self._rebind_layout

    def _held(self) -> list[torch.Tensor]:
        return list({id(t): t for t in self.named.values()}.values())

    def _check(self, tensors: Mapping[str, torch.Tensor], *, require_all: bool) -> None:
        unknown = sorted(set(tensors) - set(self.named))
        if unknown:
            raise ValueError(f"unknown parameter names: {unknown[:5]}{' ...' if len(unknown) > 5 else ''}")
        for name, t in tensors.items():
            if tuple(t.shape) != tuple(self.named[name].shape):
                raise ValueError(f"{name}: shape {tuple(t.shape)} != expected {tuple(self.named[name].shape)}")
        if require_all:
            given = {id(self.named[name]) for name in tensors}  # a tied weight is given by either name
            missing = sorted(name for name, t in self.named.items() if id(t) not in given)
            if missing:
                raise ValueError(f"missing parameters: {missing[:5]}{' ...' if len(missing) > 5 else ''}")

    def _copy(self, tensors: Mapping[str, torch.Tensor]) -> int:
        num_bytes = 0
        with torch.no_grad():
            for name, t in tensors.items():
                self.named[name].copy_(t)
                num_bytes += t.numel() * t.element_size()
        return num_bytes


class _SlotStore:
    """Per-layer keys and values storage, allocated from the first keys each layer sees."""

    def __init__(self, num_slots: int, max_seq_len: int) -> None:
        self.num_slots, self.max_seq_len = num_slots, max_seq_len
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}

    def storage(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if layer not in self.keys:
            def empty(like: torch.Tensor) -> torch.Tensor:
                return like.new_zeros(self.num_slots, like.shape[1], self.max_seq_len, like.shape[3])

            self.keys[layer], self.values[layer] = empty(keys), empty(values)
        return self.keys[layer], self.values[layer]

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys.values(), *self.values.values()))


def _slot_layer_class():
    from transformers.cache_utils import DynamicLayer

    class _SlotLayer(DynamicLayer):
        """One layer of one forward pass: writes into `_SlotStore` and returns what attention should read."""

        def __init__(self, store: _SlotStore, layer: int, plan: dict) -> None:
            super().__init__()
            self.store, self.layer, self.plan = store, layer, plan
            self.is_initialized = True

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
            keys, values = self.store.storage(self.layer, key_states, value_states)
            plan = self.plan
            if plan["mode"] == "prefill":  # [P, heads, T, dim] into slots at positions 0..T-1
                length = key_states.shape[2]
                keys[plan["slots"], :, :length] = key_states
                values[plan["slots"], :, :length] = value_states
                return key_states, value_states
            rows, positions, context = plan["rows"], plan["positions"], plan["context"]
            keys[rows, :, positions] = key_states[:, :, 0]
            values[rows, :, positions] = value_states[:, :, 0]
            num_rows = key_states.shape[0]
            return keys[:num_rows, :, :context], values[:num_rows, :, :context]

        def get_seq_length(self) -> int:
            return self.plan["context"] - 1 if self.plan["mode"] == "decode" else 0

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return (self.plan["context"] if self.plan["mode"] == "decode" else query_length), 0

    return _SlotLayer


class TransformersExecutor:
    """`Executor` over `AutoModelForCausalLM`; see the module docstring."""

    name = "transformers"

    def __init__(self, model, options: ExecutorOptions, max_seq_len: int) -> None:
        from transformers.cache_utils import Cache

        self.model = model
        text_config = model.config.get_text_config()
        self.model_type = model.config.model_type
        self.expert_routing = None
        self.routing_shape = None  # transformers' modeling code does not hand out its routers' choices
        self.vocab_size = int(text_config.vocab_size)
        self.max_seq_len = max_seq_len
        self.weights = TransformersWeights(model)
        self._device = options.device
        self._dtype = next(model.parameters()).dtype
        self._num_layers = int(text_config.num_hidden_layers)
        self._store = _SlotStore(options.num_slots, max_seq_len)
        self._cache_class = Cache
        self._layer_class = _slot_layer_class()
        self._base_model = model.base_model  # prefill needs no logits
        # transformers 5 renames the forward argument past_key_values to cache.
        self._cache_kwarg, self._base_cache_kwarg = (
            "cache" if "cache" in inspect.signature(m.forward).parameters else "past_key_values"
            for m in (model, self._base_model)
        )

    @classmethod
    def load(cls, model_dir: Path, options: ExecutorOptions) -> TransformersExecutor:
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(model_dir)
        text_config = config.get_text_config()
        max_seq_len = resolve_max_seq_len(options.max_seq_len, getattr(text_config, "max_position_embeddings", None))
        window = getattr(text_config, "sliding_window", None)
        uses_window = window is not None and (getattr(text_config, "use_sliding_window", True) or "sliding_attention"
                                              in (getattr(text_config, "layer_types", None) or []))
        if uses_window and window < max_seq_len:
            raise NotImplementedError(
                f"sliding-window attention (config sliding_window={window}) is not supported by the transformers "
                f"executor; use max_seq_len <= {window}"
            )
        try:
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=options.dtype, attn_implementation="sdpa")
        except ValueError:  # the model has no SDPA attention
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=options.dtype, attn_implementation="eager")
        model = model.to(options.device).eval().requires_grad_(False)
        executor = cls(model, options, max_seq_len)
        try:  # allocates every layer's storage now, and checks that the model runs over our cache
            with torch.inference_mode():
                executor.forward(ForwardBatch(decode_tokens=[0], decode_positions=[0]))
        except Exception as e:
            raise NotImplementedError(
                f"model_type {executor.model_type!r} does not run with the transformers executor's KV cache "
                f"(attention keys and values per layer): {type(e).__name__}: {e}"
            ) from e
        return executor

    @property
    def cache_bytes(self) -> int:
        return self._store.num_bytes

    def move_slot(self, src: int, dst: int, length: int) -> None:
        for storage in (*self._store.keys.values(), *self._store.values.values()):
            storage[dst, :, :length] = storage[src, :, :length]

    def _cache(self, plan: dict):
        return self._cache_class(layers=[self._layer_class(self._store, li, plan) for li in range(self._num_layers)])

    def forward(self, batch: ForwardBatch) -> torch.Tensor | None:
        if batch.prefill_rows:
            self._prefill(batch.prefill_rows, batch.prefill_slots)
            if batch.prefill_copies:  # shared prompts: the row's keys and values into its copies' slots
                for row, slot, extra in zip(batch.prefill_rows, batch.prefill_slots, batch.prefill_copies, strict=True):
                    for copy in extra:
                        self.move_slot(slot, copy, len(row))
        if not batch.decode_tokens:
            return None
        device = self._device
        num_rows = len(batch.decode_tokens)
        positions = long_tensor(batch.decode_positions, device)
        context = max(batch.decode_positions) + 1
        allowed = torch.arange(context, device=device)[None, :] <= positions[:, None]
        mask = torch.zeros(num_rows, 1, 1, context, dtype=self._dtype, device=device)
        mask.masked_fill_(~allowed[:, None, None, :], torch.finfo(self._dtype).min)
        plan = {"mode": "decode", "rows": torch.arange(num_rows, device=device), "positions": positions,
                "context": context}
        out = self.model(
            input_ids=long_tensor(batch.decode_tokens, device)[:, None], position_ids=positions[:, None],
            attention_mask=mask, use_cache=True, **{self._cache_kwarg: self._cache(plan)},
        )
        return out.logits[:, -1].float()

    def _prefill(self, rows: list[list[int]], slots: list[int]) -> None:
        device = self._device
        length = max(map(len, rows))
        flat: list[int] = []
        for row in rows:
            flat += row
            flat += [0] * (length - len(row))
        tokens = long_tensor(flat, device).view(len(rows), length)
        positions = torch.arange(length, device=device)
        causal = positions[None, :] <= positions[:, None]
        mask = torch.zeros(1, 1, length, length, dtype=self._dtype, device=device)
        mask.masked_fill_(~causal, torch.finfo(self._dtype).min)
        plan = {"mode": "prefill", "slots": long_tensor(slots, device), "context": length}
        self._base_model(
            input_ids=tokens, position_ids=positions[None, :].expand(len(rows), length),
            attention_mask=mask.expand(len(rows), 1, length, length), use_cache=True,
            **{self._base_cache_kwarg: self._cache(plan)},
        )
