"""int8 weights for the talker and code predictor.

Linear layers: weights quantized per output channel (symmetric, one float scale per row) at load
time. Embedding tables: int8 rows with one scale per row, dequantized on lookup (only the looked-up
rows are ever read). Everything else (norms, activations, KV caches) stays float32. Non-goal: int8
for the vocoder, which is compute-bound and stays float32.

Products, where the native library is built (kazeia/native/int8.c): each activation row is rounded
to 16 bits on a grid of its own (step max |x| / 32767) and multiplied by the int8 weights in exact
integer arithmetic, then scaled once (`reference_product` is the definition, in float64). 8-bit
activations would cost as much accuracy as the weights' rounding (BENCHMARKS.md, quality); 16 bits
leave only the weights'. A row's result depends on that row alone, in every build (AVX-512, AVX2,
plain C compute the same integers): a batched step gives each request exactly its solo result
(kazeia/frame.py), and solo and batched steps are the same computation.

Without the native library: the CPU's dynamic-activation int8 GEMM (`torch.ops.quantized.
linear_dynamic`, fbgemm), which takes one 8-bit grid for its whole input; each input is sent with a
second row, its rounding residual x - Q(x) scaled up by a power of two f that keeps it inside the
first row's range, and the output is row 0 + row 1 / f (`split_rows`): the activation error shrinks
by f (typically 128) at the same weight reads. Results differ from the native product's by
rounding; that path has no batched step (kazeia/frame.py steps such requests one by one).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from . import cpu
from .matmul import replace_linears
from .products import ProductSpec, RowProduct, address, check

INT8_MAX = 127.0
MAX_EXPONENT = 17  # residual factors up to 2^16 (decode.c has the same bound)
# The int8 GEMM's C++ entry point. Calling the op overload itself first walks the arguments in
# Python looking for fake script objects (a tracing feature: microseconds a call, hundreds of calls
# a frame); the packed weight is always a real one, so the binding is called directly when present.
_OVERLOAD = torch.ops.quantized.linear_dynamic.default
LINEAR_DYNAMIC = getattr(_OVERLOAD, "_op", _OVERLOAD)


def needs_reduced_range() -> bool:
    """True unless the int8 GEMM runs its AVX-512 VNNI kernel (the `vnni` feature, kazeia/cpu.py).

    Its other kernels multiply uint8 activations by int8 weights into saturating 16-bit pair sums,
    so activations must be limited to 7 bits there (more activation error, which the second row
    takes back: see `split_rows`). With VNNI the sums go straight to 32 bits and all 8 bits are safe.
    """
    return not cpu.uses("vnni")


def int8_supported(lib=None) -> str | None:
    """None when int8 products can run here, else the reason they cannot. `lib`: the native
    library (its int8 products run on any CPU); without it, the int8 GEMM is needed."""
    if lib is not None:
        return None
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return "this torch build has no fbgemm int8 GEMM, and the native library is unavailable"
    if not cpu.uses("avx2"):
        return "int8 needs a CPU with AVX2 (the int8 GEMM has no kernel below it) or the native library"
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


# The native layout (int8.c): groups of ROWS weight rows, each cut in chunks of CHUNK columns
# stored side by side (row 0's chunk, row 1's, ...), so that one group is one sequential stream.
ROWS, CHUNK = 4, 32


def native_shape(out_features: int, in_features: int) -> bool:
    """Whether int8.c takes a weight of this shape (else the int8 GEMM does)."""
    return out_features % ROWS == 0 and in_features % CHUNK == 0 and in_features > 0


def interleave(qweight: torch.Tensor) -> torch.Tensor:
    """int8 values (out, in) -> int8.c's layout (the same values, reordered: `native_shape`)."""
    rows, cols = qweight.shape
    return qweight.view(rows // ROWS, ROWS, cols // CHUNK, CHUNK).transpose(1, 2).contiguous().view(rows, cols)


def deinterleave(packed: torch.Tensor) -> torch.Tensor:
    rows, cols = packed.shape
    return packed.view(rows // ROWS, cols // CHUNK, ROWS, CHUNK).transpose(1, 2).contiguous().view(rows, cols)


@torch.no_grad()
def reference_product(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias=None) -> torch.Tensor:
    """The native int8 product (kazeia/native/int8.c) in PyTorch operations, value for value:
    x (M, in) float32 rows, each rounded to 16 bits on its own grid; exact integer dot products
    (in float64, exact below 2^53); one scaling in float64, rounded to float32; the bias added in
    float32. Slow (float64 weights): the definition, for tests and for reading."""
    x = x.float()
    amax = x.abs().amax(dim=1)
    finite = torch.isfinite(x).all(dim=1)
    limit = torch.tensor(32767.0)
    inverse = torch.where(amax > 0, limit / amax, torch.zeros_like(amax))
    codes = torch.round(x * inverse[:, None]).clamp(-32767, 32767)
    codes = torch.where(finite[:, None], codes, torch.zeros_like(codes))
    steps = torch.where(finite, amax / limit, torch.full_like(amax, math.nan))
    dots = codes.double() @ qweight.double().T
    y = (dots * (steps.double()[:, None] * scales.double()[None, :])).float()
    return y if bias is None else y + bias.float()


class QuantLinear(nn.Module):
    """y = x @ W.T + b with W stored int8 per output channel; x, y and b are float32.

    With the native library (and a shape it takes: `native_shape`): int8.c's product, 16-bit
    activation rows each on its own grid (`reference_product`), rows independent of each other;
    a decoding step's product on the calling thread, a prompt's on the team's threads. Otherwise
    the int8 GEMM on two rows per input (`split_rows`)."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, lib=None):
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())
        self.lib = lib if lib is not None and native_shape(*qweight.shape) else None
        self.reduce_range = needs_reduced_range()
        self.levels = 127 if self.reduce_range else 255  # steps of the int8 GEMM's activation grid
        if self.lib is not None:
            self.register_buffer("qweight", interleave(qweight.to(torch.int8)))  # int8.c's layout
            self.register_buffer("scales", scales.detach().float().contiguous())
            self.packed = None
        else:
            zero = torch.zeros(qweight.shape[0], dtype=torch.long)
            with warnings.catch_warnings():
                # torch >= 2.10 marks quantized tensors deprecated; the packed int8 GEMM they feed is
                # the int8 path where the native library is unavailable. Revisit when it is removed.
                warnings.simplefilter("ignore", UserWarning)
                q = torch._make_per_channel_quantized_tensor(qweight, scales.double(), zero, 0)
            self.packed = torch.ops.quantized.linear_prepack(q, None)  # opaque; the bias is kept apart

    @classmethod
    @torch.no_grad()
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None, lib=None) -> QuantLinear:
        return cls.from_int8(*quantize_weight(weight), bias, lib)

    @classmethod
    @torch.no_grad()
    def from_int8(cls, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, lib=None) -> QuantLinear:
        """From `quantize_weight`'s result (as a prepared checkpoint stores it: kazeia/prepared.py)."""
        return cls(qweight, scales, bias, lib)

    @property
    def native(self) -> bool:
        """Whether int8.c runs this product (rows independent of each other)."""
        return self.lib is not None

    @property
    def splits_rows(self) -> bool:
        """int8.c splits a prompt's product over the calling thread's team (kazeia/products.py)."""
        return self.lib is not None

    @property
    def stored(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The int8 values (out, in) and float32 row scales this product multiplies by (`quantize_weight`)."""
        if self.lib is not None:
            return deinterleave(self.qweight), self.scales
        q, _ = torch.ops.quantized.linear_unpack(self.packed)
        return q.int_repr(), q.q_per_channel_scales().float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., in) float32 -> (..., out)."""
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] == 0:  # e.g. a prompt's empty text track (live text): nothing to multiply
            return x.new_zeros(*x.shape[:-1], self.out_features)
        y = self._native(rows) if self.lib is not None else self.eager(rows)
        return y.view(*x.shape[:-1], self.out_features)

    def _native(self, rows: torch.Tensor) -> torch.Tensor:
        rows = rows.float().contiguous()
        m = rows.shape[0]
        y = torch.empty(m, self.out_features, dtype=torch.float32)
        threads = cpu.native_threads()  # a team's: a prompt, its first frame
        status = self.lib.int8_gemm(self.qweight.data_ptr(), self.scales.data_ptr(), rows.data_ptr(),
                                    None if self.bias is None else self.bias.data_ptr(), y.data_ptr(),
                                    self.out_features, self.in_features, m, threads)  # fmt: skip
        check(status, f"the int8 product of {m} x {self.in_features} -> {self.out_features}")
        return y

    def eager(self, rows: torch.Tensor) -> torch.Tensor:
        """rows (M, in) float32 -> (M, out) with the int8 GEMM (the path without the native library)."""
        n = rows.shape[0]
        stacked, factor = split_rows(rows, self.levels)
        y = LINEAR_DYNAMIC(stacked, self.packed, self.reduce_range)
        if factor:
            y = y[:n] + y[n:] * (1.0 / factor)
        if self.bias is not None:
            y = y + self.bias
        return y

    def row_product(self) -> RowProduct | None:
        """`forward` where int8.c runs it (each row on its own grid: kazeia/products.py); None for
        the int8 GEMM, whose one activation grid spans all rows of a call."""
        return self.forward if self.lib is not None else None

    def product_spec(self, dtype: torch.dtype) -> tuple | None:
        """This product for stack.c (`products.ProductSpec`) in activations of `dtype`, or None."""
        if self.lib is None or dtype != torch.float32:
            return None
        return (ProductSpec.INT8, 0, self.qweight.data_ptr(), self.scales.data_ptr(), None, None, address(self.bias),
                self.out_features, self.in_features)  # fmt: skip


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
    replace_linears(module, convert, after_each, workers=cpu.usable_cpus())  # the GEMM's packing releases the GIL
