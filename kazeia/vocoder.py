"""The speech-tokenizer decoder: 16 codes per 80 ms frame -> 24 kHz waveform, offline and streaming.

Scope: RVQ dequantization, the causal pre-conv, the sliding-window transformer, the ConvNeXt
pre-upsampling and the SnakeBeta decoder of Qwen3-TTS-Tokenizer-12Hz. Every layer is causal, so a
chunk decoded on a `VocoderState` continues exactly where the previous chunk stopped: any split of
a code sequence into chunks gives the audio of one full decode, 1920 samples per frame, without
recomputing earlier frames. Non-goals: the encoder (audio -> codes) and the speaker encoder.

Shapes: B = batch, n = frames in a chunk, L = samples at a layer's rate, C = channels. Up to the
upsampling, activations are channel-major (B, C, L); the SnakeBeta decoder runs time-major (B, L, C),
the layout oneDNN's convolutions are fastest in here (96 channels at 24 kHz: 1.4x; see
`DecoderConv`), and its SnakeBeta runs in one pass of compiled code where there is some.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from . import native
from .checkpoint import assign, load_tensors
from .config import CheckpointError, VocoderConfig
from .layers import (
    LINEAR_POINTWISE,
    Attention,
    RMSNorm,
    Rotary,
    SwiGLU,
    can_pack,
    causal_mask,
    fuse_projections,
    pack_linears,
)

SEMANTIC_QUANTIZERS = 1  # codebook 0 has its own output projection (rvq_first); the others share one
CODEBOOK_EPS = 1e-5  # clamp on cluster_usage when turning running sums into codebook vectors
SNAKE_EPS = 1e-9
CONVNEXT_NORM_EPS = 1e-6
INTEGER_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
# Frames per decode_chunk call in `forward`: bounds memory and keeps activations in cache (32 was
# the fastest measured on a 2-core CPU: 35 ms/frame against 51 for 96-frame blocks). Never changes the audio.
OFFLINE_BLOCK = 32
# Inputs per call from which a decoder block's transposed conv runs as one polyphase conv
# (`DecoderTransConv`): the measured break-even is near 128 (the weight's per-call reorder against
# the faster arithmetic).
POLYPHASE_MIN_POSITIONS = 256
# A decoder conv whose weight has this many times more values than its input runs as a matrix
# product (`DecoderConv`): measured, it wins from ~80x (convs with 64x or less stay convs).
GEMM_MIN_WEIGHT_RATIO = 64


class WindowCache:
    """Keys and values of the last `keep` frames of one sliding-window attention layer.

    Fixed shape (B, nkv, keep, hd), zeros for frames before frame 0 (masked out). Serves as the
    cache of `layers.Attention`: `write` appends n frames and keeps the last `keep`; `view` returns
    the keep + n frames the new queries may see, oldest first.
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


@dataclass
class VocoderState:
    """Everything a streaming decode carries between chunks; `Vocoder.decode_chunk` updates it in place."""

    tails: list[torch.Tensor]  # per stateful conv, module order: its last inputs (B, C_in, keep), zeros at start
    caches: list[WindowCache]  # per transformer layer: RoPE'd keys and values of the last window-1 frames
    position: int = 0  # frames decoded so far = RoPE position of the next frame

    @property
    def batch(self) -> int:
        return self.caches[0].k.shape[0]


class CausalConv(nn.Module):
    """Conv1d whose (k-1)*d left inputs come from the state: zeros at the start (the reference's pad)."""

    def __init__(self, cin: int, cout: int, kernel: int, dilation: int = 1, groups: int = 1):
        super().__init__()
        self.conv = nn.Conv1d(cin, cout, kernel, dilation=dilation, groups=groups)
        self.keep = (kernel - 1) * dilation  # inputs carried to the next chunk
        self.slot = -1  # index into VocoderState.tails, set by Vocoder

    def forward(self, x: torch.Tensor, state: VocoderState) -> torch.Tensor:
        """x (B, C_in, L) -> (B, C_out, L)."""
        if self.keep == 0:
            return self.conv(x)
        x = torch.cat((state.tails[self.slot], x), dim=-1)  # (B, C_in, keep + L)
        state.tails[self.slot] = x[..., -self.keep :].clone()
        return self.conv(x)

    def new_tail(self, batch: int, **like) -> torch.Tensor:
        return torch.zeros(batch, self.conv.in_channels, self.keep, **like)


class TransConv(nn.Module):
    """ConvTranspose1d(k, stride s) cut to exactly L*s outputs, the reference's right-only trim.

    Output m depends on inputs m//s back to m//s - (ceil(k/s) - 1), so the state keeps that many
    previous inputs: one for k = 2s, none for k = s.
    """

    def __init__(self, cin: int, cout: int, kernel: int, stride: int):
        super().__init__()
        self.conv = nn.ConvTranspose1d(cin, cout, kernel, stride=stride)
        self.stride = stride
        self.keep = -(-kernel // stride) - 1
        self.slot = -1

    def forward(self, x: torch.Tensor, state: VocoderState) -> torch.Tensor:
        """x (B, C_in, L) -> (B, C_out, L*s).

        Computed as one matrix product per input sample (each input spreads k outputs) and an
        overlap-add of the `keep` previous inputs' spill-over: the same sums as ConvTranspose1d, but
        without its slow small-input kernel on the CPU.
        """
        B, _, L = x.shape
        s, (cin, cout, k) = self.stride, self.conv.weight.shape
        if self.keep > 0:
            x = torch.cat((state.tails[self.slot], x), dim=-1)  # (B, C_in, keep + L)
            state.tails[self.slot] = x[..., -self.keep :].clone()
        spread = torch.matmul(x.transpose(1, 2), self.conv.weight.reshape(cin, cout * k))  # (B, keep + L, C_out*k)
        spread = spread.view(B, -1, cout, k // s, s)  # (B, keep + L, C_out, taps, s)
        y = spread[:, self.keep :, :, 0]
        for tap in range(1, k // s):  # input t - tap adds its tap-th block of s outputs
            y = y + spread[:, self.keep - tap : self.keep - tap + L, :, tap]
        y = y.permute(0, 2, 1, 3).reshape(B, cout, L * s)  # (B, C_out, L*s), a fresh copy
        return y.add_(self.conv.bias[:, None])

    def new_tail(self, batch: int, **like) -> torch.Tensor:
        return torch.zeros(batch, self.conv.in_channels, self.keep, **like)


def _time_major_input(x: torch.Tensor, state: VocoderState, slot: int, keep: int, act: SnakeBeta | None):
    """(B, keep + L, C): the `keep` positions carried in state.tails[slot], then act(x) (or x),
    written straight into one buffer; its last `keep` positions become the new tail. With nothing
    carried (keep = 0): act(x), or x."""
    if keep == 0:
        return x if act is None else act(x)
    B, L, C = x.shape
    padded = x.new_empty(B, keep + L, C)
    padded[:, :keep] = state.tails[slot]
    if act is None:
        padded[:, keep:] = x
    else:
        act(x, out=padded[:, keep:])
    state.tails[slot] = padded[:, -keep:].clone()
    return padded


class _TimeMajorTail:
    """The carried inputs of a time-major conv: (B, keep, C_in)."""

    def new_tail(self, batch: int, **like) -> torch.Tensor:
        return torch.zeros(batch, self.keep, self.conv.in_channels, **like)


class DecoderConv(_TimeMajorTail, CausalConv):
    """`CausalConv` on time-major activations, (B, L, C_in) -> (B, L, C_out), of act(x) when given.

    Runs as a (1 x k) conv2d on the channels-last view of x, with no copy in or out. oneDNN is
    faster in that layout here (2-core AVX-512 EPYC, 32-frame blocks: k7 over 96 channels at 24 kHz
    99-111 GMAC/s against 69-82 channel-major; 1x1 convs 15-25% faster). `store_for_reading` stores the
    weight in that layout too (same shape and values), else PyTorch copies it so on every call.

    oneDNN also reorders the weight on every call, which dominates when the weight is much larger
    than the input (at least GEMM_MIN_WEIGHT_RATIO times): the first conv (1024 -> 1536 channels,
    k7, 4 inputs a frame) took 36 ms per 32 frames and 21 per 4-frame streaming chunk. Such calls
    run as one matrix product over the k-tap windows instead: 20 and 5 ms.
    """

    def forward(self, x: torch.Tensor, state: VocoderState, act: SnakeBeta | None = None) -> torch.Tensor:
        x = _time_major_input(x, state, self.slot, self.keep, act)  # (B, keep + L, C_in)
        conv, (B, positions, cin) = self.conv, x.shape
        cout, _, k = conv.weight.shape
        if conv.weight.numel() >= GEMM_MIN_WEIGHT_RATIO * x.numel():
            # One matrix product over the k-tap windows of x (a strided view, copied once): the
            # weight, stored (C_out, k, C_in), is read in place, with no per-call reorder.
            L, d = positions - self.keep, conv.dilation[0]
            x = x.contiguous()
            windows = x.as_strided((B, L, k, cin), (x.stride(0), cin, d * cin, 1)).reshape(B * L, k * cin)
            y = torch.addmm(conv.bias, windows, conv.weight.transpose(1, 2).reshape(cout, k * cin).t())
            return y.view(B, L, cout)
        weight = conv.weight.unsqueeze(2)  # (C_out, C_in, 1, k); channels-last when stored (C_out, k, C_in)
        y = F.conv2d(x.transpose(1, 2).unsqueeze(2), weight, conv.bias, dilation=(1, conv.dilation[0]))
        return y.squeeze(2).transpose(1, 2)  # (B, L, C_out)

    def store_for_reading(self) -> None:
        """Store the weight (C_out, k, C_in), the order the conv reads (`Vocoder.load` does this)."""
        weight = self.conv.weight.detach()
        stored = weight.transpose(1, 2).contiguous().transpose(1, 2)  # a no-op when already so
        if stored.data_ptr() != weight.data_ptr():
            self.conv.weight = nn.Parameter(stored, requires_grad=False)


class DecoderTransConv(_TimeMajorTail, TransConv):
    """`TransConv` on time-major activations: (B, L, C_in) -> (B, L*s, C_out), of act(x) when given.

    With k = taps * s, output t*s + p is a k=taps convolution of inputs t - taps + 1 .. t with the
    weights of phase p. For calls of at least POLYPHASE_MIN_POSITIONS inputs it runs so, as one
    oneDNN conv with s * C_out output channels (phase-major) whose output is already in time order;
    for shorter ones, as `TransConv` does (one product per input and an overlap-add): oneDNN's
    per-call weight reorder then costs more than its faster arithmetic saves (the 1536-channel
    first block, 4 inputs a frame: 54 against 42 ms per 32 frames). A module whose calls stay that
    short can `pack` its weight for oneDNN's matmul instead (Vocoder.load does so for the first
    block on the CPU): 38 -> 24 ms per 32 frames, 10 -> 3.4 ms for a 1-frame streaming chunk.
    """

    def __init__(self, cin: int, cout: int, kernel: int, stride: int):
        super().__init__(cin, cout, kernel, stride)
        self.register_buffer("packed", None, persistent=False)  # (C_out*k, C_in) packed, after `pack`

    @property
    def shape(self) -> tuple[int, int, int]:
        """conv.weight's (C_in, C_out, k), also once `pack` has dropped it."""
        return self.conv.in_channels, self.conv.out_channels, self.conv.kernel_size[0]

    @torch.no_grad()
    def pack(self) -> None:
        """Put the weight in oneDNN's packed matmul layout (CPU, float32 or bfloat16; see
        `layers.can_pack`) in place of conv.weight; the polyphase path, which needs the original,
        is then off."""
        cin, cout, k = self.shape
        weight = self.conv.weight.reshape(cin, cout * k).t()  # (C_out*k, C_in), a Linear's (a view: no copy)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        self.conv.weight = None

    def forward(self, x: torch.Tensor, state: VocoderState, act: SnakeBeta | None = None) -> torch.Tensor:
        B, L, _ = x.shape
        s, (cin, cout, k) = self.stride, self.shape
        x = _time_major_input(x, state, self.slot, self.keep, act)  # (B, keep + L, C_in)
        taps = k // s
        if self.packed is not None:
            spread = LINEAR_POINTWISE(x.reshape(-1, cin), self.packed, None, "none", [], "").view(B, -1, cout * k)
        elif L >= POLYPHASE_MIN_POSITIONS and taps * s == k:
            # weight[c_in, c_out, tap*s + p] for input t - tap -> kernel (s*C_out, C_in, 1, taps),
            # kernel position j = keep - tap, in the channels-last layout the conv reads
            w = self.conv.weight.view(cin, cout, taps, s).permute(3, 1, 0, 2).flip(-1)  # (s, C_out, C_in, taps)
            w = w.reshape(s * cout, cin, 1, taps).contiguous(memory_format=torch.channels_last)
            y = F.conv2d(x.transpose(1, 2).unsqueeze(2), w, self.conv.bias.repeat(s))  # (B, s*C_out, 1, L)
            return y.squeeze(2).transpose(1, 2).reshape(B, L * s, cout)
        else:
            spread = torch.matmul(x, self.conv.weight.reshape(cin, cout * k))  # (B, keep + L, C_out*k)
        spread = spread.view(B, -1, cout, taps, s)  # (B, keep + L, C_out, taps, s)
        y = spread[:, self.keep :, :, 0]
        for tap in range(1, taps):  # input t - tap adds its tap-th block of s outputs
            y = y + spread[:, self.keep - tap : self.keep - tap + L, :, tap]
        y = y.transpose(2, 3).reshape(B, L * s, cout)  # (B, L*s, C_out), a fresh copy
        return y.add_(self.conv.bias)


class SnakeBeta(nn.Module):
    """x + sin(x·e^α)² / (e^β + 1e-9) per channel; α and β are stored as logs. Time-major."""

    def __init__(self, dim: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(dim))
        self.beta = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, L, C) -> (B, L, C), written into `out` (same shape; may be a window of a wider
        buffer) when given.

        float32 on the CPU: one pass of kazeia/native's `snake_beta` on torch's thread count, ~5x
        faster than the five PyTorch passes below and as accurate (against float64).
        """
        lib = native.library() if _native_snake(x, out, self.alpha, self.beta) else None
        if lib is not None:
            out = torch.empty_like(x) if out is None else out
            B, L, C = x.shape
            failed = lib.snake_beta(x.data_ptr(), out.data_ptr(), self.alpha.data_ptr(), self.beta.data_ptr(), B, L, C,
                                    x.stride(0), out.stride(0), torch.get_num_threads())  # fmt: skip
            if failed:
                raise MemoryError("snake_beta: out of memory")
            return out
        # x + 1/(β+eps) · sin(x·α)², in place on one temporary (fewer passes over 24 kHz activations)
        alpha = self.alpha.exp()
        s = torch.mul(x, alpha, out=out) if out is not None else x * alpha
        s.sin_()
        s.mul_(s).mul_(1.0 / (self.beta.exp() + SNAKE_EPS))
        return s.add_(x)


def _native_snake(x: torch.Tensor, out: torch.Tensor | None, *params: torch.Tensor) -> bool:
    """Can `snake_beta` take these: float32 CPU (B, L, C) tensors whose positions are contiguous
    rows within each batch entry, and contiguous float32 parameters?"""
    for t in (x,) if out is None else (x, out):
        if t.dtype != torch.float32 or t.device.type != "cpu" or t.dim() != 3:
            return False
        if t.stride(2) != 1 or (t.shape[1] > 1 and t.stride(1) != t.shape[2]):
            return False
    return all(p.dtype == torch.float32 and p.device.type == "cpu" and p.is_contiguous() for p in params)


class LayerScale(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x


class Codebooks(nn.Module):
    """`n` codebooks whose vectors are summed, then projected: codes (B, T, n) -> (B, C_out, T)."""

    def __init__(self, n: int, size: int, dim: int, out: int):
        super().__init__()
        self.codebooks = nn.Parameter(torch.zeros(n, size, dim))
        self.output_proj = nn.Conv1d(dim, out, 1, bias=False)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        n, size, dim = self.codebooks.shape
        offsets = torch.arange(n, device=codes.device) * size
        vectors = F.embedding(codes + offsets, self.codebooks.view(n * size, dim))  # (B, T, n, dim)
        return self.output_proj(vectors.sum(2).transpose(1, 2))


class Quantizer(nn.Module):
    """RVQ dequantization: semantic codebook plus the acoustic ones, (B, T, 16) -> (B, codebook_dim, T)."""

    def __init__(self, cfg: VocoderConfig):
        super().__init__()
        dim, size = cfg.codebook_dim // 2, cfg.codebook_size
        self.rvq_first = Codebooks(SEMANTIC_QUANTIZERS, size, dim, cfg.codebook_dim)
        self.rvq_rest = Codebooks(cfg.num_quantizers - SEMANTIC_QUANTIZERS, size, dim, cfg.codebook_dim)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        first = self.rvq_first(codes[..., :SEMANTIC_QUANTIZERS])
        return first + self.rvq_rest(codes[..., SEMANTIC_QUANTIZERS:])


class Block(nn.Module):
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

    def forward(self, h, rope, cache: WindowCache, start: int, mask: torch.Tensor) -> torch.Tensor:
        """h (B, n, dim); mask (n, keep + n) bool."""
        h = h + self.self_attn_layer_scale(self.self_attn(self.input_layernorm(h), rope, cache, start, mask))
        return h + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(h)))


class Transformer(nn.Module):
    """latent -> hidden, sliding-window layers with RoPE at absolute frame positions, norm, -> latent."""

    def __init__(self, cfg: VocoderConfig):
        super().__init__()
        self.window = cfg.sliding_window
        self.input_proj = nn.Linear(cfg.latent_dim, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.output_proj = nn.Linear(cfg.hidden_size, cfg.latent_dim)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta)

    def forward(self, x: torch.Tensor, caches: list[WindowCache], start: int) -> torch.Tensor:
        """x (B, n, latent) at frames [start, start + n) -> (B, n, latent)."""
        n, keep = x.shape[1], caches[0].k.shape[2]
        rope = self.rotary.span(start, n, x.dtype, x.device)
        mask = causal_mask(n, keep + n, keep, x.device, self.window)  # keys local: frame start-keep+j
        mask &= torch.arange(keep + n, device=x.device)[None, :] >= keep - start  # no frames before 0
        h = self.input_proj(x)
        for layer, cache in zip(self.layers, caches, strict=True):
            h = layer(h, rope, cache, start, mask)
        return self.output_proj(self.norm(h))


class ConvNeXt(nn.Module):
    """Causal depthwise conv k7, LayerNorm, 4x GELU MLP, per-channel gamma, residual."""

    def __init__(self, dim: int):
        super().__init__()
        self.dwconv = CausalConv(dim, dim, 7, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=CONVNEXT_NORM_EPS)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, state: VocoderState) -> torch.Tensor:
        """x (B, C, L) -> (B, C, L)."""
        h = self.dwconv(x, state).transpose(1, 2)  # (B, L, C)
        h = self.pwconv2(F.gelu(self.pwconv1(self.norm(h))))
        return x + (self.gamma * h).transpose(1, 2)


class ResidualUnit(nn.Module):
    """x + conv_k1(snake(conv_k7_dilated(snake(x)))), time-major."""

    def __init__(self, dim: int, dilation: int):
        super().__init__()
        self.act1 = SnakeBeta(dim)
        self.conv1 = DecoderConv(dim, dim, 7, dilation=dilation)
        self.act2 = SnakeBeta(dim)
        self.conv2 = DecoderConv(dim, dim, 1)

    def forward(self, x: torch.Tensor, state: VocoderState) -> torch.Tensor:
        h = self.conv1(x, state, act=self.act1)
        return self.conv2(h, state, act=self.act2).add_(x)  # = x + conv2(...), without a new tensor


class DecoderBlock(nn.Module):
    """SnakeBeta, transposed conv (k = 2r, stride r), residual units with dilations 1, 3, 9."""

    def __init__(self, cin: int, cout: int, rate: int):
        super().__init__()
        units = [ResidualUnit(cout, d) for d in (1, 3, 9)]
        self.block = nn.ModuleList([SnakeBeta(cin), DecoderTransConv(cin, cout, 2 * rate, rate), *units])

    def forward(self, x: torch.Tensor, state: VocoderState) -> torch.Tensor:
        """x (B, L, C_in) -> (B, L*r, C_out)."""
        snake, up, *units = self.block
        x = up(x, state, act=snake)
        for unit in units:
            x = unit(x, state)
        return x


class Vocoder(nn.Module):
    """Codes (B, T, 16) in 0..2047 -> audio (B, T*1920) in [-1, 1]; offline (`forward`) or chunk by chunk."""

    def __init__(self, cfg: VocoderConfig):
        super().__init__()
        self.cfg = cfg
        latent, dims = cfg.latent_dim, [cfg.decoder_dim // 2**i for i in range(len(cfg.upsample_rates) + 1)]
        self.quantizer = Quantizer(cfg)
        self.pre_conv = CausalConv(cfg.codebook_dim, latent, 3)
        self.pre_transformer = Transformer(cfg)
        self.upsample = nn.ModuleList(
            nn.ModuleList([TransConv(latent, latent, r, r), ConvNeXt(latent)]) for r in cfg.upsampling_ratios
        )
        blocks = [DecoderBlock(dims[i], dims[i + 1], r) for i, r in enumerate(cfg.upsample_rates)]
        self.decoder = nn.ModuleList(
            [DecoderConv(latent, dims[0], 7), *blocks, SnakeBeta(dims[-1]), DecoderConv(dims[-1], 1, 7)]
        )
        for slot, module in enumerate(self._stateful()):
            module.slot = slot

    def _stateful(self) -> list[CausalConv | TransConv]:
        return [m for m in self.modules() if isinstance(m, (CausalConv, TransConv)) and m.keep > 0]

    @classmethod
    def load(
        cls,
        speech_tokenizer_dir: str | os.PathLike,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> Vocoder:
        """Build from `speech_tokenizer/config.json` on the meta device and load `model.safetensors` strictly."""
        root = Path(speech_tokenizer_dir)
        cfg = VocoderConfig.from_file(root / "config.json")
        with torch.device("meta"):
            vocoder = cls(cfg)
        path = root / "model.safetensors"
        # Read, not memory-mapped: the decoder convs' weights are stored anew (`DecoderConv.
        # store_for_reading`), and a map would keep the file's copy of them resident as well (0.2
        # GB). The encoder's tensors (same file) are skipped, not read.
        released = load_tensors(path, mmap=False, wanted=lambda name: not name.startswith("encoder."))
        tensors = vocoder_tensors(released, num_quantizers=cfg.num_quantizers)
        del released
        assign(vocoder, tensors, where=str(path), device=device, dtype=dtype)
        del tensors  # the modules hold the only references: each weight replaced below is freed at once
        vocoder._prepare(device, dtype)
        return vocoder.eval()

    def _prepare(self, device: torch.device | str, dtype: torch.dtype) -> None:
        """Loaded weights into the layouts the decoder reads fastest (results change by float
        rounding only): convolution weights stored (C_out, k, C_in); on the CPU, where oneDNN
        packs matmul weights, the transformer's and ConvNeXt's linears packed as the talker's (on
        their few positions a frame: 1-frame streaming chunks 84 -> 77 ms, 4-frame 42 -> 39), and
        so is the transposed conv of each decoder block whose offline calls never go polyphase."""
        for module in self.modules():
            if isinstance(module, DecoderConv):
                module.store_for_reading()
        if torch.device(device).type != "cpu" or not can_pack(dtype):
            return
        fuse_projections(self.pre_transformer)
        pack_linears(self)
        inputs = math.prod(self.cfg.upsampling_ratios)  # per frame, into the first decoder block
        for block, rate in zip(self.decoder[1:-2], self.cfg.upsample_rates, strict=True):
            if inputs * OFFLINE_BLOCK < POLYPHASE_MIN_POSITIONS:  # never polyphase offline
                block.block[1].pack()
            inputs *= rate

    def new_state(self, batch: int = 1) -> VocoderState:
        """A fresh stream: zero conv tails, empty (zero, masked) attention windows, position 0."""
        weight = self.pre_conv.conv.weight
        zeros = partial(torch.zeros, device=weight.device, dtype=weight.dtype)
        tails = [m.new_tail(batch, device=weight.device, dtype=weight.dtype) for m in self._stateful()]
        shape = (batch, self.cfg.num_heads, self.cfg.sliding_window - 1, self.cfg.head_dim)
        caches = [WindowCache(zeros(shape), zeros(shape)) for _ in range(self.cfg.num_layers)]
        return VocoderState(tails=tails, caches=caches, position=0)

    @torch.no_grad()
    def decode_chunk(self, codes: torch.Tensor, state: VocoderState) -> torch.Tensor:
        """The next n frames of a stream: codes (B, n, 16) or (n, 16) -> audio (B, n*1920) or (n*1920,)."""
        codes, batched = self._check(codes)
        if codes.shape[0] != state.batch:
            raise ValueError(f"codes have batch {codes.shape[0]}, but the state was made for batch {state.batch}")
        n = codes.shape[1]
        if n == 0:
            return self._silence(codes.shape[0]) if batched else self._silence(1)[0]
        x = self.quantizer(codes)  # (B, codebook_dim, n)
        x = self.pre_conv(x, state).transpose(1, 2)  # (B, n, latent)
        x = self.pre_transformer(x, state.caches, state.position).transpose(1, 2)  # (B, latent, n)
        state.position += n
        for up, convnext in self.upsample:
            x = convnext(up(x, state), state)  # (B, latent, 4n) after both stages
        x = self.decoder[0](x.transpose(1, 2), state)  # (B, 4n, decoder_dim): time-major from here
        for block in self.decoder[1:-2]:
            x = block(x, state)  # (B, n*1920, decoder_dim/16) after the last block
        audio = self.decoder[-1](x, state, act=self.decoder[-2])[..., 0].clamp(-1, 1)  # (B, n*1920)
        return audio if batched else audio[0]

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        """One full causal decode: codes (B, T, 16) or (T, 16) -> audio (B, T*1920) or (T*1920,)."""
        codes, batched = self._check(codes)
        audio = self.decode_blocks(codes, self.new_state(codes.shape[0]))
        return audio if batched else audio[0]

    def decode_blocks(self, codes: torch.Tensor, state: VocoderState) -> torch.Tensor:
        """Codes (B, T, 16) decoded on `state` (advancing it) in blocks of OFFLINE_BLOCK frames
        -> audio (B, T*1920): the same audio as one chunk, in bounded memory."""
        starts = range(0, codes.shape[1], OFFLINE_BLOCK)
        pieces = [self.decode_chunk(codes[:, i : i + OFFLINE_BLOCK], state) for i in starts]
        return torch.cat(pieces, dim=-1) if pieces else self._silence(codes.shape[0])

    def decode_reference_chunked(
        self, codes: torch.Tensor, chunk_size: int = 300, left_context: int = 25
    ) -> torch.Tensor:
        """The reference's `chunked_decode`, for comparison: every `chunk_size` frames restart from
        scratch (positions from 0) on `left_context` earlier frames and drop their samples."""
        if chunk_size < 1 or left_context < 0:
            raise ValueError(f"need chunk_size >= 1 and left_context >= 0, got {chunk_size}, {left_context}")
        codes, batched = self._check(codes)
        pieces = [self._silence(codes.shape[0])]
        for start in range(0, codes.shape[1], chunk_size):
            context = min(left_context, start)
            audio = self.forward(codes[:, start - context : start + chunk_size])
            pieces.append(audio[:, context * self.cfg.samples_per_frame :])
        audio = torch.cat(pieces, dim=-1)
        return audio if batched else audio[0]

    def _silence(self, batch: int) -> torch.Tensor:
        weight = self.pre_conv.conv.weight
        return torch.zeros(batch, 0, device=weight.device, dtype=weight.dtype)

    def _check(self, codes: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """Validate codes; return them as (B, T, 16) int64 and whether a batch dimension was given."""
        q, size = self.cfg.num_quantizers, self.cfg.codebook_size
        if not isinstance(codes, torch.Tensor) or codes.dtype not in INTEGER_DTYPES:
            raise ValueError(f"codes must be an integer tensor, got {getattr(codes, 'dtype', type(codes).__name__)}")
        if codes.dim() not in (2, 3) or codes.shape[-1] != q:
            raise ValueError(f"codes must have shape (B, T, {q}) or (T, {q}), got {tuple(codes.shape)}")
        if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= size):
            raise ValueError(f"codes must lie in 0..{size - 1}, got values {int(codes.min())}..{int(codes.max())}")
        batched = codes.dim() == 3
        return (codes if batched else codes[None]).long(), batched


def vocoder_tensors(released: Mapping[str, torch.Tensor], *, num_quantizers: int = 16) -> dict[str, torch.Tensor]:
    """speech_tokenizer/model.safetensors tensors -> `Vocoder` state_dict names.

    Drops `encoder.*` and the unused RVQ input projections, strips `decoder.`, and turns each
    codebook's (embedding_sum, cluster_usage) pair into its vectors, stacked per RVQ group.
    Tensors of any other name pass through, so a strict load names them.
    """
    groups = {"rvq_first": SEMANTIC_QUANTIZERS, "rvq_rest": num_quantizers - SEMANTIC_QUANTIZERS}
    prefixes = {g: [f"decoder.quantizer.{g}.vq.layers.{i}._codebook." for i in range(n)] for g, n in groups.items()}
    pairs = {p + f for names in prefixes.values() for p in names for f in ("embedding_sum", "cluster_usage")}
    unused = {f"decoder.quantizer.{g}.input_proj.weight" for g in groups}
    out = {
        name.removeprefix("decoder."): tensor
        for name, tensor in released.items()
        if not name.startswith("encoder.") and name not in unused and name not in pairs
    }
    for group, names in prefixes.items():
        out[f"quantizer.{group}.codebooks"] = torch.stack([_codebook(released, p) for p in names])  # (n, size, dim)
    return out


def _codebook(released: Mapping[str, torch.Tensor], prefix: str) -> torch.Tensor:
    """One codebook's vectors (size, dim) = embedding_sum / clamp(cluster_usage, 1e-5), in float32."""
    for field in ("embedding_sum", "cluster_usage"):
        if prefix + field not in released:
            raise CheckpointError(f"missing tensor {prefix + field}")
    usage = released[prefix + "cluster_usage"].float()
    return released[prefix + "embedding_sum"].float() / usage.clamp(min=CODEBOOK_EPS)[:, None]
