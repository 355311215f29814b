"""Weight-only quantization of the native executor's linear layers (int8, int4 or float8 e4m3, with scales).

A `QuantizedMatrix` holds one fused weight [N, K] (q/k/v, o, gate/up, down) as int8, float8_e4m3fn or
packed int4 values with float scales: w[n, k] ~= data[n, k] * scales[n] (int4: scales[n, k // 32]). The Hugging Face
tensors that make up the fused matrix are row ranges of it; each is quantized on its own when it is
copied in (at load and on every weight update), so the engine never keeps a full-precision copy.

Granularity: "int8" and "fp8" take scale[n] = max_k |w[n, k]| / qmax per output row; "int8-tensor" takes
one scale per Hugging Face tensor (max over the whole tensor), stored repeated over its rows; "int4" takes
one scale per output row and group of INT4_GROUP_SIZE (32) consecutive inputs (the usual GPTQ/AWQ-style
g32 layout), values round(w / scale) in [-7, 7], two to a byte.

Compute: int8 uses torch's weight-only int8 kernel `torch._weight_int8pack_mm` for bfloat16 activations
of at most _INT8_KERNEL_MAX_ROWS rows (where it runs on the device), and otherwise dequantizes the weight
to the engine dtype for each matmul. Measured on CPU with torch 2.13 (1 thread): for float32 activations
the kernel is 50-100x slower than dequantize-then-matmul (6.9 ms against 0.1 ms for 128x128 @ 128x384),
for bfloat16 it wins only at a few rows (6 us against 61 us at 1 row, 303 us against 75 us at 128 rows).
So on CPU int8 saves weight memory (4x in float32) and costs time: dequantizing every matmul is slower
than the float matmul alone. int4 is always dequantized per matmul (unpacked, then scaled). fp8 is always
dequantized per matmul (weight-only: `torch._scaled_mm` would also quantize the activations, a different
numerics), so on every device it computes with fp8-rounded weights and saves memory, not time.
Mixture-of-experts layers: the experts of a layer are one `QuantizedMatrix` each for gate/up and down, the
experts' rows stacked ([experts * rows, cols]); every expert's gate, up and down projection is quantized on
its own (per output channel, or per tensor for "int8-tensor"), whether it comes as a per-expert checkpoint
tensor (`RowRange`) or in the fused [experts, rows, cols] tensor of a pushed state dict (`ExpertBlocks`),
so both give the same rounding. An expert's matmul dequantizes only its own rows (`linear_rows`). The
router (`mlp.gate`) stays in full precision, as in vLLM and sglang.
Embeddings, lm_head and norms are not quantized (as in vLLM and sglang by
default): they are a large share of a small model, and quantizing the tied embedding would change the
input side too.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from everstep.settings.quantization import Quantization

__all__ = ["INT4_GROUP_SIZE", "ExpertBlocks", "QuantizedMatrix", "RowRange"]

INT4_GROUP_SIZE = 32
_INT4_MAX = 7.0  # symmetric: -8 is left unused, so that zero is exact and the range is that of +-7
_INT8_MAX = 127.0
_FP8_MAX = 448.0  # largest finite float8_e4m3fn
_MIN_SCALE = 1e-12  # an all-zero row gets this scale, so it dequantizes to exact zeros
_INT8_KERNEL_DTYPES = (torch.bfloat16, torch.float16)  # float32 runs a reference loop, see the module docstring
_INT8_KERNEL_MAX_ROWS = 16


@functools.cache
def _int8_kernel_runs(device_type: str, dtype: torch.dtype) -> bool:
    """Whether `torch._weight_int8pack_mm` runs for activations of `dtype` on this device type."""
    if not hasattr(torch, "_weight_int8pack_mm"):
        return False
    device = torch.device(device_type)
    try:
        torch._weight_int8pack_mm(torch.ones(1, 32, dtype=dtype, device=device),
                                  torch.ones(8, 32, dtype=torch.int8, device=device),
                                  torch.ones(8, dtype=dtype, device=device))
    except (RuntimeError, NotImplementedError):
        return False
    return True


class QuantizedMatrix:
    """A weight [rows, cols] as int8 / float8_e4m3fn values and per-row scales; see the module docstring."""

    def __init__(self, rows: int, cols: int, *, quantization: Quantization, dtype: torch.dtype,
                 device: torch.device) -> None:
        if quantization == Quantization.none:
            raise ValueError("quantization: a QuantizedMatrix needs int8, int8-tensor, int4 or fp8")
        self.quantization = quantization
        self.shape = (rows, cols)
        self.dtype = dtype
        storage = torch.float8_e4m3fn if quantization == Quantization.fp8 else torch.int8
        if quantization == Quantization.int4:  # two values a byte, low nibble first; scales per group of inputs
            self.data = torch.zeros(rows, (cols + 1) // 2, dtype=torch.uint8, device=device)
            self.scales = torch.ones(rows, -(-cols // INT4_GROUP_SIZE), dtype=dtype, device=device)
            self._int8_kernel = False
            return
        self.data = torch.zeros(rows, cols, dtype=storage, device=device)
        # The int8 kernel wants scales in the activation dtype; dequantizing multiplies in it too.
        self.scales = torch.ones(rows, dtype=dtype, device=device)
        self._int8_kernel = (storage == torch.int8 and dtype in _INT8_KERNEL_DTYPES
                             and _int8_kernel_runs(device.type, dtype))

    @property
    def num_bytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scales.numel() * self.scales.element_size()

    def set_rows(self, start: int, weight: torch.Tensor) -> None:
        """Quantize `weight` [n, cols] (any float dtype) into rows start..start+n-1."""
        w = weight.to(device=self.data.device, dtype=torch.float32)
        if self.quantization == Quantization.int4:
            self._set_int4_rows(start, w)
            return
        if self.quantization == Quantization.int8_tensor:
            amax = w.abs().amax().expand(w.shape[0])
        else:
            amax = w.abs().amax(dim=1)
        qmax = _FP8_MAX if self.quantization == Quantization.fp8 else _INT8_MAX
        scales = (amax / qmax).clamp(min=_MIN_SCALE)
        scaled = w / scales[:, None]
        if self.quantization == Quantization.fp8:
            values = scaled.clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn)
        else:
            values = scaled.round().clamp(-_INT8_MAX, _INT8_MAX).to(torch.int8)
        stop = start + w.shape[0]
        self.data[start:stop] = values
        self.scales[start:stop] = scales.to(self.dtype)

    def _set_int4_rows(self, start: int, w: torch.Tensor) -> None:
        rows, cols = w.shape
        groups = self.scales.shape[1]
        padded = F.pad(w, (0, groups * INT4_GROUP_SIZE - cols))  # zeros change no group's max
        grouped = padded.view(rows, groups, INT4_GROUP_SIZE)
        scales = (grouped.abs().amax(dim=2) / _INT4_MAX).clamp(min=_MIN_SCALE)
        values = (grouped / scales[:, :, None]).round().clamp(-_INT4_MAX, _INT4_MAX).view(rows, -1)[:, :cols]
        nibbles = (values + 8).to(torch.uint8)
        if cols % 2:
            nibbles = F.pad(nibbles, (0, 1), value=8)  # a zero in the unused last nibble
        self.data[start:start + rows] = nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)
        self.scales[start:start + rows] = scales.to(self.dtype)

    def dequantized(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """The weight the engine computes with (rows start..stop-1, default all), [rows, cols] in the engine dtype."""
        data, scales = self.data[start:stop], self.scales[start:stop]
        if self.quantization == Quantization.int4:
            rows, cols = data.shape[0], self.shape[1]
            nibbles = torch.stack((data & 0xF, data >> 4), dim=2).view(rows, -1)[:, :cols]
            scales = scales.repeat_interleave(INT4_GROUP_SIZE, dim=1)[:, :cols]
            return (nibbles.to(self.dtype) - 8) * scales
        return data.to(self.dtype) * scales[:, None]

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, cols] -> x @ W^T + bias, [M, rows]."""
        if self._int8_kernel and x.dim() == 2 and x.shape[0] <= _INT8_KERNEL_MAX_ROWS:
            out = torch._weight_int8pack_mm(x, self.data, self.scales)
            return out + bias if bias is not None else out
        return F.linear(x, self.dequantized(), bias)

    def linear_rows(self, x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """x [M, cols] -> x @ W[start:stop]^T, [M, stop - start]: one expert's block of a stacked expert matrix."""
        if self._int8_kernel and x.dim() == 2 and x.shape[0] <= _INT8_KERNEL_MAX_ROWS:
            return torch._weight_int8pack_mm(x, self.data[start:stop], self.scales[start:stop])
        return F.linear(x, self.dequantized(start, stop))


class RowRange:
    """Rows start..start+num_rows-1 of a QuantizedMatrix: where one Hugging Face tensor of a fused weight lives."""

    def __init__(self, matrix: QuantizedMatrix, start: int, num_rows: int) -> None:
        self.matrix, self.start = matrix, start
        self.shape = torch.Size((num_rows, matrix.shape[1]))

    def copy_(self, weight: torch.Tensor) -> None:
        self.matrix.set_rows(self.start, weight)


class ExpertBlocks:
    """A fused Hugging Face expert tensor [experts, rows, cols] (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`)
    held as the stacked rows of one QuantizedMatrix. Each expert's projections (`splits` of its rows: gate and up,
    or down) are quantized on their own, exactly as their per-expert checkpoint tensors are."""

    def __init__(self, matrix: QuantizedMatrix, num_experts: int, splits: tuple[int, ...]) -> None:
        self.matrix, self.splits = matrix, splits
        self.shape = torch.Size((num_experts, sum(splits), matrix.shape[1]))

    def copy_(self, weight: torch.Tensor) -> None:
        num_experts, rows, cols = self.shape
        if self.matrix.quantization != Quantization.int8_tensor:  # per-row scales: all experts at once
            self.matrix.set_rows(0, weight.reshape(num_experts * rows, cols))
            return
        start = 0
        for expert in weight:
            for part in expert.split(self.splits):
                self.matrix.set_rows(start, part)
                start += part.shape[0]
