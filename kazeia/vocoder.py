"""The speech-tokenizer decoder: 16 codes per 80 ms frame -> 24 kHz waveform, offline and streaming.

Scope: RVQ dequantization, the causal pre-conv, the sliding-window transformer, the ConvNeXt
pre-upsampling and the SnakeBeta decoder of Qwen3-TTS-Tokenizer-12Hz. Every layer is causal, so a
chunk decoded on a `VocoderState` continues exactly where the previous chunk stopped: any split of
a code sequence into chunks gives the audio of one full decode, 1920 samples per frame, without
recomputing earlier frames. Non-goals: the encoder (audio -> codes) and the speaker encoder.

On the CPU with kazeia/native (`prepare`), every value of every layer is computed by the same
arithmetic in the same order whatever chunk it falls in and whatever came before the chunk
boundary: products of fixed per-value order (conv.c's `vconv`), attention over each frame's own
window, norms and activations value by value (vocoder.c). Any chunking then gives the bits of
the offline decode, at any thread count. Elsewhere (eager PyTorch) chunkings agree to float
rounding.

Shapes: B = batch, n = frames in a chunk, L = positions at a layer's rate, C = channels.
Activations are time-major (B, L, C) throughout (kazeia/conv.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from . import native
from .checkpoint import assign, load_tensors
from .config import VocoderConfig
from .conv import CausalConv, Depthwise, SnakeBeta, Tiled, TiledLinear, TimeMajorConv, TimeMajorTransConv
from .layers import codebook_vectors, fuse_projections
from .matmul import can_pack, pack_linears, replace_linears
from .window import Transformer, WindowBlock, WindowCache

SEMANTIC_QUANTIZERS = 1  # codebook 0 has its own output projection (rvq_first); the others share one
CONVNEXT_NORM_EPS = 1e-6
INTEGER_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
# Frames per decode_chunk call in `decode_blocks`: bounds memory and keeps activations in cache (the
# fastest block size measured, docs/design.md). Never changes the audio.
OFFLINE_BLOCK = 32


def no_pause() -> None:
    """The default `pause` of `Vocoder.decode_chunk`: go on at once."""


@dataclass
class VocoderState:
    """Everything a streaming decode carries between chunks; `Vocoder.decode_chunk` updates it in place."""

    tails: list[torch.Tensor]  # per stateful conv, module order: its last inputs (B, keep, C_in), zeros at start
    caches: list[WindowCache]  # per transformer layer: RoPE'd keys and values of the last window-1 frames
    position: int = 0  # frames decoded so far = RoPE position of the next frame

    @property
    def batch(self) -> int:
        return self.caches[0].k.shape[0]


class Codebooks(nn.Module):
    """`n` codebooks whose vectors are summed (in codebook order), then projected: codes (B, T, n)
    -> (B, T, C_out)."""

    def __init__(self, n: int, size: int, dim: int, out: int):
        super().__init__()
        self.codebooks = nn.Parameter(torch.zeros(n, size, dim))
        self.output_proj = nn.Conv1d(dim, out, 1, bias=False)
        self.native: Tiled | None = None

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        n, size, dim = self.codebooks.shape
        offsets = torch.arange(n, device=codes.device) * size
        vectors = F.embedding(codes + offsets, self.codebooks.view(n * size, dim))  # (B, T, n, dim)
        summed = vectors[:, :, 0]
        for i in range(1, n):
            summed = summed + vectors[:, :, i]
        if self.native is not None:
            return self.native(summed)
        return F.linear(summed, self.output_proj.weight[..., 0])

    def use_native(self, lib, half: bool = False) -> None:
        self.native = Tiled(lib, self.output_proj.weight.permute(0, 2, 1), None, half=half)


class Quantizer(nn.Module):
    """RVQ dequantization: semantic codebook plus the acoustic ones, (B, T, 16) -> (B, T, codebook_dim)."""

    def __init__(self, cfg: VocoderConfig):
        super().__init__()
        dim, size = cfg.codebook_dim // 2, cfg.codebook_size
        self.rvq_first = Codebooks(SEMANTIC_QUANTIZERS, size, dim, cfg.codebook_dim)
        self.rvq_rest = Codebooks(cfg.num_quantizers - SEMANTIC_QUANTIZERS, size, dim, cfg.codebook_dim)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        first = self.rvq_first(codes[..., :SEMANTIC_QUANTIZERS])
        return first + self.rvq_rest(codes[..., SEMANTIC_QUANTIZERS:])


class ConvNeXt(nn.Module):
    """Causal depthwise conv k7, LayerNorm, 4x GELU MLP, per-channel gamma, residual."""

    def __init__(self, dim: int):
        super().__init__()
        self.dwconv = Depthwise(dim, 7)
        self.norm = nn.LayerNorm(dim, eps=CONVNEXT_NORM_EPS)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.ones(dim))
        self.lib = None  # kazeia/native's library (Vocoder.prepare): vocoder.c's norm and GELU

    def forward(self, x: torch.Tensor, state: VocoderState) -> torch.Tensor:
        """x (B, L, C) -> (B, L, C)."""
        h = self.dwconv(x, state.tails)
        if self.lib is None:
            h = self.pwconv2(F.gelu(self.pwconv1(self.norm(h))))
        else:
            rows = h.shape[0] * h.shape[1]
            self.lib.layer_norm_rows(h.data_ptr(), self.norm.weight.data_ptr(), self.norm.bias.data_ptr(),
                                     h.data_ptr(), rows, h.shape[2], self.norm.eps)  # fmt: skip
            h = self.pwconv1(h)  # (B, L, 4C), contiguous
            self.lib.gelu_rows(h.data_ptr(), rows, h.shape[2])
            h = self.pwconv2(h)
        return x + self.gamma * h


class ResidualUnit(nn.Module):
    """x + conv_k1(snake(conv_k7_dilated(snake(x)))), time-major."""

    def __init__(self, dim: int, dilation: int):
        super().__init__()
        self.act1 = SnakeBeta(dim)
        self.conv1 = TimeMajorConv(dim, dim, 7, dilation=dilation)
        self.act2 = SnakeBeta(dim)
        self.conv2 = TimeMajorConv(dim, dim, 1)

    def forward(self, x: torch.Tensor, state: VocoderState) -> torch.Tensor:
        h = self.conv1(x, state.tails, act=self.act1)
        return self.conv2(h, state.tails, act=self.act2, res=x)  # conv2(...) + x


class DecoderBlock(nn.Module):
    """SnakeBeta, transposed conv (k = 2r, stride r), residual units with dilations 1, 3, 9."""

    def __init__(self, cin: int, cout: int, rate: int):
        super().__init__()
        units = [ResidualUnit(cout, d) for d in (1, 3, 9)]
        self.block = nn.ModuleList([SnakeBeta(cin), TimeMajorTransConv(cin, cout, 2 * rate, rate), *units])

    def forward(self, x: torch.Tensor, state: VocoderState, pause: Callable[[], None] = no_pause) -> torch.Tensor:
        """x (B, L, C_in) -> (B, L*r, C_out); `pause()` between its stages (Vocoder.decode_chunk)."""
        snake, up, *units = self.block
        x = up(x, state.tails, act=snake)
        for unit in units:
            pause()
            x = unit(x, state)
        return x


def _unit_convs(blocks) -> set[int]:
    """The ids of the convolutions of the residual units in `blocks`."""
    units = [m for block in blocks for m in block.modules() if isinstance(m, ResidualUnit)]
    return {id(conv) for unit in units for conv in (unit.conv1, unit.conv2)}


class Vocoder(nn.Module):
    """Codes (B, T, 16) in 0..2047 -> audio (B, T*1920) in [-1, 1]; offline (`forward`) or chunk by chunk."""

    def __init__(self, cfg: VocoderConfig):
        super().__init__()
        self.cfg = cfg
        latent, dims = cfg.latent_dim, [cfg.decoder_dim // 2**i for i in range(len(cfg.upsample_rates) + 1)]
        self.quantizer = Quantizer(cfg)
        self.pre_conv = TimeMajorConv(cfg.codebook_dim, latent, 3)
        self.pre_transformer = Transformer(cfg)
        self.upsample = nn.ModuleList(
            nn.ModuleList([TimeMajorTransConv(latent, latent, r, r), ConvNeXt(latent)]) for r in cfg.upsampling_ratios
        )
        blocks = [DecoderBlock(dims[i], dims[i + 1], r) for i, r in enumerate(cfg.upsample_rates)]
        self.decoder = nn.ModuleList(
            [TimeMajorConv(latent, dims[0], 7), *blocks, SnakeBeta(dims[-1]), TimeMajorConv(dims[-1], 1, 7)]
        )
        for slot, module in enumerate(self._stateful()):
            module.slot = slot

    def _stateful(self) -> list[CausalConv | TimeMajorTransConv]:
        return [m for m in self.modules() if isinstance(m, (CausalConv, TimeMajorTransConv)) and m.keep > 0]

    @classmethod
    def load(
        cls,
        speech_tokenizer_dir: str | os.PathLike,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        int8: bool = False,
    ) -> Vocoder:
        """Build from `speech_tokenizer/config.json` on the meta device and load `model.safetensors` strictly.
        `int8` (float32 `dtype`, the CPU with kazeia/native): most convolutions as int8 products (`prepare`)."""
        root = Path(speech_tokenizer_dir)
        cfg = VocoderConfig.from_file(root / "config.json")
        with torch.device("meta"):
            vocoder = cls(cfg)
        path = root / "model.safetensors"
        # Read, not memory-mapped: the weights are stored anew (packed for the native products, or
        # in the eager convs' layout: `prepare`), and a map would keep the file's copy of them
        # resident as well (0.2 GB). The encoder's tensors (same file) are skipped, not read.
        released = load_tensors(path, mmap=False, wanted=lambda name: not name.startswith("encoder."))
        tensors = vocoder_tensors(released, num_quantizers=cfg.num_quantizers)
        del released
        assign(vocoder, tensors, where=str(path), device=device, dtype=dtype)
        del tensors  # the modules hold the only references: each weight replaced below is freed at once
        vocoder.prepare(device, dtype, int8)
        return vocoder.eval()

    def prepare(self, device: torch.device | str, dtype: torch.dtype, int8: bool = False) -> None:
        """The implementation, chosen once, here. On the CPU with kazeia/native: every layer native
        (`_use_native`), the same bits for any chunking. Otherwise eager PyTorch: convolution weights
        stored (C_out, k, C_in), the order its convs read, and on the CPU where oneDNN packs matmul
        weights, the transformer's and ConvNeXt's linears packed as the talker's. `int8`: the residual
        units' convolutions of the decoder blocks after the first (~65 % of a frame's multiply-adds)
        become `Tiled8` products; the earlier layers stay float32, as their errors grow the most on
        the way to the audio, but for the first block's residual units and the later blocks'
        transposed convs, which take bfloat16 pairs where the build has them (int8 inputs, one scale
        a row, would cost a transposed conv 0.8-2.8 dB of SNR), and the transformer's and
        ConvNeXt's linears, which read ~180 MB of weights for a chunk's few positions and keep them
        as bfloat16 (`Tiled`'s `narrow`: float32 arithmetic on the rounded weights;
        docs/design.md). Needs the native library and a float32 `dtype`."""
        lib = native.library() if torch.device(device).type == "cpu" else None
        if int8 and (lib is None or dtype != torch.float32):
            where = "a float32 dtype" if lib is not None else "the CPU with the native library (kazeia/native)"
            raise ValueError(f"an int8 vocoder needs {where}")
        if lib is not None:
            self._use_native(lib, dtype, int8)
            return
        for module in self.modules():
            if isinstance(module, TimeMajorConv):
                module.store_for_reading()
        if torch.device(device).type == "cpu" and can_pack(dtype):
            fuse_projections(self.pre_transformer)
            pack_linears(self)

    @torch.no_grad()
    def _use_native(self, lib, dtype: torch.dtype, int8: bool = False) -> None:
        """Every product a `Tiled` one (conv.c), every other layer vocoder.c's or decode.c's, with
        float32 activations: the parameters are widened (a bfloat16 or float16 vocoder keeps its
        weights' values, rounded to that dtype; a bfloat16 one's products take bfloat16 pairs where
        the CPU has them, else read its weights as bfloat16), each packed weight replaces the
        original (the pre-conv's stays: its device and dtype stand for the vocoder's)."""
        half = dtype == torch.bfloat16
        integer = _unit_convs(self.decoder[2:-2]) if int8 else set()  # decoder blocks after the first
        # int8: the first block's units and the later blocks' transposed convs in bfloat16 pairs
        # where the build has them (`Tiled`; any even width takes pairs there, so `vconv_pairs(2)`
        # asks the build), else float32 as they are
        paired: set[int] = set()
        if int8 and lib.vconv_pairs(2):
            paired = _unit_convs(self.decoder[1:2]) | {id(block.block[1]) for block in self.decoder[2:-2]}
        self.float()
        fuse_projections(self.pre_transformer)
        # int8: the transformer's and ConvNeXt's linears (all of them) store bfloat16 weights
        replace_linears(self, lambda linear: TiledLinear(lib, linear, half, narrow=int8))
        for module in list(self.modules()):
            if isinstance(module, TimeMajorConv):
                module.use_native(lib, half or id(module) in paired, module is self.pre_conv, id(module) in integer)
            elif isinstance(module, (TimeMajorTransConv, Codebooks)):
                module.use_native(lib, half or id(module) in paired)
            elif isinstance(module, Depthwise):
                module.use_native(lib)
            elif isinstance(module, (SnakeBeta, WindowBlock, Transformer, ConvNeXt)):
                module.lib = lib

    def new_state(self, batch: int = 1) -> VocoderState:
        """A fresh stream: zero conv tails, empty (zero, masked) attention windows, position 0."""
        weight = self.pre_conv.conv.weight
        zeros = partial(torch.zeros, device=weight.device, dtype=weight.dtype)
        tails = [m.new_tail(batch, device=weight.device, dtype=weight.dtype) for m in self._stateful()]
        shape = (batch, self.cfg.num_heads, self.cfg.sliding_window - 1, self.cfg.head_dim)
        caches = [WindowCache(zeros(shape), zeros(shape)) for _ in range(self.cfg.num_layers)]
        return VocoderState(tails=tails, caches=caches, position=0)

    @torch.no_grad()
    def decode_chunk(
        self, codes: torch.Tensor, state: VocoderState, pause: Callable[[], None] = no_pause
    ) -> torch.Tensor:
        """The next n frames of a stream: codes (B, n, 16) or (n, 16) -> audio (B, n*1920) or (n*1920,).
        `pause()` is called between the decoder's ~20 stages: a scheduler's lanes may hand the core to
        more urgent work there (kazeia/lanes.py); whatever it does, the chunk's audio is the same."""
        codes, batched = self._check(codes)
        if codes.shape[0] != state.batch:
            raise ValueError(f"codes have batch {codes.shape[0]}, but the state was made for batch {state.batch}")
        n = codes.shape[1]
        if n == 0:
            return self._silence(codes.shape[0]) if batched else self._silence(1)[0]
        x = self.quantizer(codes)  # (B, n, codebook_dim)
        x = self.pre_conv(x, state.tails)  # (B, n, latent)
        x = self.pre_transformer(x, state.caches, state.position)  # (B, n, latent)
        state.position += n
        for up, convnext in self.upsample:
            pause()
            x = convnext(up(x, state.tails), state)  # (B, 4n, latent) after both stages
        pause()
        x = self.decoder[0](x, state.tails)  # (B, 4n, decoder_dim)
        for block in self.decoder[1:-2]:
            pause()
            x = block(x, state, pause)  # (B, n*1920, decoder_dim/16) after the last block
        audio = self.decoder[-1](x, state.tails, act=self.decoder[-2])[..., 0].clamp(-1, 1)  # (B, n*1920)
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
        out[f"quantizer.{group}.codebooks"] = torch.stack(
            [codebook_vectors(released, p + "embedding_sum", p + "cluster_usage") for p in names]
        )  # (n, size, dim)
    return out
