"""GGML's Q4_K_M weights on a loaded model, the yardstick of the int4 quality guard.

GGML's reference quantizers for its k-quants (Q4_K, Q6_K) are written here in numpy, following the
algorithms of ggml-quants.c (the `gguf` package ships their dequantizers but not these): the
blocks are packed in GGML's byte layout and read back with `gguf.quants.dequantize`, so the
weights a model gets are exactly what a GGML engine would multiply by (its activation rounding
aside). Q4_K_M is the usual mix: Q4_K everywhere, Q6_K for the output heads and for the value
projection and the MLP's down projection of the layers `use_more_bits` picks.

On the CPU a GGML engine multiplies k-quant weights by activations rounded to Q8_K (8 bits, one
scale per 256 values: `quantize_row_q8_K_ref`); `apply_q4_k_m(..., activations="q8_k")` does the
same to every product's input, so the model computes what such an engine computes, and
`activations="float"` keeps them exact (a stricter yardstick than any GGML engine meets). Test
and benchmark code only: needs `gguf` (MIT), which Kazeia does not depend on at run time.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch
from torch import nn

from ..engine import Engine
from ..frame import FrameStep, voiced_cache

QK_K = 256  # weights per super-block


def _rint(x: np.ndarray) -> np.ndarray:
    return np.rint(x).astype(np.int32)  # half to even, as ggml's nearest_int


def _qkx2(x: np.ndarray, w: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int):
    """make_qkx2_quants over rows of x (N, n) with weights w: (scale, min as a positive offset, codes)."""
    low = np.minimum(x.min(axis=1), 0.0)
    high = x.max(axis=1)
    span = high - low
    flat = span == 0
    span_safe = np.where(flat, 1.0, span)
    sum_w, sum_x = w.sum(axis=1), (w * x).sum(axis=1)
    iscale = nmax / span_safe
    scale = 1.0 / iscale
    codes = np.clip(_rint(iscale[:, None] * (x - low[:, None])), 0, nmax)
    best = (w * (scale[:, None] * codes + low[:, None] - x) ** 2).sum(axis=1)
    best_min = low.copy()
    for step in range(nstep + 1):
        iscale = (rmin + rdelta * step + nmax) / span_safe
        aux = np.clip(_rint(iscale[:, None] * (x - low[:, None])), 0, nmax)
        sum_l, sum_l2, sum_xl = (w * aux).sum(1), (w * aux * aux).sum(1), (w * aux * x).sum(1)
        det = sum_w * sum_l2 - sum_l * sum_l
        ok = det > 0
        det_safe = np.where(ok, det, 1.0)
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / det_safe
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det_safe
        positive = this_min > 0
        this_min = np.where(positive, 0.0, this_min)
        this_scale = np.where(positive, sum_xl / np.where(sum_l2 > 0, sum_l2, 1.0), this_scale)
        err = (w * (this_scale[:, None] * aux + this_min[:, None] - x) ** 2).sum(axis=1)
        better = ok & (err < best)
        codes = np.where(better[:, None], aux, codes)
        best = np.where(better, err, best)
        scale, best_min = np.where(better, this_scale, scale), np.where(better, this_min, best_min)
    scale = np.where(flat, 0.0, scale)
    return scale.astype(np.float32), (-best_min).astype(np.float32), codes


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """(N * 256,) float32 -> N Q4_K blocks (N, 144) uint8, as quantize_row_q4_K_ref."""
    blocks = x.reshape(-1, QK_K).astype(np.float32)
    n = blocks.shape[0]
    sub = blocks.reshape(n * 8, 32)
    av = np.sqrt((sub * sub).sum(axis=1) / 32)
    scales, mins, _ = _qkx2(sub, av[:, None] + np.abs(sub), 15, -1.0, 0.1, 20)
    scales, mins = scales.reshape(n, 8), mins.reshape(n, 8)
    max_scale, max_min = scales.max(axis=1), mins.max(axis=1)
    inv_scale = np.where(max_scale > 0, 63.0 / np.where(max_scale > 0, max_scale, 1), 0.0)
    inv_min = np.where(max_min > 0, 63.0 / np.where(max_min > 0, max_min, 1), 0.0)
    ls = np.minimum(_rint(inv_scale[:, None] * scales), 63)
    lm = np.minimum(_rint(inv_min[:, None] * mins), 63)
    packed = np.zeros((n, 12), dtype=np.uint8)
    packed[:, 0:4] = ls[:, 0:4]
    packed[:, 4:8] = lm[:, 0:4]
    packed[:, 8:12] = (ls[:, 4:8] & 0xF) | ((lm[:, 4:8] & 0xF) << 4)
    packed[:, 0:4] |= ((ls[:, 4:8] >> 4) << 6).astype(np.uint8)
    packed[:, 4:8] |= ((lm[:, 4:8] >> 4) << 6).astype(np.uint8)
    d = (max_scale / 63.0).astype(np.float16)
    dmin = (max_min / 63.0).astype(np.float16)
    step = d.astype(np.float32)[:, None] * ls  # the stored values, as the quantizer re-reads them
    offset = dmin.astype(np.float32)[:, None] * lm
    x8 = blocks.reshape(n, 8, 32)
    step_safe = np.where(step == 0, 1.0, step)
    codes = np.clip(_rint((x8 + offset[..., None]) / step_safe[..., None]), 0, 15)
    codes = np.where((step == 0)[..., None], 0, codes).reshape(n, 4, 2, 32)
    qs = (codes[:, :, 0] | (codes[:, :, 1] << 4)).astype(np.uint8).reshape(n, 128)
    head = np.stack([d, dmin], axis=1).view(np.uint8).reshape(n, 4)
    return np.concatenate([head, packed, qs], axis=1)


def _qx(x: np.ndarray, nmax: int):
    """make_qx_quants with rmse_type 1 over rows of x (N, n): (scale, codes + nmax)."""
    idx = np.abs(x).argmax(axis=1)
    amax = np.abs(x).max(axis=1)
    peak = x[np.arange(x.shape[0]), idx]
    tiny = amax < 1e-15
    peak_safe = np.where(tiny, 1.0, peak)
    w = x * x

    def attempt(iscale):
        q = np.clip(_rint(iscale[:, None] * x), -nmax, nmax - 1)
        return q, (w * x * q).sum(1), (w * q * q).sum(1)

    codes, sumlx, suml2 = attempt(-nmax / peak_safe)
    scale = np.where(suml2 > 0, sumlx / np.where(suml2 > 0, suml2, 1), 0.0)
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        q, lx, l2 = attempt(-(nmax + 0.1 * step) / peak_safe)
        better = (l2 > 0) & (lx * lx > best * l2)
        codes = np.where(better[:, None], q, codes)
        new_scale = lx / np.where(l2 > 0, l2, 1)
        scale = np.where(better, new_scale, scale)
        best = np.where(better, new_scale * lx, best)
    scale = np.where(tiny, 0.0, scale)
    return scale.astype(np.float32), tiny


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """(N * 256,) float32 -> N Q6_K blocks (N, 210) uint8, as quantize_row_q6_K_ref."""
    blocks = x.reshape(-1, QK_K).astype(np.float32)
    n = blocks.shape[0]
    scales, _ = _qx(blocks.reshape(n * 16, 16), 32)
    scales = scales.reshape(n, 16)
    pick = np.abs(scales).argmax(axis=1)
    max_scale = scales[np.arange(n), pick]
    zero = np.abs(max_scale) < 1e-15
    iscale = -128.0 / np.where(zero, 1.0, max_scale)
    d = np.where(zero, 0.0, 1.0 / iscale).astype(np.float16)
    sc = np.minimum(_rint(iscale[:, None] * scales), 127).astype(np.int8)
    sc = np.where(zero[:, None], 0, sc).astype(np.int8)
    step = d.astype(np.float32)[:, None] * sc.astype(np.float32)
    x16 = blocks.reshape(n, 16, 16)
    step_safe = np.where(step == 0, 1.0, step)
    codes = np.clip(_rint(x16 / step_safe[..., None]), -32, 31) + 32
    codes = np.where((step == 0)[..., None], 32, codes).reshape(n, 2, 4, 32)
    low, high = codes & 0xF, codes >> 4
    ql = np.concatenate([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], axis=2)
    qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    return np.concatenate(
        [ql.astype(np.uint8).reshape(n, 128), qh.astype(np.uint8).reshape(n, 64), sc.view(np.uint8),
         d.view(np.uint8).reshape(n, 2)], axis=1,
    )  # fmt: skip


def round_trip(weight: torch.Tensor, kind: str) -> torch.Tensor:
    """`weight` as GGML stores it in `kind` ("Q4_K" or "Q6_K"), read back as float32. Rows whose
    width is not a multiple of 256 (tiny test models) are quantized as one flat run of blocks."""
    from gguf import GGMLQuantizationType, quants

    x = weight.detach().float().numpy().reshape(-1)
    if x.size % QK_K:
        raise ValueError(f"{kind} needs a multiple of {QK_K} weights, got {x.size}")
    quantizer = {"Q4_K": quantize_q4_k, "Q6_K": quantize_q6_k}[kind]
    blocks = quantizer(x)
    back = quants.dequantize(blocks.reshape(-1), GGMLQuantizationType[kind])
    return torch.from_numpy(np.asarray(back, dtype=np.float32).reshape(weight.shape).copy())


def _unpack(model: nn.Module) -> None:
    """oneDNN-packed products (kazeia.matmul.PackedLinear, where the CPU runs them) back to plain
    Linears, whose weights can be rewritten."""
    from kazeia.matmul import PackedLinear

    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, PackedLinear):
                plain = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None)
                plain.weight.data = child.weight.to_dense()
                if child.bias is not None:
                    plain.bias.data = child.bias
                setattr(parent, name, plain.requires_grad_(False))


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's choice of the layers whose v and down projections Q4_K_M keeps at Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def q8_k(x: torch.Tensor) -> torch.Tensor:
    """x (..., n) rounded as GGML's Q8_K does and read back: per block of 256 (of n when n is not
    a multiple of 256: tiny test models), d = -max / 127 where max is the value of largest
    magnitude, codes round(x / d) at most 127."""
    n = x.shape[-1]
    block = QK_K if n % QK_K == 0 else n
    v = x.float().reshape(-1, block)
    peak = v.gather(1, v.abs().argmax(dim=1, keepdim=True))
    iscale = torch.where(peak != 0, -127.0 / torch.where(peak != 0, peak, 1.0), 0.0)
    q = torch.round(v * iscale).clamp_(max=127)
    d = torch.where(iscale != 0, 1.0 / torch.where(iscale != 0, iscale, 1.0), 0.0)
    return (q * d).reshape(x.shape).to(x.dtype)


@torch.no_grad()
def apply_q4_k_m(engine: Engine, activations: str = "q8_k") -> None:
    """Replace, in place, every product weight of a float32 engine's model (projections fused)
    and the text embedding by their Q4_K_M round trip; with `activations="q8_k"` every product
    also rounds its input to Q8_K first (the stacks then run their eager steps, where a module's
    input passes through its hooks). The engine's frame step is made again over the changed model
    (what it chose at load, and the voice positions it kept, no longer hold)."""
    if activations not in ("q8_k", "float"):
        raise ValueError(f"activations must be 'q8_k' or 'float', got {activations!r}")
    model = engine.model
    _unpack(model)
    stacks = (model.talker, model.code_predictor)
    done: set[int] = set()
    for stack in stacks:
        for i, layer in enumerate(stack.layers):
            more = use_more_bits(i, len(stack.layers))
            attn, mlp = layer.self_attn, layer.mlp
            qkv = attn.qkv_proj.weight
            v_rows = attn.kv_heads * attn.head_dim
            qkv[:-v_rows] = round_trip(qkv[:-v_rows], "Q4_K")
            qkv[-v_rows:] = round_trip(qkv[-v_rows:], "Q6_K" if more else "Q4_K")
            for linear, kind in ((attn.o_proj, "Q4_K"), (mlp.gate_up_proj, "Q4_K"),
                                 (mlp.down_proj, "Q6_K" if more else "Q4_K")):  # fmt: skip
                linear.weight.copy_(round_trip(linear.weight, kind))
            done.update(id(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj))
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if id(module) in done or not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            continue
        if isinstance(module, nn.Embedding) and module is not model.talker.text_embedding:
            continue  # codec embeddings: looked up, not multiplied; kept as they are
        head = "head" in name.rsplit(".", 1)[-1]
        module.weight.copy_(round_trip(weight, "Q6_K" if head else "Q4_K"))
    if activations == "float":
        from kazeia import native

        model.choose_steps(native.library())  # the C glue again, over the plain products
    if activations == "q8_k":
        for stack in stacks:
            stack.native_step = None  # the C glue calls the products' forward, past any hook
        for module in model.modules():
            if isinstance(getattr(module, "weight", None), torch.Tensor) and not isinstance(module, nn.Embedding):
                if module.weight.dim() == 2:
                    module.register_forward_pre_hook(lambda _, args: (q8_k(args[0]), *args[1:]))
    engine.runtime = replace(engine.runtime, step=FrameStep(model, voiced_cache()))
