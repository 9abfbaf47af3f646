"""Float products on the CPU beside the native ones: oneDNN's packed matmul (`PackedLinear`), the
matrix product of a prompt's many rows (`matrix_product`), and replacing a model's linear layers by
another product kind, in place (`replace_linears`, `pack_linears`).

oneDNN reads a packed weight faster than the stock kernel reads a plain one in batch-1 products, and
its matmul takes a `cpu.team`; where a dtype's dot products are missing (kazeia/cpu.py) packing is
not offered. Tensors only. Non-goals: choosing a product kind for a model (kazeia/model.py), the
native products (kazeia/native, int4.py, quant.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F
from torch import nn

from . import cpu

LINEAR_POINTWISE = torch.ops.mkldnn._linear_pointwise.default  # the resolved overload: no lookup per call
# The row count oneDNN lays a packed weight out for: packed for one row, float32 products of a few
# rows are much slower; packed for 16, one row is as fast (docs/design.md, "Generation beside the vocoder").
PACKING_ROWS = 16


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """A (out, in) matrix in oneDNN's packed matmul layout, for LINEAR_POINTWISE."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, PACKING_ROWS)


# Row counts a prompt product hands oneDNN: rows are padded with zeros up to the next of these, and
# taken ROW_BUCKETS[-1] at a time beyond it. oneDNN builds and keeps a primitive (~0.7 MB: its
# kernels) for every shape it meets, 1024 of them before it evicts any; prompts of every length
# made a server's memory grow by hundreds of MB (docs/design.md, "Prompt products").
ROW_BUCKETS = (4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def matrix_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T + bias for many rows (a prompt's) on a plain float32 weight: oneDNN's matmul
    where torch has it, faster than `F.linear`'s kernel on one thread (docs/design.md), and it takes
    a `cpu.team` (F.linear's does not); its results do not depend on the team's size. oneDNN only
    ever sees the row counts of ROW_BUCKETS, so its kept primitives are bounded."""
    if weight.dtype == torch.float32 and x.device.type == "cpu" and torch.backends.mkldnn.is_available():
        rows = x.reshape(-1, x.shape[-1])
        step = ROW_BUCKETS[-1]
        parts = [_bucketed(rows[i : i + step], weight, bias) for i in range(0, max(rows.shape[0], 1), step)]
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        return out.view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


def _bucketed(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """rows (n <= ROW_BUCKETS[-1], in) through oneDNN's matmul as the next bucket's count of rows."""
    n = rows.shape[0]
    size = next(b for b in ROW_BUCKETS if b >= n)
    if size != n:
        rows = torch.cat((rows, rows.new_zeros(size - n, rows.shape[1])))
    return LINEAR_POINTWISE(rows, weight, bias, "none", [], "")[:n]


class PackedLinear(nn.Module):
    """A Linear whose weight is pre-packed for oneDNN's CPU matmul (float32 / bfloat16).

    oneDNN reads a packed weight faster than the stock kernel reads a plain one in batch-1
    products (figures: docs/design.md). Same sums, in another order: results differ from
    `F.linear` by float rounding only (~1e-6 relative in float32).
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight", pack_weight(linear.weight.detach()))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return LINEAR_POINTWISE(x, self.weight, self.bias, "none", [], "")


PACKING_FEATURE = {torch.bfloat16: "bf16", torch.float16: "f16"}  # kazeia/cpu.py; float32 packs anywhere


def can_pack(dtype: torch.dtype) -> bool:
    """True when oneDNN packed matmuls for `dtype` may run: the torch build has oneDNN, the
    dtype's feature (PACKING_FEATURE) is enabled, and a tiny product really runs."""
    if not torch.backends.mkldnn.is_available():
        return False
    feature = PACKING_FEATURE.get(dtype)
    if feature is not None and not cpu.uses(feature):
        return False
    try:
        w = torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype), 1)
        torch.ops.mkldnn._linear_pointwise(torch.zeros(1, 8, dtype=dtype), w, None, "none", [], "")
    except (RuntimeError, NotImplementedError):
        return False
    return True


def pack_linears(module: nn.Module, after_each: Callable[[], None] | None = None) -> None:
    """Replace every nn.Linear inside `module` by a PackedLinear, in place (one weight at a time)."""
    replace_linears(module, PackedLinear, after_each)


def replace_linears(
    module: nn.Module,
    convert: Callable[[nn.Linear], nn.Module],
    after_each: Callable[[], None] | None = None,
    workers: int = 1,
) -> None:
    """Replace every nn.Linear inside `module` by `convert(linear)`, in place, one at a time (with
    `workers` > 1, the linears of one parent module at once, in threads: for conversions that
    release the GIL); `after_each` runs after each parent module's linears are replaced (loading
    passes one that returns freed memory to the OS)."""
    # Collect the parents only: a list of every module would keep each old weight alive until the
    # end, so all converted copies would pile up next to all originals at the peak.
    parents = [m for m in module.modules() if any(isinstance(c, nn.Linear) for c in m.children())]
    with ThreadPoolExecutor(max_workers=workers) if workers > 1 else contextlib.nullcontext() as pool:
        for parent in parents:
            names = [n for n, c in parent.named_children() if isinstance(c, nn.Linear)]
            if pool is not None and len(names) > 1:
                made = list(pool.map(lambda n: convert(getattr(parent, n)), names))  # noqa: B023 (used at once)
                for name, converted in zip(names, made, strict=True):
                    setattr(parent, name, converted)
            else:
                for name in names:
                    setattr(parent, name, convert(getattr(parent, name)))
            if after_each is not None:
                after_each()
