"""Transformer building blocks shared by the talker, the code predictor and the vocoder.

Tensors only: no strings, files or options. Shapes use B = batch, T = new positions,
S = cached positions, nh / nkv = query / key-value heads, hd = head dim.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from .config import CheckpointError, TransformerConfig


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, cast back, then scaled (Qwen3 order)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x * rsqrt(mean(x^2) + eps)), the normalisation in float32 and rounded to x's dtype
    before the scale (the reference's order); `weight` is (hd,) or one row per head (heads, hd).
    `F.rms_norm` upcasts reduced-precision inputs itself, so this is one or two calls, bit-identical
    to writing the steps out (tests/test_layers.py)."""
    if x.dtype == torch.float32 and weight.dim() == 1:
        return F.rms_norm(x, weight.shape, weight, eps)  # the same two roundings, in one call
    return F.rms_norm(x, weight.shape[-1:], None, eps) * weight


class Rotary(nn.Module):
    """Plain rotary position embedding, rotate-half convention, angles in float32.

    Returns (cos, sin) shaped (T, 1, hd) for the (B, T, heads, hd) layout, `sin` with its first
    half negated so that `apply_rotary` needs no rotate-half copy. `span` serves consecutive
    positions from a table built once (and grown by doubling), so decoding steps compute nothing.
    """

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        self.head_dim, self.theta = head_dim, theta
        self.register_buffer("inv_freq", torch.empty(head_dim // 2), persistent=False)
        self.init_buffers()
        self._tables: dict[tuple[torch.dtype, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}

    def init_buffers(self, device: torch.device | str | None = None) -> None:
        """(Re)compute the derived buffer, e.g. after the module was built on the meta device.
        Computed on the CPU whatever the default device: the first such operation on the meta
        device makes PyTorch import its Python decompositions, a delay on every load."""
        exponent = torch.arange(0, self.head_dim, 2, dtype=torch.int64, device="cpu").float() / self.head_dim
        inv_freq = 1.0 / (self.theta**exponent)
        self.inv_freq = inv_freq if device is None else inv_freq.to(device)
        self._tables = {}

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (T,) int64 -> cos, signed sin (T, 1, hd) in `dtype`."""
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]  # (T, hd/2)
        cos, sin = freqs.cos(), freqs.sin()
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)
        return cos.to(dtype)[:, None], sin.to(dtype)[:, None]

    def span(self, start: int, length: int, dtype: torch.dtype, device: torch.device):
        """`forward(arange(start, start + length))`, sliced from the cached table."""
        key = (dtype, torch.device(device))
        cos, sin = self._tables.get(key, (None, None))
        if cos is None or cos.shape[0] < start + length:
            size = max(256, 2 * (start + length))
            cos, sin = self._tables[key] = self(torch.arange(size, device=device), dtype)
        return cos[start : start + length], sin[start : start + length]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, T, heads, hd); cos / signed sin (T, 1, hd): x*cos + rotate_half(x)*sin."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


class LayerScale(nn.Module):
    """Per-channel scale of a residual branch (the speech tokenizer's transformers)."""

    def __init__(self, dim: int):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x


CODEBOOK_EPS = 1e-5  # clamp on cluster_usage when turning running sums into codebook vectors


def codebook_vectors(released: Mapping[str, torch.Tensor], total: str, usage: str, where: str = "") -> torch.Tensor:
    """One codebook of the speech tokenizer, rebuilt from the running sums it was released as:
    (size, dim) = released[total] / clamp(released[usage], CODEBOOK_EPS), in float32. A missing
    tensor is a CheckpointError naming it (and the file, `where`)."""
    for name in (total, usage):
        if name not in released:
            raise CheckpointError(f"{where + ': ' if where else ''}missing tensor {name}")
    return released[total].float() / released[usage].float().clamp(min=CODEBOOK_EPS)[:, None]


class KVCache:
    """Preallocated keys and values of one attention layer: (B, nkv, capacity, hd) each.

    The owner writes positions [start, start + T) with `write` and reads the filled prefix
    with `view(end)`; a write past the capacity is an error (the talker's owner grows its cache
    by whole blocks before that: frame.TalkerCache).

    The memory is left as allocated: every reader (`view`, kazeia/native's attention) stops at the
    last position written, so nothing unwritten is ever read (tests/test_batch.py fills it with
    NaN). Zeroing it cost a prompt its whole capacity in writes: a talker's 512 positions are
    117 MB at the real size, ~18 ms on the first frame's path, and as much memory traffic taken
    from the streams already running.
    """

    def __init__(self, batch: int, kv_heads: int, capacity: int, head_dim: int, device, dtype):
        shape = (batch, kv_heads, capacity, head_dim)
        self.k = torch.empty(shape, device=device, dtype=dtype)
        self.v = torch.empty(shape, device=device, dtype=dtype)

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def write(self, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        end = start + k.shape[2]
        if end > self.capacity:
            raise RuntimeError(f"KV cache overflow: position {end} > capacity {self.capacity}")
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v

    def view(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[:, :, :end], self.v[:, :, :end]


class WindowCacheLike(Protocol):
    """What `Attention` needs of a cache: `write` new keys/values, `view` what the queries see
    (KVCache; the vocoder's sliding-window cache)."""

    def write(self, start: int, k: torch.Tensor, v: torch.Tensor) -> None: ...

    def view(self, end: int) -> tuple[torch.Tensor, torch.Tensor]: ...


class Attention(nn.Module):
    """Grouped-query self-attention with RoPE; optional per-head q/k RMSNorm before it (Qwen3);
    over a KV cache (decoders, the vocoder's window) or none (the speech encoder)."""

    def __init__(self, dim: int, heads: int, kv_heads: int, head_dim: int, qk_norm_eps: float | None):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(dim, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(dim, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(dim, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, dim, bias=False)
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(head_dim, qk_norm_eps)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.qkv_proj: nn.Module | None = None  # set by `fuse()`
        self.register_buffer("qk_norm_weight", None, persistent=False)  # set by `fuse()`

    def fuse(self) -> None:
        """Replace q/k/v_proj by one projection (one weight read, one kernel call per step) and
        the two qk-norm weights by one (heads + kv_heads, hd) scale."""
        self.qkv_proj = fuse_linears(self.q_proj, self.k_proj, self.v_proj)
        del self.q_proj, self.k_proj, self.v_proj
        if self.q_norm is not None and not self.q_norm.weight.is_meta:  # else init_buffers, once loaded
            self.qk_norm_weight = self._qk_scale()

    def init_buffers(self, device) -> None:
        """After the weights are assigned (kazeia/checkpoint.py): the fused qk-norm scale from the
        loaded norms, when the projections were fused before loading (a prepared checkpoint)."""
        if self.qkv_proj is not None and self.q_norm is not None:
            self.qk_norm_weight = self._qk_scale()

    def _qk_scale(self) -> torch.Tensor:
        q, k = self.q_norm.weight.detach(), self.k_norm.weight.detach()
        return torch.cat((q.expand(self.heads, -1), k.expand(self.kv_heads, -1)))

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: KVCache | WindowCacheLike | None = None,
        start: int = 0,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x (B, T, dim) at positions [start, start+T) of `cache`; mask (T, S) bool or None = causal.
        Without a cache: self-attention over x alone (positions 0..T-1, causal).

        Queries and keys travel together as (B, T, heads + kv_heads, hd): one norm, one rotation.
        The cache may hold a wider dtype than x (float32 caches for reduced-precision weights on the
        CPU, see `cache_dtype`); attention then runs in the cache's dtype.
        """
        B, T, _ = x.shape
        nq, nkv, hd = self.heads, self.kv_heads, self.head_dim
        if self.qkv_proj is not None:
            qk, v = self.qkv_proj(x).view(B, T, nq + 2 * nkv, hd).split((nq + nkv, nkv), dim=2)
        else:
            qk = torch.cat((self.q_proj(x), self.k_proj(x)), dim=-1).view(B, T, nq + nkv, hd)
            v = self.v_proj(x).view(B, T, nkv, hd)
        if self.q_norm is not None:
            scale = self.qk_norm_weight if self.qk_norm_weight is not None else self._qk_scale()
            qk = rms_norm(qk, scale, self.q_norm.eps)
        qk = apply_rotary(qk, *rope).transpose(1, 2)  # (B, nq + nkv, T, hd)
        if cache is None:
            keys, values = qk[:, nq:], v.transpose(1, 2)  # (B, nkv, T, hd)
        else:
            cache.write(start, qk[:, nq:], v.transpose(1, 2))
            keys, values = cache.view(start + T)  # (B, nkv, S, hd)
        if mask is None and T > 1 and start > 0:
            mask = causal_mask(T, start + T, start, x.device)
        out = F.scaled_dot_product_attention(
            qk[:, :nq].to(keys.dtype),
            keys,
            values,
            attn_mask=mask,
            is_causal=mask is None and T > 1,
            enable_gqa=nq != nkv,
        )
        return self.o_proj(out.to(x.dtype).transpose(1, 2).reshape(B, T, nq * hd))


def cache_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The KV-cache dtype for activations of `dtype` on `device`: float32 on the CPU, where
    attention over bfloat16/float16 keys is several times slower than over float32 ones (and the
    cache is small next to the weights); the activation dtype elsewhere."""
    return torch.float32 if torch.device(device).type == "cpu" else dtype


def causal_mask(T: int, S: int, start: int, device, window: int | None = None) -> torch.Tensor:
    """(T, S) bool: query i (absolute start+i) sees key j iff j <= start+i (and start+i-j < window)."""
    q = torch.arange(start, start + T, device=device)[:, None]
    k = torch.arange(S, device=device)[None, :]
    allowed = k <= q
    if window is not None:
        allowed &= k > q - window
    return allowed


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)
        self.gate_up_proj: nn.Module | None = None  # set by `fuse()`

    def fuse(self) -> None:
        """Replace gate/up_proj by one projection."""
        self.gate_up_proj = fuse_linears(self.gate_proj, self.up_proj)
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is None:
            gate, up = self.gate_proj(x), self.up_proj(x)
        else:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


def table(rows: int, dim: int) -> nn.Embedding:
    """An embedding table to be loaded from a checkpoint: left uninitialized (random init would be
    wasted, and the first one on the meta device makes PyTorch import its decompositions, a delay on
    every load)."""
    return nn.Embedding(rows, dim, _weight=torch.empty(rows, dim))


def fuse_linears(*linears: nn.Linear) -> nn.Linear:
    """One bias-free Linear whose output is the concatenation of `linears`' outputs. On the meta
    device (a prepared checkpoint's shapes) only the shape is made: the first operation there makes
    PyTorch import its decompositions."""
    if any(lin.weight.is_meta for lin in linears):
        weight = torch.empty(sum(lin.out_features for lin in linears), linears[0].in_features, device="meta")
    else:
        weight = torch.cat([lin.weight for lin in linears], dim=0)
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    fused.weight = nn.Parameter(weight, requires_grad=False)
    return fused


def fuse_projections(module: nn.Module, after_each: Callable[[], None] | None = None) -> None:
    """Fuse the q/k/v and gate/up projections of every attention and MLP inside `module`.
    `after_each` runs after each fusion (loading passes one that returns freed memory to the OS)."""
    # Collect the parents only: a list holding the old Linear modules would keep every unfused
    # weight alive until the end, doubling the projections' memory at the peak.
    for sub in [m for m in module.modules() if isinstance(m, (Attention, SwiGLU))]:
        sub.fuse()
        if after_each is not None:
            after_each()


class Block(nn.Module):
    """Pre-norm Qwen3 decoder layer: h += attn(norm(h)); h += mlp(norm(h))."""

    def __init__(self, dim: int, heads: int, kv_heads: int, head_dim: int, hidden: int, eps: float):
        super().__init__()
        self.input_layernorm = RMSNorm(dim, eps)
        self.self_attn = Attention(dim, heads, kv_heads, head_dim, qk_norm_eps=eps)
        self.post_attention_layernorm = RMSNorm(dim, eps)
        self.mlp = SwiGLU(dim, hidden)

    def forward(self, h, rope, cache: KVCache, start: int, mask=None) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), rope, cache, start, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class Decoder(nn.Module):
    """A stack of pre-norm `Block`s over per-layer KV caches, then the final norm: the common part
    of the talker and the code predictor.

    `native_step` is the implementation of decoding steps (one sequence, 1..native.MAX_POSITIONS
    new positions; a prompt's too where its `prompts`), chosen once when the model is loaded
    (kazeia/model.py): kazeia/native's C glue between the products, or None for these eager layers,
    which run the other prompts.
    """

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.layers = nn.ModuleList(
            Block(
                cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size, cfg.rms_norm_eps
            )
            for _ in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta)
        self.native_step: Callable | None = None

    def new_cache(self, capacity: int, batch: int = 1) -> list[KVCache]:
        """One KVCache per layer, in the activations' cache dtype (`cache_dtype`)."""
        first = self.layers[0].self_attn
        w = self.norm.weight  # activation dtype and device (linears may be quantized)
        dtype = cache_dtype(w.dtype, w.device)
        return [KVCache(batch, first.kv_heads, capacity, first.head_dim, w.device, dtype) for _ in self.layers]

    def decode(self, x: torch.Tensor, cache: list[KVCache], start: int, last: bool = False) -> torch.Tensor:
        """x (B, T, H) at positions [start, start + T) of `cache` -> final-normed hidden (B, T, H),
        or the last position's alone (B, 1, H) where `last`: the same values, sooner where the
        native step skips the others' work in the last layer (a prompt's)."""
        rope = self.rotary.span(start, x.shape[1], x.dtype, x.device)
        step = self.native_step
        if step is not None and step.applies(x, cache):
            return step(x, rope, cache, start, last)
        for layer, layer_cache in zip(self.layers, cache, strict=True):
            x = layer(x, rope, layer_cache, start)
        x = self.norm(x)
        return x[:, -1:] if last else x
