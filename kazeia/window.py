"""The vocoder's sliding-window transformer (its pre-transformer): pre-norm layers with layer
scales over the latent frames, each frame attending to itself and the frames of its window before it.

Scope: `WindowCache` (the keys and values a stream carries between chunks, kazeia/vocoder.py's
`VocoderState`), `WindowBlock`, `Transformer`, eager (layers.Attention, a window mask) or, with the native
library, every value computed alone (vocoder.c's `window_attend`, decode.c's norm and SiLU, conv.c's
products), so a frame's output never depends on the chunk it falls in. Tensors only.
Shapes: B = batch, n = frames of a chunk, keep = window - 1 frames carried.
"""

from __future__ import annotations

import torch
from torch import nn

from .config import VocoderConfig
from .layers import Attention, LayerScale, RMSNorm, Rotary, SwiGLU, causal_mask


class WindowCache:
    """Keys and values of the last `keep` frames of one sliding-window attention layer.

    Fixed shape (B, nkv, keep, hd), zeros for frames before frame 0 (masked out). Serves as the
    cache of `layers.Attention` (eager): `write` appends n frames and keeps the last `keep`; `view`
    returns the keep + n frames the new queries may see, oldest first. The native attention
    (vocoder.c's `window_attend`) reads and replaces k and v in place.
    """

    def __init__(self, k: torch.Tensor, v: torch.Tensor):
        self.k, self.v = k, v  # (B, nkv, keep, hd)
        self._k, self._v = k, v  # (B, nkv, keep + n, hd) during a call

    def write(self, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        keep = self.k.shape[2]
        self._k = torch.cat((self.k, k), dim=2)
        self._v = torch.cat((self.v, v), dim=2)
        drop = self._k.shape[2] - keep
        self.k, self.v = self._k[:, :, drop:].clone(), self._v[:, :, drop:].clone()

    def view(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._k, self._v


class WindowBlock(nn.Module):
    """Pre-norm transformer layer with per-channel layer scales on both residual branches."""

    def __init__(self, cfg: VocoderConfig):
        super().__init__()
        dim = cfg.hidden_size
        self.self_attn = Attention(dim, cfg.num_heads, cfg.num_heads, cfg.head_dim, qk_norm_eps=None)
        self.mlp = SwiGLU(dim, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(dim, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(dim, cfg.rms_norm_eps)
        self.self_attn_layer_scale = LayerScale(dim)
        self.mlp_layer_scale = LayerScale(dim)
        self.lib = None  # kazeia/native's library: `_native` (Vocoder.prepare)

    def forward(self, h, rope, cache: WindowCache, start: int, mask: torch.Tensor | None) -> torch.Tensor:
        """h (B, n, dim); mask (n, keep + n) bool (eager)."""
        if self.lib is not None:
            return self._native(h, rope, cache, start)
        h = h + self.self_attn_layer_scale(self.self_attn(self.input_layernorm(h), rope, cache, start, mask))
        return h + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(h)))

    def _native(self, h: torch.Tensor, rope, cache: WindowCache, start: int) -> torch.Tensor:
        """The same layer, every value computed alone: decode.c's norm and SiLU, vocoder.c's window
        attention, `TiledLinear` products (float32)."""
        attn, mlp, lib = self.self_attn, self.mlp, self.lib
        B, n, _ = h.shape
        nq, nkv, hd = attn.heads, attn.kv_heads, attn.head_dim
        qkv = attn.qkv_proj(_rms_norm(lib, h, self.input_layernorm))  # (B, n, (nq + 2 nkv) hd)
        attended = h.new_empty(B, n, nq * hd)
        cos, sin = rope
        failed = lib.window_attend(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), cache.k.data_ptr(),
                                   cache.v.data_ptr(), attended.data_ptr(), B, n, nq, nkv, hd, cache.k.shape[2],
                                   start)  # fmt: skip
        if failed:
            raise MemoryError("window_attend: out of memory")
        h = h + self.self_attn_layer_scale(attn.o_proj(attended))
        gate_up = mlp.gate_up_proj(_rms_norm(lib, h, self.post_attention_layernorm))  # (B, n, 2 * inner)
        inner = gate_up.shape[-1] // 2
        activated = h.new_empty(B, n, inner)
        lib.silu_mul(gate_up.data_ptr(), activated.data_ptr(), B * n, inner, 0)
        return h + self.mlp_layer_scale(mlp.down_proj(activated))


def _rms_norm(lib, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
    """decode.c's RMSNorm of each row of x (..., dim), float32."""
    x = x.contiguous()
    out = torch.empty_like(x)
    dim = x.shape[-1]
    lib.add_rms_norm(x.data_ptr(), None, norm.weight.data_ptr(), out.data_ptr(), x.numel() // dim, dim, norm.eps, 0)
    return out


class Transformer(nn.Module):
    """latent -> hidden, sliding-window layers with RoPE at absolute frame positions, norm, -> latent."""

    def __init__(self, cfg: VocoderConfig):
        super().__init__()
        self.window = cfg.sliding_window
        self.input_proj = nn.Linear(cfg.latent_dim, cfg.hidden_size)
        self.layers = nn.ModuleList(WindowBlock(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.output_proj = nn.Linear(cfg.hidden_size, cfg.latent_dim)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta)
        self.lib = None  # kazeia/native's library (Vocoder.prepare): every layer `WindowBlock._native`

    def forward(self, x: torch.Tensor, caches: list[WindowCache], start: int) -> torch.Tensor:
        """x (B, n, latent) at frames [start, start + n) -> (B, n, latent)."""
        n, keep = x.shape[1], caches[0].k.shape[2]
        rope = self.rotary.span(start, n, x.dtype, x.device)
        mask = None
        if self.lib is None:
            mask = causal_mask(n, keep + n, keep, x.device, self.window)  # keys local: frame start-keep+j
            mask &= torch.arange(keep + n, device=x.device)[None, :] >= keep - start  # no frames before 0
        h = self.input_proj(x)
        for layer, cache in zip(self.layers, caches, strict=True):
            h = layer(h, rope, cache, start, mask)
        h = self.norm(h) if self.lib is None else _rms_norm(self.lib, h, self.norm)
        return self.output_proj(h)
