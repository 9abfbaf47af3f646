"""The product contract: what a linear layer of the talker or the code predictor offers a frame step.

A product is a module computing y = x @ W.T (+ bias) on rows of activations. Besides its own
`forward`, each product kind answers two questions, once, for the frame step (kazeia/frame.py) and
the native stack (kazeia/native/step.py):

* `row_product()`: a function of rows (n, in) -> (n, out) whose result for each row does not depend
  on the other rows of the call (nor on n), and equals the product's own result for that row alone;
  or None where the kind has none (a stock oneDNN or fbgemm kernel, a GPU). A batched step multiplies
  the rows of all its requests in one call of it, reading each weight once for all of them.
* `product_spec(dtype)`: the product as stack.c describes one (`ProductSpec`), for activations of
  `dtype`; or None where stack.c cannot run it.
* `splits_rows`: True where the product splits a prompt's rows over the calling thread's team itself
  (`own_threads`), so that torch's parallel regions must not take the same cores (kazeia/placement.py).

The kinds are `native.linear.NativeLinear` (the float GEMV), `int4.Int4Linear` and `quant.QuantLinear`
(int8, row-independent where its native library runs it). This module also
holds the one mapping from a native function's status to an exception (`check`).

Non-goals: choosing a kind at load (kazeia/model.py), the kernels themselves (kazeia/native/*.c).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch
from torch import nn

RowProduct = Callable[[torch.Tensor], torch.Tensor]  # rows (n, in) -> (n, out), each row on its own
MAX_ROWS = 256  # rows one native row product takes (gemv.c); a batch of B requests needs 2 B in the predictor
OUT_OF_MEMORY = -2  # the status a native function returns when an allocation failed
NATIVE_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # the C code's dtype numbers (dtypes.h)


class ProductSpec(ctypes.Structure):
    """stack.c's description of one native product: its kind, weight dtype, the addresses of its
    weights and bias, its shape (`product_spec()` of each product kind)."""

    GEMV, INT4, INT8 = 0, 1, 2
    _fields_ = [
        ("kind", ctypes.c_int),
        ("dt", ctypes.c_int),
        ("w", ctypes.c_void_p),
        ("a", ctypes.c_void_p),
        ("b", ctypes.c_void_p),
        ("c", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
        ("rows", ctypes.c_long),
        ("cols", ctypes.c_long),
    ]


def row_product(module: nn.Module) -> RowProduct | None:
    """`module`'s row-independent product (module docstring), None where it has none. An identity
    (the 0.6B code predictor's projection) is one."""
    if isinstance(module, nn.Identity):
        return _same
    rows = getattr(module, "row_product", None)
    return rows() if rows is not None else None


def product_spec(module: nn.Module, dtype: torch.dtype) -> ProductSpec | None:
    """`module` for stack.c in activations of `dtype`, None where stack.c cannot run it."""
    spec = getattr(module, "product_spec", None)
    made = spec(dtype) if spec is not None else None
    return None if made is None else ProductSpec(*made)


def own_threads(module: nn.Module) -> bool:
    """Whether `module` splits its products' weight rows over the calling thread's team itself
    (`cpu.native_threads`: a prompt's, its first frame's) rather than through torch's parallel
    regions."""
    return bool(getattr(module, "splits_rows", False))


def address(t: torch.Tensor | None) -> int | None:
    """A tensor's data address for a C call, None (NULL) for none: an optional bias."""
    return None if t is None else t.data_ptr()


def check(status: int, what: str) -> None:
    """A native function's status: 0 is success; OUT_OF_MEMORY a MemoryError, anything else a
    RuntimeError (a shape or a row count it does not take), each naming `what` was asked."""
    if status == OUT_OF_MEMORY:
        raise MemoryError(f"{what}: out of memory")
    if status != 0:
        raise RuntimeError(f"{what}: refused by the native code (status {status})")


def _same(rows: torch.Tensor) -> torch.Tensor:
    return rows
