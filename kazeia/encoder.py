"""The speech-tokenizer encoder: 24 kHz audio -> 16 codes per 80 ms frame (voice cloning).

Scope: the Mimi encoder of Qwen3-TTS-Tokenizer-12Hz as the reference runs it (spec §7.1): SEANet
causal convolutions down to 25 Hz, an 8-layer causal transformer, a stride-2 downsampling conv to
12.5 Hz, and the split residual vector quantizer (one semantic codebook, then the acoustic ones on
the same input), of which the first 16 codebooks are kept. Tensors only. Non-goals: streaming
encoding, batching of unequal lengths, and the Mimi decoder (the vocoder is the Qwen decoder).

Shapes: B = batch, L = samples at a layer's rate, T = frames, C = channels.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .checkpoint import assign, load_tensors
from .config import EncoderConfig
from .layers import Attention, LayerScale, Rotary, codebook_vectors

RELEASED_PREFIX = "encoder."  # tensor names in speech_tokenizer/model.safetensors
# Quantizer tensors encoding does not read (codebooks are rebuilt from embed_sum / cluster_usage).
UNUSED_SUFFIXES = (".embed_sum", ".cluster_usage", ".initialized", ".output_proj.weight")
QUANTIZER_GROUPS = {"semantic": "semantic_residual_vector_quantizer", "acoustic": "acoustic_residual_vector_quantizer"}


class Conv(nn.Module):
    """Mimi's causal Conv1d: k_eff - stride inputs of left padding (zeros, or the edge value with
    `replicate`) and enough on the right for a whole number of strides: L -> ceil(L / stride)."""

    def __init__(
        self, cin: int, cout: int, kernel: int, stride: int = 1, dilation: int = 1, bias=True, replicate=False
    ):
        super().__init__()
        self.conv = nn.Conv1d(cin, cout, kernel, stride, dilation=dilation, bias=bias)
        self.stride = stride
        self.left = (kernel - 1) * dilation + 1 - stride
        self.mode = "replicate" if replicate else "constant"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, C_in, L) -> (B, C_out, ceil(L / stride))."""
        length = x.shape[-1]
        right = -(-length // self.stride) * self.stride - length
        return self.conv(F.pad(x, (self.left, right), mode=self.mode))


class ResBlock(nn.Module):
    """x + conv_k1(elu(conv_k(elu(x)))), the hidden width reduced by `compress`."""

    def __init__(self, dim: int, hidden: int, kernel: int, dilation: int):
        super().__init__()
        self.block = nn.ModuleList(
            [nn.ELU(), Conv(dim, hidden, kernel, dilation=dilation), nn.ELU(), Conv(hidden, dim, 1)]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for layer in self.block:
            h = layer(h)
        return x + h


class SEANet(nn.Module):
    """Conv, then per stride: residual blocks, ELU, strided conv (channels double); ELU, last conv."""

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        dim = cfg.num_filters
        layers: list[nn.Module] = [Conv(1, dim, cfg.kernel_size)]
        for stride in cfg.strides:
            for j in range(cfg.num_residual_layers):
                dilation = cfg.dilation_growth_rate**j
                layers.append(ResBlock(dim, dim // cfg.compress, cfg.residual_kernel_size, dilation))
            layers += [nn.ELU(), Conv(dim, 2 * dim, 2 * stride, stride=stride)]
            dim *= 2
        layers += [nn.ELU(), Conv(dim, cfg.hidden_size, cfg.last_kernel_size)]
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """audio (B, 1, L) -> (B, hidden, ceil(L / prod(strides)))."""
        for layer in self.layers:
            x = layer(x)
        return x


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden, bias=False)
        self.fc2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class LayerNormBlock(nn.Module):
    """Pre-LayerNorm transformer layer with per-channel layer scales on both residual branches."""

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        dim = cfg.hidden_size
        self.self_attn = Attention(dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, qk_norm_eps=None)
        self.mlp = MLP(dim, cfg.intermediate_size)
        self.input_layernorm = nn.LayerNorm(dim, eps=cfg.norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(dim, eps=cfg.norm_eps)
        self.self_attn_layer_scale = LayerScale(dim)
        self.mlp_layer_scale = LayerScale(dim)

    def forward(self, h: torch.Tensor, rope) -> torch.Tensor:
        h = h + self.self_attn_layer_scale(self.self_attn(self.input_layernorm(h), rope))
        return h + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(h)))


class ClipTransformer(nn.Module):
    """Layers over a whole clip (full causal attention, RoPE from position 0)."""

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.layers = nn.ModuleList(LayerNormBlock(cfg) for _ in range(cfg.num_layers))
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, T, hidden) at positions 0..T-1 -> (B, T, hidden)."""
        rope = self.rotary.span(0, x.shape[1], x.dtype, x.device)
        for layer in self.layers:
            x = layer(x, rope)
        return x


class ResidualQuantizer(nn.Module):
    """Project to codebook width, then pick the nearest vector of each codebook in turn and
    subtract it: (B, hidden, T) -> codes (B, n, T)."""

    def __init__(self, n: int, size: int, dim: int, hidden: int):
        super().__init__()
        self.input_proj = nn.Conv1d(hidden, dim, 1, bias=False)
        self.codebooks = nn.Parameter(torch.zeros(n, size, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, _, T = x.shape
        residual = self.input_proj(x)  # (B, dim, T)
        codes = []
        for codebook in self.codebooks:  # (size, dim)
            flat = residual.permute(0, 2, 1).reshape(B * T, -1)  # (B*T, dim)
            nearest = torch.cdist(flat[None].float(), codebook[None].float(), p=2)[0].argmin(dim=-1)  # (B*T,)
            residual = residual - F.embedding(nearest.view(B, T), codebook).permute(0, 2, 1)
            codes.append(nearest.view(B, T))
        return torch.stack(codes, dim=1)


class SplitRVQ(nn.Module):
    """Split RVQ: the semantic and the acoustic quantizers both read the same embeddings."""

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        semantic = cfg.num_semantic_quantizers
        self.semantic = ResidualQuantizer(semantic, cfg.codebook_size, cfg.codebook_dim, cfg.hidden_size)
        self.acoustic = ResidualQuantizer(
            cfg.valid_quantizers - semantic, cfg.codebook_size, cfg.codebook_dim, cfg.hidden_size
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, hidden, T) -> codes (B, valid_quantizers, T)."""
        return torch.cat((self.semantic(x), self.acoustic(x)), dim=1)


class Encoder(nn.Module):
    """Audio (B, L) at 24 kHz in [-1, 1] -> codes (B, ceil(L / 1920), 16) int64 in 0..2047."""

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.cfg = cfg
        self.encoder = SEANet(cfg)
        self.encoder_transformer = ClipTransformer(cfg)
        kernel, stride = cfg.downsample_kernel, cfg.downsample_stride
        self.downsample = Conv(cfg.hidden_size, cfg.hidden_size, kernel, stride, bias=False, replicate=True)
        self.quantizer = SplitRVQ(cfg)

    @classmethod
    def load(cls, speech_tokenizer_dir: str | os.PathLike, device: torch.device | str = "cpu") -> Encoder:
        """Build from `speech_tokenizer/config.json` on the meta device and load the `encoder.*`
        tensors of `model.safetensors` strictly, in float32."""
        root = Path(speech_tokenizer_dir)
        cfg = EncoderConfig.from_file(root / "config.json")
        with torch.device("meta"):
            encoder = cls(cfg)
        path = root / "model.safetensors"
        tensors = encoder_tensors(load_tensors(path), cfg, str(path))
        assign(encoder, tensors, str(path), device=device, dtype=torch.float32, released_name=_released_name)
        return encoder.eval()

    @torch.inference_mode()
    def forward(self, audio: torch.Tensor) -> torch.Tensor:
        x = self.encoder(audio[:, None].float())  # (B, hidden, T at 25 Hz)
        x = self.encoder_transformer(x.transpose(1, 2)).transpose(1, 2)
        x = self.downsample(x)  # (B, hidden, T at 12.5 Hz)
        return self.quantizer(x).transpose(1, 2)  # (B, T, 16)


def encoder_tensors(released: Mapping[str, torch.Tensor], cfg: EncoderConfig, where: str) -> dict[str, torch.Tensor]:
    """speech_tokenizer/model.safetensors tensors -> `Encoder` state_dict names.

    Takes the `encoder.*` tensors, drops the parts encoding never uses (the quantizers' output
    projections, `initialized` flags, acoustic codebooks past the 16 kept) and turns each kept
    codebook's (embed_sum, cluster_usage) pair into its vectors, stacked per quantizer. Any other
    name passes through, so a strict load names it. Missing `encoder.*` tensors are named too.
    """
    counts = {"semantic": cfg.num_semantic_quantizers, "acoustic": cfg.valid_quantizers - cfg.num_semantic_quantizers}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in released.items():
        if not name.startswith(RELEASED_PREFIX):
            continue
        rest = name[len(RELEASED_PREFIX) :]
        if not rest.startswith("quantizer."):
            out[rest] = tensor
            continue
        group = _quantizer_group(rest)
        if group is None:
            out[rest] = tensor  # an unknown quantizer tensor: the strict load names it
        elif not rest.endswith(UNUSED_SUFFIXES):
            out[f"quantizer.{group}.{rest.split('.', 2)[2]}"] = tensor
    for group, n in counts.items():
        prefix = f"{RELEASED_PREFIX}quantizer.{QUANTIZER_GROUPS[group]}.layers."
        out[f"quantizer.{group}.codebooks"] = torch.stack(
            [
                codebook_vectors(
                    released, f"{prefix}{i}.codebook.embed_sum", f"{prefix}{i}.codebook.cluster_usage", where
                )
                for i in range(n)
            ]  # fmt: skip
        )
    return out


def _quantizer_group(rest: str) -> str | None:
    released_group = rest.split(".")[1] if rest.count(".") >= 2 else ""
    return next((ours for ours, theirs in QUANTIZER_GROUPS.items() if theirs == released_group), None)


def _released_name(name: str) -> str:
    for ours, theirs in QUANTIZER_GROUPS.items():
        name = name.replace(f"quantizer.{ours}.", f"quantizer.{theirs}.")
    return RELEASED_PREFIX + name
