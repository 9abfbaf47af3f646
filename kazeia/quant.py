"""int8 weights for the talker and code predictor.

Linear layers: weights quantized per output channel (symmetric, one float scale per row) at load
time and run with the CPU's dynamic-activation int8 GEMM (`torch.ops.quantized.linear_dynamic`,
fbgemm/oneDNN): the activation vector is quantized on the fly, products accumulate in int32 and are
rescaled to float32. Embedding tables: int8 rows with one scale per row, dequantized on lookup
(only the looked-up rows are ever read). Everything else (norms, activations, KV caches) stays
float32. Non-goal: int8 for the vocoder, which is compute-bound and stays float32.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from .layers import replace_linears

INT8_MAX = 127.0
# The int8 GEMM's C++ entry point. Calling the op overload itself first walks the arguments in
# Python looking for fake script objects (a tracing feature, ~5 us per call here, 400+ calls per
# frame); the packed weight is always a real one, so the binding is called directly when present.
_OVERLOAD = torch.ops.quantized.linear_dynamic.default
LINEAR_DYNAMIC = getattr(_OVERLOAD, "_op", _OVERLOAD)


@functools.cache
def needs_reduced_range() -> bool:
    """True unless the CPU has VNNI int8 dot products.

    Without VNNI, the int8 GEMM multiplies uint8 activations by int8 weights into saturating 16-bit
    pair sums, so activations must be limited to 7 bits (more activation error). With VNNI the sums
    go straight to 32 bits and the full 8 bits are safe (measured here: 1.2% instead of 2.0% output
    error on random layers).
    """
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return True
    return not any(f in flags.split() for f in ("avx512_vnni", "avx_vnni", "amx_int8"))


def _row_scales(weight: torch.Tensor) -> torch.Tensor:
    """Symmetric per-row scales: max |w| of each row / 127 (float32, (rows,))."""
    return weight.abs().amax(dim=1).clamp(min=1e-12) / INT8_MAX


class QuantLinear(nn.Module):
    """y = x @ W.T + b with W stored int8 per output channel; x and y are float32."""

    def __init__(self, packed, in_features: int, out_features: int):
        super().__init__()
        self.packed = packed  # prepacked int8 weight + float bias for the int8 GEMM (opaque)
        self.in_features, self.out_features = in_features, out_features
        self.reduce_range = needs_reduced_range()

    @classmethod
    @torch.no_grad()
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> QuantLinear:
        w = weight.detach().float()
        scales = _row_scales(w)
        zero = torch.zeros(w.shape[0], dtype=torch.long)
        with warnings.catch_warnings():
            # torch >= 2.10 marks quantized tensors deprecated; the packed int8 GEMM they feed is
            # still the fastest int8 path on CPUs (see BENCHMARKS.md). Revisit when it is removed.
            warnings.simplefilter("ignore", UserWarning)
            q = torch.quantize_per_channel(w, scales.double(), zero, 0, torch.qint8)
        packed = torch.ops.quantized.linear_prepack(q, None if bias is None else bias.detach().float())
        return cls(packed, w.shape[1], w.shape[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., in) float32 -> (..., out); the GEMM flattens leading dimensions itself."""
        return LINEAR_DYNAMIC(x, self.packed, self.reduce_range)


class QuantEmbedding(nn.Module):
    """An embedding table stored as int8 rows with a float32 scale per row."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        w = weight.detach().float()
        scales = _row_scales(w)
        self.register_buffer("qweight", torch.round(w / scales[:, None]).to(torch.int8))
        self.register_buffer("scales", scales)

    @classmethod
    @torch.no_grad()
    def from_float_chunked(cls, weight: torch.Tensor, rows: int = 2048) -> QuantEmbedding:
        """Quantize a large table in row blocks, so no float32 copy of the whole table exists."""
        out = cls.__new__(cls)
        nn.Module.__init__(out)
        qweight = torch.empty(weight.shape, dtype=torch.int8)
        scales = torch.empty(weight.shape[0], dtype=torch.float32)
        for start in range(0, weight.shape[0], rows):
            block = weight[start : start + rows].float()
            s = _row_scales(block)
            qweight[start : start + rows] = torch.round(block / s[:, None]).to(torch.int8)
            scales[start : start + rows] = s
        out.register_buffer("qweight", qweight)
        out.register_buffer("scales", scales)
        return out

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.qweight[ids].float() * self.scales[ids, None]


def quantize_linears(module: nn.Module, after_each: Callable[[], None] | None = None) -> None:
    """Replace every nn.Linear inside `module` by a QuantLinear, in place (one weight at a time)."""
    replace_linears(module, lambda linear: QuantLinear.from_float(linear.weight, linear.bias), after_each)
