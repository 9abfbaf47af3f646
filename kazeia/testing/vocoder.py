"""Random-weight speech-tokenizer decoder tensors in the released layout, for tests and benchmarks.

Scope: the `decoder.*` tensors of `speech_tokenizer/model.safetensors` (names and shapes as the
reference decoder expects them) with deterministic random values that give audible, unclipped audio,
and the tiny decoder config of the tiny test checkpoints. Non-goal: encoder tensors.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from typing import Any

import torch

from ..config import VocoderConfig

LAYER_SCALE = 0.01  # decoder_config.layer_scale_initial_scale of the released config
CONVNEXT_GAMMA = 0.1  # ConvNeXt residual gain (the reference initialises 1e-6, which would mute the block)
CODEBOOK_STD = 0.25  # per-codebook vector std: 16 summed vectors give a unit-scale RVQ output
SNAKE_LOG_STD = 0.1  # SnakeBeta log alpha / log beta ~ N(0, 0.1): frequency and gain near 1
BIAS_STD = 0.02
NORM_STD = 0.05  # norm weights ~ 1 + N(0, 0.05), so a norm lost on load shows up in parity
RESIDUAL_GAIN = 0.3  # residual-unit output conv: each of the 12 units grows the signal only ~1.1x
OUTPUT_GAIN = 0.05  # final conv std x sqrt(fan_in): audio rms 0.12-0.16, no clipping, real and tiny dims

# decoder_config fields of the tiny checkpoints; everything else stays as released.
TINY_DECODER = {
    "codebook_dim": 64,
    "latent_dim": 64,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 8,
    "intermediate_size": 64,
    "decoder_dim": 64,
}


def tiny_speech_tokenizer_config(real: dict[str, Any]) -> dict[str, Any]:
    """The released speech_tokenizer config.json dict with the decoder shrunk to `TINY_DECODER`."""
    tiny = copy.deepcopy(real)
    tiny["decoder_config"].update(TINY_DECODER)
    return tiny


def random_vocoder_tensors(cfg: VocoderConfig, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Every released `decoder.*` tensor for `cfg`, float32, drawn from `generator` in a fixed order.

    Weights are normal with std 1/sqrt(fan_in) (fan_in of a transposed conv: C_in * k / stride),
    biases N(0, 0.02), norms ~1, layer scales 0.01, SnakeBeta logs ~N(0, 0.1), and the final conv
    scaled by OUTPUT_GAIN: the audio is then far from the ±1 clamp yet clearly not silent.
    """
    out: dict[str, torch.Tensor] = {}
    for name, shape, kind in _released_layout(cfg):
        out["decoder." + name] = _draw(kind, shape, generator)
    for group in ("rvq_first", "rvq_rest"):
        count = 1 if group == "rvq_first" else cfg.num_quantizers - 1
        for i in range(count):
            prefix = f"decoder.quantizer.{group}.vq.layers.{i}._codebook."
            usage = 0.5 + 1.5 * torch.rand(cfg.codebook_size, generator=generator)
            vectors = CODEBOOK_STD * _normal((cfg.codebook_size, cfg.codebook_dim // 2), generator)
            out[prefix + "cluster_usage"] = usage
            out[prefix + "embedding_sum"] = vectors * usage[:, None]
    return out


def _normal(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=generator, dtype=torch.float32)


def _draw(kind: str | tuple[str, float], shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """kind: ("weight", fan_in) | ("output", fan_in) | "bias" | "norm" | "scale" | "gamma" | "snake"."""
    noise = _normal(shape, generator)
    if isinstance(kind, tuple):
        gain = {"weight": 1.0, "residual": RESIDUAL_GAIN, "output": OUTPUT_GAIN}[kind[0]]
        return noise * (gain / math.sqrt(kind[1]))
    return {
        "bias": lambda: noise * BIAS_STD,
        "norm": lambda: 1.0 + noise * NORM_STD,
        "scale": lambda: LAYER_SCALE * (1.0 + noise * NORM_STD),
        "gamma": lambda: CONVNEXT_GAMMA * (1.0 + noise * NORM_STD),
        "snake": lambda: noise * SNAKE_LOG_STD,
    }[kind]()


def _conv(name: str, cout: int, cin: int, k: int, groups: int = 1) -> Iterator[tuple]:
    yield f"{name}.weight", (cout, cin // groups, k), ("weight", cin // groups * k)
    yield f"{name}.bias", (cout,), "bias"


def _linear(name: str, cout: int, cin: int, bias: bool = True) -> Iterator[tuple]:
    yield f"{name}.weight", (cout, cin), ("weight", cin)
    if bias:
        yield f"{name}.bias", (cout,), "bias"


def _released_layout(cfg: VocoderConfig) -> Iterator[tuple[str, tuple[int, ...], Any]]:
    """(name without `decoder.`, shape, kind) of every decoder tensor except the codebooks."""
    half, latent = cfg.codebook_dim // 2, cfg.latent_dim
    for group in ("rvq_first", "rvq_rest"):
        yield f"quantizer.{group}.input_proj.weight", (half, cfg.codebook_dim, 1), ("weight", cfg.codebook_dim)
        yield f"quantizer.{group}.output_proj.weight", (cfg.codebook_dim, half, 1), ("weight", half)
    yield from _conv("pre_conv.conv", latent, cfg.codebook_dim, 3)
    yield from _transformer(cfg)
    for i, r in enumerate(cfg.upsampling_ratios):
        yield f"upsample.{i}.0.conv.weight", (latent, latent, r), ("weight", latent)
        yield f"upsample.{i}.0.conv.bias", (latent,), "bias"
        yield from _convnext(f"upsample.{i}.1", latent)
    dims = [cfg.decoder_dim // 2**i for i in range(len(cfg.upsample_rates) + 1)]
    yield from _conv("decoder.0.conv", dims[0], latent, 7)
    for i, r in enumerate(cfg.upsample_rates):
        cin, cout, block = dims[i], dims[i + 1], f"decoder.{i + 1}.block"
        yield from _snake(f"{block}.0", cin)
        yield f"{block}.1.conv.weight", (cin, cout, 2 * r), ("weight", cin * 2)
        yield f"{block}.1.conv.bias", (cout,), "bias"
        for u in (2, 3, 4):
            yield from _snake(f"{block}.{u}.act1", cout)
            yield from _conv(f"{block}.{u}.conv1.conv", cout, cout, 7)
            yield from _snake(f"{block}.{u}.act2", cout)
            yield f"{block}.{u}.conv2.conv.weight", (cout, cout, 1), ("residual", cout)
            yield f"{block}.{u}.conv2.conv.bias", (cout,), "bias"
    n = len(cfg.upsample_rates)
    yield from _snake(f"decoder.{n + 1}", dims[-1])
    yield f"decoder.{n + 2}.conv.weight", (1, dims[-1], 7), ("output", dims[-1] * 7)
    yield f"decoder.{n + 2}.conv.bias", (1,), "bias"


def _transformer(cfg: VocoderConfig) -> Iterator[tuple]:
    hidden, inner, attn = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim
    yield from _linear("pre_transformer.input_proj", hidden, cfg.latent_dim)
    for i in range(cfg.num_layers):
        layer = f"pre_transformer.layers.{i}"
        for proj in ("q_proj", "k_proj", "v_proj"):
            yield from _linear(f"{layer}.self_attn.{proj}", attn, hidden, bias=False)
        yield from _linear(f"{layer}.self_attn.o_proj", hidden, attn, bias=False)
        yield from _linear(f"{layer}.mlp.gate_proj", inner, hidden, bias=False)
        yield from _linear(f"{layer}.mlp.up_proj", inner, hidden, bias=False)
        yield from _linear(f"{layer}.mlp.down_proj", hidden, inner, bias=False)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            yield f"{layer}.{norm}.weight", (hidden,), "norm"
        for scale in ("self_attn_layer_scale", "mlp_layer_scale"):
            yield f"{layer}.{scale}.scale", (hidden,), "scale"
    yield "pre_transformer.norm.weight", (hidden,), "norm"
    yield from _linear("pre_transformer.output_proj", cfg.latent_dim, hidden)


def _convnext(name: str, dim: int) -> Iterator[tuple]:
    yield from _conv(f"{name}.dwconv.conv", dim, dim, 7, groups=dim)
    yield f"{name}.norm.weight", (dim,), "norm"
    yield f"{name}.norm.bias", (dim,), "bias"
    yield from _linear(f"{name}.pwconv1", 4 * dim, dim)
    yield from _linear(f"{name}.pwconv2", dim, 4 * dim)
    yield f"{name}.gamma", (dim,), "gamma"


def _snake(name: str, dim: int) -> Iterator[tuple]:
    yield f"{name}.alpha", (dim,), "snake"
    yield f"{name}.beta", (dim,), "snake"
