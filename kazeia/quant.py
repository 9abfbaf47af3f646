"""int8 weights for the talker and code predictor.

Linear layers: weights quantized per output channel (symmetric, one float scale per row) at load
time and run with the CPU's dynamic-activation int8 GEMM (`torch.ops.quantized.linear_dynamic`,
fbgemm): it quantizes its float32 input to 8 bits on the fly (one scale for the whole input),
accumulates in int32 and rescales to float32. Embedding tables: int8 rows with one scale per row,
dequantized on lookup (only the looked-up rows are ever read). Everything else (norms, activations,
KV caches) stays float32. Non-goal: int8 for the vocoder, which is compute-bound and stays float32.

Activations in two rows. Rounding activations to 8 bits costs as much accuracy as rounding the
weights (each ~0.8% of a product on the real-size model), more for heavy-tailed inputs such as the
MLP's down projection. So each input x is sent with a second row: its rounding residual
x - Q(x), where Q is the GEMM's own 8-bit grid, scaled up by a power of two f chosen so that the
second row stays inside the first row's range (the GEMM then picks the same grid for both rows).
The output is row 0 + row 1 / f: the activation error shrinks by f (typically 128) and what is
left is the weights' rounding. A batch-1 GEMM reads each weight once however many rows it
multiplies, so the second row costs no measurable time (BENCHMARKS.md). `split_rows` is the
reference; kazeia/native/decode.c (`residual_row`, `combine_rows`) does the same, value for value,
wherever the native library is available (the native decode step, and `QuantLinear.forward`).
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from . import cpu
from .layers import replace_linears

INT8_MAX = 127.0
MAX_EXPONENT = 17  # residual factors up to 2^16 (decode.c has the same bound)
# The int8 GEMM's C++ entry point. Calling the op overload itself first walks the arguments in
# Python looking for fake script objects (a tracing feature, ~5 us per call here, 400+ calls per
# frame); the packed weight is always a real one, so the binding is called directly when present.
_OVERLOAD = torch.ops.quantized.linear_dynamic.default
LINEAR_DYNAMIC = getattr(_OVERLOAD, "_op", _OVERLOAD)


def needs_reduced_range() -> bool:
    """True unless the int8 GEMM runs its AVX-512 VNNI kernel (the `vnni` feature, kazeia/cpu.py).

    Its other kernels multiply uint8 activations by int8 weights into saturating 16-bit pair sums,
    so activations must be limited to 7 bits there (more activation error, which the second row
    takes back: see `split_rows`). With VNNI the sums go straight to 32 bits and all 8 bits are safe.
    """
    return not cpu.uses("vnni")


def int8_supported() -> str | None:
    """None when int8 products can run here, else the reason they cannot."""
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return "this torch build has no fbgemm int8 GEMM"
    if not cpu.uses("avx2"):
        return "int8 needs a CPU with AVX2 (the int8 GEMM has no kernel below it)"
    return None


def activation_scale(low: float, high: float, levels: int) -> float:
    """The GEMM's step for an input whose values span [low, high]: the range widened to hold 0,
    over `levels` steps (255, or 127 with the reduced range), as a float32 value."""
    return float(np.float32((max(high, 0.0) - min(low, 0.0)) / levels))


def residual_factor(low: float, high: float, largest_residual: float) -> float:
    """The largest power of two f <= 2^16 with f * largest_residual inside [low, high] on both
    sides of 0 (so the scaled residual row leaves the input's range unchanged); 0 when no f >= 2
    fits. (Past 2^8 a larger f gains nothing; the cap keeps f * residual finite in float32.)"""
    room = min(-low, high)
    if not largest_residual > 0 or not room > 0 or not math.isfinite(room / largest_residual):
        return 0.0
    _, exponent = math.frexp(room / largest_residual)  # room / r = m * 2**exponent, 0.5 <= m < 1
    return math.ldexp(1.0, min(exponent, MAX_EXPONENT) - 1) if exponent >= 2 else 0.0


def split_rows(x: torch.Tensor, levels: int) -> tuple[torch.Tensor, float]:
    """x (M, K) float32 -> (x stacked over f * (x - Q(x)), f), or (x, 0.0) where no f fits.

    Q(x) rounds to the grid the GEMM will use for x: multiples of `activation_scale` (x times the
    float32 reciprocal of the step, rounded half to even)."""
    low, high = (float(v) for v in torch.aminmax(x))
    scale = activation_scale(low, high, levels)
    if not scale > 0 or not math.isfinite(scale):
        return x, 0.0
    inverse = float(np.float32(1.0) / np.float32(scale))
    residual = x - torch.round(x * inverse) * scale
    factor = residual_factor(low, high, float(residual.abs().max()))
    if factor == 0.0:
        return x, 0.0
    return torch.cat((x, residual.mul_(factor))), factor


@torch.no_grad()
def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A Linear weight (out, in) -> its int8 values (out, in) and float32 row scales (out,): the
    int8 GEMM's own rounding (`torch.quantize_per_channel`), symmetric, one scale per output row."""
    w = weight.detach().float()
    scales = _row_scales(w)
    zero = torch.zeros(w.shape[0], dtype=torch.long)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # quantized tensors are marked deprecated (see below)
        q = torch.quantize_per_channel(w, scales.double(), zero, 0, torch.qint8)
    return q.int_repr(), scales


def _row_scales(weight: torch.Tensor) -> torch.Tensor:
    """Symmetric per-row scales: max |w| of each row / 127 (float32, (rows,))."""
    return weight.abs().amax(dim=1).clamp(min=1e-12) / INT8_MAX


class QuantLinear(nn.Module):
    """y = x @ W.T + b with W stored int8 per output channel; x, y and b are float32.

    Each product runs the int8 GEMM on two rows (`split_rows`): the activation error is ~f times
    smaller than one 8-bit row's, at the same weight reads. `native`, chosen when the layer is
    made: the product with the residual rows and their combination in kazeia/native/decode.c (the
    same values as `eager`, tested bit for bit), or None where there is no native library."""

    def __init__(self, packed, bias: torch.Tensor | None, in_features: int, out_features: int, lib=None):
        super().__init__()
        self.packed = packed  # prepacked int8 weight for the int8 GEMM (opaque; the bias is kept apart)
        self.register_buffer("bias", bias)
        self.in_features, self.out_features = in_features, out_features
        self.reduce_range = needs_reduced_range()
        self.levels = 127 if self.reduce_range else 255  # steps of the GEMM's activation grid
        self.lib = lib  # the native library (None: PyTorch operations only)
        self.native = None if lib is None else self._native_product(lib)

    @classmethod
    @torch.no_grad()
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None, lib=None) -> QuantLinear:
        return cls.from_int8(*quantize_weight(weight), bias, lib)

    @classmethod
    @torch.no_grad()
    def from_int8(cls, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, lib=None) -> QuantLinear:
        """From `quantize_weight`'s result (as a prepared checkpoint stores it: kazeia/prepared.py)."""
        zero = torch.zeros(qweight.shape[0], dtype=torch.long)
        with warnings.catch_warnings():
            # torch >= 2.10 marks quantized tensors deprecated; the packed int8 GEMM they feed is
            # still the fastest int8 path on CPUs (see BENCHMARKS.md). Revisit when it is removed.
            warnings.simplefilter("ignore", UserWarning)
            q = torch._make_per_channel_quantized_tensor(qweight, scales.double(), zero, 0)
        packed = torch.ops.quantized.linear_prepack(q, None)
        # The bias is added once, after the two rows are combined (the GEMM would add it to both).
        b = None if bias is None else bias.detach().float().clone()
        return cls(packed, b, qweight.shape[1], qweight.shape[0], lib)

    @property
    def stored(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The int8 values and float32 row scales this product multiplies by (`quantize_weight`)."""
        q, _ = torch.ops.quantized.linear_unpack(self.packed)
        return q.int_repr(), q.q_per_channel_scales().float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., in) float32 -> (..., out)."""
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] == 0:  # e.g. a prompt's empty text track (live text): nothing to multiply
            return x.new_zeros(*x.shape[:-1], self.out_features)
        if self.native is not None:
            # The copy's second half is overwritten with the residual rows.
            y = self.native(torch.cat((rows, rows)))[: rows.shape[0]]
        else:
            y = self.eager(rows)
        return y.view(*x.shape[:-1], self.out_features)

    def eager(self, rows: torch.Tensor) -> torch.Tensor:
        """rows (M, in) float32 -> (M, out), with PyTorch operations only."""
        n = rows.shape[0]
        stacked, factor = split_rows(rows, self.levels)
        y = LINEAR_DYNAMIC(stacked, self.packed, self.reduce_range)
        if factor:
            y = y[:n] + y[n:] * (1.0 / factor)
        if self.bias is not None:
            y = y + self.bias
        return y

    def _native_product(self, lib) -> Callable[[torch.Tensor], torch.Tensor]:
        """This product with kazeia/native/decode.c doing the residual rows and the combination, for
        `forward` and the native decode step: `rows` (2m, in) float32 holds the m input rows first;
        the result is the first m rows of the returned (2m, out) tensor."""
        packed, reduce_range, levels, bias = self.packed, self.reduce_range, self.levels, self.bias
        n_in, n_out = self.in_features, self.out_features
        bias_ptr = None if bias is None else bias.data_ptr()
        residual_row, combine_rows = lib.residual_row, lib.combine_rows

        def product(rows: torch.Tensor) -> torch.Tensor:
            m = rows.shape[0] // 2
            factor = residual_row(rows.data_ptr(), m * n_in, levels)
            y = LINEAR_DYNAMIC(rows, packed, reduce_range)
            combine_rows(y.data_ptr(), m * n_out, n_out, 1.0 / factor if factor else 0.0, bias_ptr)
            return y

        return product


class QuantEmbedding(nn.Module):
    """An embedding table stored as int8 rows with a float32 scale per row."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor):
        super().__init__()
        self.register_buffer("qweight", qweight)  # (rows, dim) int8
        self.register_buffer("scales", scales)  # (rows,) float32

    @classmethod
    @torch.no_grad()
    def from_float_chunked(cls, weight: torch.Tensor, rows: int = 2048) -> QuantEmbedding:
        """Quantize a large table in row blocks, so no float32 copy of the whole table exists."""
        qweight = torch.empty(weight.shape, dtype=torch.int8)
        scales = torch.empty(weight.shape[0], dtype=torch.float32)
        for start in range(0, weight.shape[0], rows):
            block = weight[start : start + rows].float()
            s = _row_scales(block)
            qweight[start : start + rows] = torch.round(block / s[:, None]).to(torch.int8)
            scales[start : start + rows] = s
        return cls(qweight, scales)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.qweight[ids].float() * self.scales[ids, None]


def quantize_linears(module: nn.Module, lib=None, after_each: Callable[[], None] | None = None) -> None:
    """Replace every nn.Linear inside `module` by a QuantLinear, in place (one weight at a time);
    `lib`: the native library their products use (None: PyTorch operations only)."""
    convert = lambda linear: QuantLinear.from_float(linear.weight, linear.bias, lib)  # noqa: E731
    replace_linears(module, convert, after_each, workers=os.cpu_count() or 1)  # the GEMM's packing releases the GIL
