"""Random-weight voice-clone tensors in the released layout: the speaker encoder of Base
checkpoints (`speaker_encoder.*` of model.safetensors) and the speech-tokenizer encoder
(`encoder.*` of speech_tokenizer/model.safetensors), plus the tiny configs of both.

Scales are chosen so that the random encoders behave like trained ones in the ways the tests can
see: codes of real speech vary from frame to frame in every codebook, the transformer and every
residual branch change the codes, and different voices give clearly different x-vectors.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from typing import Any

import torch

# encoder_config fields of the tiny checkpoints: the strides (1920 samples per frame), the 32
# quantizers of 2048 entries, and everything else keep their released values.
TINY_ENCODER = {
    "num_filters": 8,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 8,
    "intermediate_size": 64,
    "codebook_dim": 16,
    "vector_quantization_hidden_dimension": 16,
    "upsample_groups": 32,  # Mimi's (unused) decoder-side upsampling groups must divide hidden_size
}
# speaker_encoder_config of the tiny Base checkpoints (enc_dim is the tiny talker width); the mel
# front end (128 bins) stays as released.
TINY_SPEAKER = {
    "enc_channels": [32, 32, 32, 32, 96],
    "enc_attention_channels": 16,
    "enc_se_channels": 16,
}
ENCODER_LAYER_SCALE = 0.3  # transformer residual gains (released init 0.01 would hide the transformer)
CODEBOOK_STD = 0.6  # per-entry std of encoder codebook vectors, relative to the projected input's
BIAS_STD = 0.02
FIRST_GAIN = 1.0  # speaker encoder's first TDNN
FC_GAIN = 0.4  # speaker encoder output projection: x-vector rms ~1, like a codec embedding row
NORM_STD = 0.05


def tiny_encoder_config(speech_tokenizer_cfg: dict[str, Any]) -> dict[str, Any]:
    """A speech_tokenizer config.json dict with the encoder shrunk to `TINY_ENCODER`."""
    tiny = copy.deepcopy(speech_tokenizer_cfg)
    tiny["encoder_config"].update(TINY_ENCODER)
    return tiny


def speaker_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The speaker_encoder_config of a config.json dict with the reference's defaults filled in."""
    from ..config import SPEAKER_ENCODER_DEFAULTS

    return {**SPEAKER_ENCODER_DEFAULTS, **cfg["speaker_encoder_config"]}


def _draw(shape, std: float, gen: torch.Generator | None, dtype: torch.dtype, mean: float = 0.0) -> torch.Tensor:
    if gen is None:  # shapes only
        return torch.empty(shape, dtype=dtype, device="meta")
    return (mean + torch.randn(shape, generator=gen) * std).to(dtype)


def _conv(name: str, cout: int, cin: int, k: int, gen, dtype, gain: float = 1.0, bias: bool = True) -> Iterator:
    yield f"{name}.weight", _draw((cout, cin, k), gain / math.sqrt(cin * k), gen, dtype)
    if bias:
        yield f"{name}.bias", _draw((cout,), BIAS_STD, gen, dtype)


def speaker_tensors(cfg: dict[str, Any], gen: torch.Generator | None, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """Every `speaker_encoder.*` tensor for a config.json dict (a Base checkpoint's), released names."""
    s = speaker_config(cfg)
    ch, k = s["enc_channels"], s["enc_kernel_sizes"]
    scale, se, att = s["enc_res2net_scale"], s["enc_se_channels"], s["enc_attention_channels"]
    out = dict(_conv("speaker_encoder.blocks.0.conv", ch[0], s["mel_dim"], k[0], gen, dtype, gain=FIRST_GAIN))
    if gen is not None:  # zero-sum kernels ignore the log-mel's large constant level and see the spectrum's shape
        first = out["speaker_encoder.blocks.0.conv.weight"]
        out["speaker_encoder.blocks.0.conv.weight"] = first - first.mean(dim=(1, 2), keepdim=True)
    for i in range(1, len(ch) - 1):
        p = f"speaker_encoder.blocks.{i}."
        out.update(_conv(p + "tdnn1.conv", ch[i], ch[i - 1], 1, gen, dtype, gain=1.4))
        for j in range(scale - 1):
            width = ch[i] // scale
            out.update(_conv(f"{p}res2net_block.blocks.{j}.conv", width, width, k[i], gen, dtype, gain=1.4))
        out.update(_conv(p + "tdnn2.conv", ch[i], ch[i], 1, gen, dtype, gain=1.4))
        out.update(_conv(p + "se_block.conv1", se, ch[i], 1, gen, dtype))
        out.update(_conv(p + "se_block.conv2", ch[i], se, 1, gen, dtype))
    out.update(_conv("speaker_encoder.mfa.conv", ch[-1], sum(ch[1:-1]), k[-1], gen, dtype, gain=1.4))
    out.update(_conv("speaker_encoder.asp.tdnn.conv", att, 3 * ch[-1], 1, gen, dtype, gain=2.0))
    out.update(_conv("speaker_encoder.asp.conv", ch[-1], att, 1, gen, dtype, gain=3.0))
    out.update(_conv("speaker_encoder.fc", s["enc_dim"], 2 * ch[-1], 1, gen, dtype, gain=FC_GAIN))
    if gen is not None:  # zero-sum over the (non-negative) means and over the stds: no voice-independent offset
        fc = out["speaker_encoder.fc.weight"].view(s["enc_dim"], 2, ch[-1])
        out["speaker_encoder.fc.weight"] = (fc - fc.mean(dim=2, keepdim=True)).view(s["enc_dim"], 2 * ch[-1], 1)
    return out


def encoder_tensors(speech_cfg: dict[str, Any], gen: torch.Generator | None) -> dict[str, torch.Tensor]:
    """Every `encoder.*` tensor of speech_tokenizer/model.safetensors for its config dict, float32."""
    e, f32 = speech_cfg["encoder_config"], torch.float32
    out: dict[str, torch.Tensor] = {}
    dim, index = e["num_filters"], 1
    out.update(_conv("encoder.encoder.layers.0.conv", dim, e["audio_channels"], e["kernel_size"], gen, f32))
    for ratio in reversed(e["upsampling_ratios"]):
        hidden, p = dim // e["compress"], f"encoder.encoder.layers.{index}.block."
        out.update(_conv(p + "1.conv", hidden, dim, e["residual_kernel_size"], gen, f32, gain=1.4))
        out.update(_conv(p + "3.conv", dim, hidden, 1, gen, f32, gain=0.7))
        out.update(_conv(f"encoder.encoder.layers.{index + 2}.conv", 2 * dim, dim, 2 * ratio, gen, f32, gain=1.4))
        dim, index = 2 * dim, index + 3
    last = f"encoder.encoder.layers.{index + 1}.conv"
    out.update(_conv(last, e["hidden_size"], dim, e["last_kernel_size"], gen, f32))
    out.update(_encoder_transformer(e, gen))
    hop = math.prod(e["upsampling_ratios"])
    kernel = 2 * int(math.ceil(e["sampling_rate"] / hop) / e["_frame_rate"])  # Mimi's downsampling conv
    out.update(_conv("encoder.downsample.conv", e["hidden_size"], e["hidden_size"], kernel, gen, f32, bias=False))
    for group, n in (("semantic", e["num_semantic_quantizers"]), ("acoustic", e["num_quantizers"] - 1)):
        out.update(_quantizer(f"encoder.quantizer.{group}_residual_vector_quantizer.", n, e, gen))
    return out


def _encoder_transformer(e: dict[str, Any], gen) -> Iterator[tuple[str, torch.Tensor]]:
    H, inner, f32 = e["hidden_size"], e["intermediate_size"], torch.float32
    attn, kv = e["num_attention_heads"] * e["head_dim"], e["num_key_value_heads"] * e["head_dim"]
    projections = {"q_proj": (attn, H), "k_proj": (kv, H), "v_proj": (kv, H), "o_proj": (H, attn)}
    for i in range(e["num_hidden_layers"]):
        p = f"encoder.encoder_transformer.layers.{i}."
        for name, (rows, cols) in projections.items():
            yield p + f"self_attn.{name}.weight", _draw((rows, cols), 1 / math.sqrt(cols), gen, f32)
        yield p + "mlp.fc1.weight", _draw((inner, H), 1 / math.sqrt(H), gen, f32)
        yield p + "mlp.fc2.weight", _draw((H, inner), 1 / math.sqrt(inner), gen, f32)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            yield p + f"{norm}.weight", _draw((H,), NORM_STD, gen, f32, mean=1.0)
            yield p + f"{norm}.bias", _draw((H,), BIAS_STD, gen, f32)
        for scale in ("self_attn_layer_scale", "mlp_layer_scale"):
            yield p + f"{scale}.scale", _draw((H,), NORM_STD * ENCODER_LAYER_SCALE, gen, f32, ENCODER_LAYER_SCALE)


def _quantizer(prefix: str, n: int, e: dict[str, Any], gen) -> Iterator[tuple[str, torch.Tensor]]:
    """input/output projections and n codebooks; entry std shrinks with depth like a residual's."""
    H, dim, size, f32 = e["hidden_size"], e["codebook_dim"], e["codebook_size"], torch.float32
    yield prefix + "input_proj.weight", _draw((dim, H, 1), 1 / math.sqrt(H), gen, f32)
    yield prefix + "output_proj.weight", _draw((H, dim, 1), 1 / math.sqrt(dim), gen, f32)
    for i in range(n):
        p = f"{prefix}layers.{i}.codebook."
        usage = None if gen is None else 0.5 + 1.5 * torch.rand(size, generator=gen)
        vectors = _draw((size, dim), CODEBOOK_STD * 0.9**i, gen, f32)
        yield p + "initialized", torch.ones(1) if gen is not None else torch.empty(1, device="meta")
        yield p + "cluster_usage", usage if gen is not None else torch.empty(size, device="meta")
        yield p + "embed_sum", vectors * usage[:, None] if gen is not None else vectors
