"""Linear layers whose decoding-step products run in the native GEMV (gemv.c).

A decoding step multiplies one or two activation rows by each weight: a weight read, two flops a
weight. gemv.c streams each weight row once at nearly the read bandwidth of one thread, where the
stock and oneDNN kernels, run on one thread, read well below it (figures: docs/design.md); the
placement gives generation one thread of its own (kazeia/placement.py), so this is its product,
its weight rows split over the calling thread's team where a step takes one (`gemv_team`). More
rows (a prompt) are a matrix product bound by arithmetic: `matmul.matrix_product` on the same
weight, in float32 where the CPU has no bfloat16/float16 dot products (the stock half-precision
kernels are slow there). Tensors only.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch
from torch import nn

from .. import cpu
from ..matmul import matrix_product
from ..products import MAX_ROWS, NATIVE_DTYPES, ProductSpec, RowProduct, address, check

STEP_ROWS = 2  # rows `forward` sends to the GEMV (a decode step: one position, or the predictor's first two)
HALF_FEATURE = {torch.bfloat16: "bf16", torch.float16: "f16"}  # native half-precision dot products


class NativeLinear(nn.Module):
    """y = x @ weight.T + bias with the weight as the Linear stores it ((out, in), contiguous)."""

    def __init__(self, linear: nn.Linear, lib: ctypes.CDLL):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight", linear.weight.detach().contiguous())
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().contiguous())
        self.lib = lib
        self.dt = NATIVE_DTYPES[self.weight.dtype]
        feature = HALF_FEATURE.get(self.weight.dtype)
        self.prompt_in_float32 = feature is not None and not cpu.uses(feature)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., in) -> (..., out), in the weight's dtype."""
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] > STEP_ROWS or x.dtype != self.weight.dtype:
            return self._matmul(x)
        return self._gemv(rows).view(*x.shape[:-1], self.out_features)

    def row_product(self) -> RowProduct:
        """The GEMV on up to MAX_ROWS rows at once, each row reduced in the order of one row alone
        (kazeia/products.py): a batched step's product."""
        return self._gemv

    def _gemv(self, rows: torch.Tensor) -> torch.Tensor:
        """rows (m, in) -> (m, out) in the weight's dtype, through gemv.c."""
        rows = rows.reshape(-1, self.in_features).to(self.weight.dtype).contiguous()
        m = rows.shape[0]
        y = torch.empty(m, self.out_features, dtype=self.weight.dtype)
        if m == 0:  # e.g. live text's empty text track: nothing to multiply
            return y
        status = self.lib.gemv_team(self.weight.data_ptr(), rows.data_ptr(), address(self.bias), y.data_ptr(),
                                    self.out_features, self.in_features, m, self.dt, cpu.native_threads())  # fmt: skip
        check(status, f"the GEMV of {m} rows (at most {MAX_ROWS})")
        return y

    def product_spec(self, dtype: torch.dtype) -> tuple | None:
        """This product for stack.c (`products.ProductSpec`) in activations of `dtype`, or None."""
        if self.weight.dtype != dtype:
            return None
        return (ProductSpec.GEMV, self.dt, self.weight.data_ptr(), None, None, None, address(self.bias),
                self.out_features, self.in_features)  # fmt: skip

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if not self.prompt_in_float32:
            return matrix_product(x, self.weight, self.bias)
        bias = None if self.bias is None else self.bias.float()
        return matrix_product(x.float(), self.weight.float(), bias).to(x.dtype)


def usable(lib: ctypes.CDLL | None, dtype: torch.dtype) -> bool:
    """Whether the native GEMV should take this model's products: a library with vector
    instructions (the portable build's scalar loops are slower than the stock kernels), a dtype it
    takes, and torch on one thread per stage (with more, oneDNN's multi-threaded products win)."""
    if lib is None or dtype not in NATIVE_DTYPES or lib.gemv_vector_bits() == 0:
        return False
    if dtype == torch.float16 and not lib.has_float16():
        return False
    return torch.get_num_threads() == 1


def converter(lib: ctypes.CDLL) -> Callable[[nn.Linear], nn.Module]:
    return lambda linear: NativeLinear(linear, lib)
