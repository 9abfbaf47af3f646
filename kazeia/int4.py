"""int4 weights for the talker and code predictor (`dtype="int4"`, CPU).

Each product's weight rows are cut into groups of 32. A weight is stored as a 4-bit code q and
rebuilt as d * s * q - e * n: s (uint8) and n (int8) are its group's step and offset, d and e
(float32) its row's factors. That is 4.5 bits a weight (0.5625 bytes, against 1 for int8 and 2 for
bfloat16); batch-1 generation reads every weight once a position, so its time follows those bytes
(docs/design.md). The products run in kazeia/native/int4.c: activations are rounded to int8 per
block of 128 on the fly and the codes multiplied in integers, one conversion to float per block
(per two blocks with VNNI); the offsets meet the exact float32 activations (the layout and
arithmetic are described there). Several rows (a prompt's, a batched step's) are multiplied in
tiles, each weight unit unpacked once for up to 8 rows. Summation per row is fixed, so a row's
result does not depend on how many rows it is multiplied with, nor on the thread count.

Quantization (`quantize_weight`): for every group, a search over steps around its min-max range
(the step widened and narrowed about (max - min) / 15, as GGML's k-quants do), each giving codes
whose step and offset are fitted by least squares; the pair with the smallest squared error is
kept. Per row, d and e are the largest step / 255 and the largest |offset| / 127; each group's s
and n are its own rounded to those grids, and the codes are taken again against the rounded
values, so the stored numbers are exactly what the product multiplies. The output heads and the
`more_bits` down projections keep 8 bits (`quant.QuantLinear`, `eight_bit_products`), the text
embedding is an int8 table (`quant.QuantEmbedding`: only looked-up rows are read); norms,
activations and caches stay float32. Products whose input width is not a multiple of 64 (none in
the released models) stay float32.
"""

from __future__ import annotations

import ctypes
import functools

import torch
from torch import nn

from . import cpu
from .matmul import replace_linears
from .products import ProductSpec, RowProduct, address, check
from .quant import QuantLinear, native_shape

GROUP = 32  # weights per step and offset
UNIT = 64  # two groups: one 32-byte block of codes (kazeia/native/int4.c)
LEVELS = 15  # codes 0..15
STEPS, OFFSETS = 255, 127  # the grids of a group's step (uint8) and offset (int8)
# The step search: (LEVELS + SHIFTS[i]) / (max - min) codes per unit of weight. Nine candidates
# reach 7.04 % relative error on Gaussian weights, seventeen 7.02 %, one (min-max) 7.5 %.
SHIFTS = tuple(-1.0 + 0.25 * i for i in range(9))
CHUNK = 1 << 16  # rows x groups per quantization block (bounds the search's temporaries)


def supported(in_features: int) -> bool:
    return in_features >= UNIT and in_features % UNIT == 0


def activation_block(cols: int) -> int:
    """Columns per activation step (int4_block in kazeia/native/int4.c)."""
    return 128 if cols % 128 == 0 else UNIT


@torch.no_grad()
def quantize_weight(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """A Linear weight (out, in) -> its stored form: "qweight" (out, in / 2) uint8 packed codes,
    "steps" (out, in / 32) uint8, "offsets" (out, in / 32) int8, "factors" (out, 2) float32."""
    rows, cols = weight.shape
    if not supported(cols):
        raise ValueError(f"int4 needs an input width that is a multiple of {UNIT}, got {cols}")
    groups = cols // GROUP
    w = weight.detach()
    step = torch.empty(rows, groups)
    offset = torch.empty(rows, groups)
    per = max(1, CHUNK // groups)  # rows per block
    for start in range(0, rows, per):
        block = w[start : start + per].float().reshape(-1, GROUP)
        s, o = _fit_groups(block)
        step[start : start + per], offset[start : start + per] = s.view(-1, groups), o.view(-1, groups)
    d = step.amax(dim=1) / STEPS
    e = offset.abs().amax(dim=1) / OFFSETS
    d_safe = torch.where(d > 0, d, torch.ones_like(d))
    e_safe = torch.where(e > 0, e, torch.ones_like(e))
    steps = torch.round(step / d_safe[:, None]).clamp_(0, STEPS)
    offsets = torch.round(-offset / e_safe[:, None]).clamp_(-OFFSETS, OFFSETS)
    codes = torch.empty(rows, cols, dtype=torch.uint8)
    for start in range(0, rows, per):
        part = slice(start, start + per)
        g_step = (d[part, None] * steps[part]).unsqueeze(-1)  # the values the product multiplies
        g_offset = (e[part, None] * offsets[part]).unsqueeze(-1)
        x = w[part].float().view(-1, groups, GROUP)
        q = torch.round((x + g_offset) / torch.where(g_step > 0, g_step, torch.ones_like(g_step)))
        codes[part] = torch.where(g_step > 0, q.clamp_(0, LEVELS), torch.zeros_like(q)).view(-1, cols).to(torch.uint8)
    return {
        "qweight": pack(codes),
        "steps": steps.to(torch.uint8),
        "offsets": offsets.to(torch.int8),
        "factors": torch.stack((d, e), dim=1).float(),
    }


def _fit_groups(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w (N, 32) float32 -> the best step (>= 0) and offset of each group, float32 (N,) each."""
    low, high = w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
    above = w - low  # >= 0
    inverse_span = 1.0 / (high - low).clamp_(min=1e-30)
    n = float(GROUP)
    sum_x, sum_xx = w.sum(1), (w * w).sum(1)
    best_err = torch.full((w.shape[0],), float("inf"))
    best_d, best_mn = (high - low).squeeze(1) / LEVELS, low.squeeze(1)
    q = torch.empty_like(w)
    for shift in SHIFTS:
        torch.mul(above, inverse_span * (LEVELS + shift), out=q).round_().clamp_(0, LEVELS)
        sum_q, sum_qq, sum_qx = q.sum(1), (q * q).sum(1), (q * w).sum(1)
        det = n * sum_qq - sum_q * sum_q
        ok = det > 0
        safe = torch.where(ok, det, 1.0)
        d = (n * sum_qx - sum_q * sum_x) / safe
        mn = (sum_qq * sum_x - sum_q * sum_qx) / safe
        # the squared error of d * q + mn, expanded
        err = sum_xx - 2 * d * sum_qx - 2 * mn * sum_x + d * d * sum_qq + 2 * d * mn * sum_q + n * mn * mn
        better = ok & (d >= 0) & (err < best_err)
        best_err = torch.where(better, err, best_err)
        best_d, best_mn = torch.where(better, d, best_d), torch.where(better, mn, best_mn)
    return best_d, best_mn


def pack(codes: torch.Tensor) -> torch.Tensor:
    """Codes (rows, cols) in 0..15 -> (rows, cols / 2) bytes: 16 bytes a group, byte k holding
    code k in its low nibble and code 16 + k in its high one."""
    rows, cols = codes.shape
    halves = codes.view(rows, cols // GROUP, 2, GROUP // 2)
    return (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(rows, cols // 2)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack`: (rows, cols / 2) bytes -> codes (rows, cols) uint8."""
    rows, half = packed.shape
    groups = packed.view(rows, half // (GROUP // 2), GROUP // 2)
    return torch.stack((groups & 0x0F, groups >> 4), dim=2).reshape(rows, half * 2)


def dequantize(stored: dict[str, torch.Tensor]) -> torch.Tensor:
    """The float32 weight (rows, cols) the stored values stand for: d * s * q - e * n."""
    packed = stored["qweight"]
    codes = unpack(packed).float().view(packed.shape[0], -1, GROUP)
    d, e = stored["factors"].unbind(1)
    step = d[:, None] * stored["steps"].float()
    offset = e[:, None] * stored["offsets"].float()
    return (codes * step[..., None] - offset[..., None]).reshape(packed.shape[0], -1)


def reference_product(x: torch.Tensor, stored: dict[str, torch.Tensor], bias: torch.Tensor | None) -> torch.Tensor:
    """What kazeia/native/int4.c computes for x (m, in) float32, in float64 after the same int8
    rounding of x: for tests. Differs from the native result by float32 summation only."""
    m, cols = x.shape
    block = activation_block(cols)
    blocks = x.float().reshape(m, cols // block, block)
    amax = blocks.abs().amax(dim=2, keepdim=True)
    inverse = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    p = torch.round(blocks * inverse).double().view(m, cols // GROUP, GROUP)
    t = (amax / 127.0).double().view(m, cols // block)
    sums = x.double().view(m, cols // GROUP, GROUP).sum(-1)
    codes = unpack(stored["qweight"]).double().view(-1, cols // GROUP, GROUP)
    dots = torch.einsum("mgj,rgj->mrg", p, codes) * stored["steps"].double()  # exact integers
    per_block = dots.view(m, -1, cols // block, block // GROUP).sum(-1)
    d, e = stored["factors"].double().unbind(1)
    y = d * (per_block * t[:, None]).sum(-1) - e * (sums @ stored["offsets"].double().T)
    return y if bias is None else y + bias.double()


class Int4Linear(nn.Module):
    """y = x @ W.T + b with W in 4-bit groups; x, y and b float32; products in kazeia/native/int4.c."""

    splits_rows = True  # a prompt's product on the calling thread's team (kazeia/products.py)

    def __init__(self, stored: dict[str, torch.Tensor], bias: torch.Tensor | None, lib: ctypes.CDLL):
        super().__init__()
        packed = stored["qweight"]
        self.out_features, self.in_features = packed.shape[0], packed.shape[1] * 2
        groups = self.in_features // GROUP
        shapes = {"qweight": (self.out_features, self.in_features // 2), "steps": (self.out_features, groups),
                  "offsets": (self.out_features, groups), "factors": (self.out_features, 2)}  # fmt: skip
        kinds = {"qweight": torch.uint8, "steps": torch.uint8, "offsets": torch.int8, "factors": torch.float32}
        for name, shape in shapes.items():
            t = stored[name]
            if tuple(t.shape) != shape or t.dtype != kinds[name] or not supported(self.in_features):
                raise ValueError(f"int4 {name} is {tuple(t.shape)} {t.dtype}, expected {shape} {kinds[name]}")
            self.register_buffer(name, t.contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())
        self.lib = lib
        self._bound: tuple | None = None  # (the codes' address, the product with the addresses bound)
        self._bias: int | None = None

    @property
    def stored(self) -> dict[str, torch.Tensor]:
        """The stored form (`quantize_weight`), as a prepared checkpoint keeps it."""
        return {name: getattr(self, name) for name in ("qweight", "steps", "offsets", "factors")}

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None, lib: ctypes.CDLL) -> Int4Linear:
        return cls(quantize_weight(weight), bias, lib)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., in) float32 -> (..., out) float32."""
        rows = x.reshape(-1, self.in_features)
        if rows.dtype != torch.float32 or not rows.is_contiguous():
            rows = rows.float().contiguous()
        y = torch.empty(rows.shape[0], self.out_features, dtype=torch.float32)
        product = self._product()
        args = (rows.data_ptr(), self._bias, y.data_ptr(), self.out_features, self.in_features, rows.shape[0])
        threads = cpu.native_threads()
        if threads > 1:  # on a team (a prompt, its first frame: kazeia/frame.py): the same results, sooner
            status = self.lib.int4_gemm(*self._addresses(), *args, threads)
        else:
            status = product(*args)
        check(status, f"the int4 product of {rows.shape[0]} x {self.in_features} -> {self.out_features}")
        return y.view(*x.shape[:-1], self.out_features)

    def row_product(self) -> RowProduct:
        """`forward`: each row is rounded and summed on its own (kazeia/products.py)."""
        return self.forward

    def product_spec(self, dtype: torch.dtype) -> tuple | None:
        """This product for stack.c (`products.ProductSpec`) in activations of `dtype`, or None."""
        if dtype != torch.float32:
            return None
        return (ProductSpec.INT4, 0, *self._addresses(), address(self.bias), self.out_features, self.in_features)

    def _addresses(self) -> tuple[int, ...]:
        """The addresses of the stored tensors, in int4_gemv's order (codes, steps, offsets, factors)."""
        return tuple(t.data_ptr() for t in self.stored.values())

    def _product(self):
        """The native product with this layer's weight addresses bound (a decode step makes ~400
        of these calls a frame); bound again if the buffers have moved."""
        key = self.qweight.data_ptr()
        if self._bound is None or self._bound[0] != key:
            self._bias = address(self.bias)
            self._bound = (key, functools.partial(self.lib.int4_gemv, *self._addresses()))
        return self._bound[1]


def is_head(name: str) -> bool:
    """The products that make logits: the talker's codec head and the code predictor's heads."""
    return name.endswith("codec_head") or ".lm_head." in f".{name}"


def more_bits(layer: int, layers: int) -> bool:
    """The talker layers whose MLP down projection keeps 8 bits: the first and last eighths and
    every third between (the layers GGML's Q4_K_M gives 6 bits there)."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def eight_bit_products(model: nn.Module) -> set[str]:
    """Names of the products of a TTSModel that int4 keeps at 8 bits (`quant.QuantLinear`: int8
    weights with a scale a row, 16-bit activations): the output heads, and the talker's down
    projections in the `more_bits` layers: ~8 % of the bytes a frame reads at int4 (the code
    predictor's 15 heads, one a step). Kept in bfloat16 they were 15 % of them, and generation took
    ~10 % longer (BENCHMARKS.md). Only shapes int8.c takes (`quant.native_shape`: every released
    model's), so that each keeps rows independent of each other; any other stays int4."""
    layers = len(model.talker.layers)
    down = {f"talker.layers.{i}.mlp.down_proj" for i in range(layers) if more_bits(i, layers)}
    return {
        name
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and (is_head(name) or name in down) and native_shape(m.out_features, m.in_features)
    }


def quantize_linears(module: nn.Module, lib: ctypes.CDLL, after_each=None) -> None:
    """Replace every nn.Linear of a TTSModel in place: the `eight_bit_products` by int8
    QuantLinears, the rest by Int4Linears (float32 ones where the width does not allow units of 64).

    The heads keep 8 bits: their error goes straight into the logits that pick every code, and at 4
    bits it would double the talker's logit error (the quality guard, BENCHMARKS.md); GGML's Q4_K_M
    keeps its output weights at 6 bits for the same reason."""
    kept = eight_bit_products(module)
    eight = {id(m) for name, m in module.named_modules() if name in kept}

    def convert(linear: nn.Linear) -> nn.Module:
        if id(linear) in eight:
            return QuantLinear.from_float(linear.weight.float(), linear.bias, lib)
        if supported(linear.in_features):
            return Int4Linear.from_float(linear.weight, linear.bias, lib)
        return linear.float()

    replace_linears(module, convert, after_each, workers=cpu.usable_cpus())
