"""Frozen configuration dataclasses read from a released checkpoint's JSON files.

Scope: `config.json` (talker + code predictor, and the speaker encoder of Base checkpoints) and
`speech_tokenizer/config.json` (the vocoder and the encoder); `generation_config.json` holds the
sampling defaults, read by `SamplingOptions.from_file` (kazeia/sampling.py). Every field the
engine uses is read explicitly; a missing key is a `CheckpointError` naming the file and the key.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

MODEL_TYPE = "qwen3_tts"
TOKENIZER_TYPE = "qwen3_tts_tokenizer_12hz"
TTS_MODEL_TYPES = ("custom_voice", "voice_design", "base")


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete or inconsistent; the message names the file or tensor."""


def read_json(path: Path) -> dict[str, Any]:
    """Read a JSON object from `path`, turning every failure into a `CheckpointError`."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"missing file: {path}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} does not hold a JSON object")
    return data


class _Fields:
    """Typed access to one JSON object; a missing key or a wrong type names file and key."""

    def __init__(self, data: Mapping[str, Any], where: str):
        self.data, self.where = data, where

    def get(self, key: str, kind: type | tuple[type, ...] = object) -> Any:
        if key not in self.data:
            raise CheckpointError(f"{self.where}: missing key {key!r}")
        value = self.data[key]
        if kind in (int, float) and isinstance(value, bool):
            raise CheckpointError(f"{self.where}: key {key!r} must be a number, got {value!r}")
        if kind is float and isinstance(value, int):
            value = float(value)
        if not isinstance(value, kind):
            raise CheckpointError(f"{self.where}: key {key!r} has unexpected value {value!r}")
        return value

    def sub(self, key: str) -> _Fields:
        return _Fields(self.get(key, dict), f"{self.where}.{key}")


@dataclass(frozen=True)
class TransformerConfig:
    """A Qwen3 decoder stack (talker or code predictor)."""

    hidden_size: int  # model width H
    num_layers: int
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (grouped-query attention)
    head_dim: int
    intermediate_size: int  # SwiGLU width
    rms_norm_eps: float
    rope_theta: float
    max_positions: int  # positions the rotary embedding was trained for (max_position_embeddings)

    @classmethod
    def read(cls, f: _Fields) -> TransformerConfig:
        return cls(
            hidden_size=f.get("hidden_size", int),
            num_layers=f.get("num_hidden_layers", int),
            num_heads=f.get("num_attention_heads", int),
            num_kv_heads=f.get("num_key_value_heads", int),
            head_dim=f.get("head_dim", int),
            intermediate_size=f.get("intermediate_size", int),
            rms_norm_eps=f.get("rms_norm_eps", float),
            rope_theta=f.get("rope_theta", float),
            max_positions=f.get("max_position_embeddings", int),
        )


@dataclass(frozen=True)
class TalkerConfig:
    """The talker: transformer dims plus its codec vocabulary and conditioning tables."""

    stack: TransformerConfig
    vocab_size: int  # codec vocabulary: 0..2047 codebook-0 codes, 2048..3071 control rows
    text_vocab_size: int  # rows of the text embedding (151936)
    text_hidden_size: int  # width of the text embedding (2048)
    num_code_groups: int  # codebooks per frame (16)
    codec_pad_id: int
    codec_bos_id: int
    codec_eos_id: int
    codec_think_id: int
    codec_nothink_id: int
    codec_think_bos_id: int
    codec_think_eos_id: int
    language_ids: Mapping[str, int]  # lower-case language name -> codec row
    speaker_ids: Mapping[str, int]  # lower-case speaker name -> codec row (CustomVoice only)
    speaker_dialects: Mapping[str, str | None]  # speaker -> dialect language key, or None


@dataclass(frozen=True)
class ModelConfig:
    """Top-level `config.json` of a Qwen3-TTS 12 Hz checkpoint."""

    tts_model_type: str  # "custom_voice" | "voice_design" | "base"
    tts_model_size: str  # "0b6" | "1b7"
    tts_pad_id: int  # text-track token ids
    tts_bos_id: int
    tts_eos_id: int
    im_start_id: int
    im_end_id: int
    assistant_id: int
    talker: TalkerConfig
    code_predictor: TransformerConfig
    code_predictor_vocab: int  # 2048 codes per residual codebook
    transformers_version: str  # recorded by the exporter; decides the tokenizer regex quirk

    @property
    def has_mtp_projection(self) -> bool:
        """True when talker and code predictor widths differ (1.7B: a 2048 -> 1024 projection)."""
        return self.talker.stack.hidden_size != self.code_predictor.hidden_size

    @classmethod
    def from_file(cls, path: Path) -> ModelConfig:
        f = _Fields(read_json(path), str(path))
        model_type = f.get("model_type", str)
        if model_type != MODEL_TYPE:
            raise CheckpointError(f"{path}: model_type is {model_type!r}, expected {MODEL_TYPE!r}")
        kind = f.get("tts_model_type", str)
        if kind not in TTS_MODEL_TYPES:
            raise CheckpointError(f"{path}: unknown tts_model_type {kind!r}")
        t = f.sub("talker_config")
        cp = t.sub("code_predictor_config")
        dialects = {k.lower(): (v or None) for k, v in t.get("spk_is_dialect", dict).items()}
        talker = TalkerConfig(
            stack=TransformerConfig.read(t),
            vocab_size=t.get("vocab_size", int),
            text_vocab_size=t.get("text_vocab_size", int),
            text_hidden_size=t.get("text_hidden_size", int),
            num_code_groups=t.get("num_code_groups", int),
            codec_pad_id=t.get("codec_pad_id", int),
            codec_bos_id=t.get("codec_bos_id", int),
            codec_eos_id=t.get("codec_eos_token_id", int),
            codec_think_id=t.get("codec_think_id", int),
            codec_nothink_id=t.get("codec_nothink_id", int),
            codec_think_bos_id=t.get("codec_think_bos_id", int),
            codec_think_eos_id=t.get("codec_think_eos_id", int),
            language_ids=_frozen_map(t.get("codec_language_id", dict)),
            speaker_ids=_frozen_map(t.get("spk_id", dict)),
            speaker_dialects=MappingProxyType(dialects),
        )
        return cls(
            tts_model_type=kind,
            tts_model_size=f.get("tts_model_size", str),
            tts_pad_id=f.get("tts_pad_token_id", int),
            tts_bos_id=f.get("tts_bos_token_id", int),
            tts_eos_id=f.get("tts_eos_token_id", int),
            im_start_id=f.get("im_start_token_id", int),
            im_end_id=f.get("im_end_token_id", int),
            assistant_id=f.get("assistant_token_id", int),
            talker=talker,
            code_predictor=TransformerConfig.read(cp),
            code_predictor_vocab=cp.get("vocab_size", int),
            transformers_version=str(f.data.get("transformers_version", "")),
        )


def _frozen_map(d: Mapping[str, Any]) -> Mapping[str, Any]:
    return MappingProxyType({str(k).lower(): v for k, v in d.items()})


@dataclass(frozen=True)
class VocoderConfig:
    """The speech-tokenizer decoder (`speech_tokenizer/config.json`, `decoder_config`)."""

    num_quantizers: int  # codebooks per frame (16)
    codebook_size: int  # entries per codebook (2048)
    codebook_dim: int  # RVQ output width (512); each codebook vector has codebook_dim // 2
    latent_dim: int  # pre_conv / transformer in-out width (1024)
    hidden_size: int  # transformer width (512)
    num_layers: int
    num_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    sliding_window: int  # keys visible to each query, itself included (72)
    decoder_dim: int  # width after decoder[0] (1536)
    upsample_rates: tuple[int, ...]  # BigVGAN-style block strides (8, 5, 4, 3)
    upsampling_ratios: tuple[int, ...]  # ConvNeXt pre-upsample strides (2, 2)
    samples_per_frame: int  # decode_upsample_rate (1920)
    sample_rate: int  # output_sample_rate (24000)

    @classmethod
    def from_file(cls, path: Path) -> VocoderConfig:
        top = _Fields(read_json(path), str(path))
        model_type = top.get("model_type", str)
        if model_type != TOKENIZER_TYPE:
            raise CheckpointError(f"{path}: model_type is {model_type!r}, expected {TOKENIZER_TYPE!r}")
        f = top.sub("decoder_config")
        cfg = cls(
            num_quantizers=f.get("num_quantizers", int),
            codebook_size=f.get("codebook_size", int),
            codebook_dim=f.get("codebook_dim", int),
            latent_dim=f.get("latent_dim", int),
            hidden_size=f.get("hidden_size", int),
            num_layers=f.get("num_hidden_layers", int),
            num_heads=f.get("num_attention_heads", int),
            head_dim=f.get("head_dim", int),
            intermediate_size=f.get("intermediate_size", int),
            rms_norm_eps=f.get("rms_norm_eps", float),
            rope_theta=f.get("rope_theta", float),
            sliding_window=f.get("sliding_window", int),
            decoder_dim=f.get("decoder_dim", int),
            upsample_rates=tuple(f.get("upsample_rates", list)),
            upsampling_ratios=tuple(f.get("upsampling_ratios", list)),
            samples_per_frame=top.get("decode_upsample_rate", int),
            sample_rate=top.get("output_sample_rate", int),
        )
        total = math.prod(cfg.upsample_rates + cfg.upsampling_ratios)
        if total != cfg.samples_per_frame:
            raise CheckpointError(
                f"{path}: upsampling factors multiply to {total}, but decode_upsample_rate is {cfg.samples_per_frame}"
            )
        return cfg


@dataclass(frozen=True)
class EncoderConfig:
    """The speech-tokenizer encoder (`speech_tokenizer/config.json`, `encoder_config`): audio -> codes.

    A Mimi encoder: SEANet convolutions (total stride prod(strides), 25 Hz), a causal transformer,
    a stride-2 downsampling conv (12.5 Hz) and a split residual vector quantizer of which the first
    `valid_quantizers` codebooks are kept.
    """

    num_filters: int  # channels after the first conv (64); doubled by every strided conv
    kernel_size: int  # first conv (7)
    last_kernel_size: int  # last conv (3)
    residual_kernel_size: int  # residual blocks' first conv (3)
    num_residual_layers: int  # residual blocks before each strided conv (1)
    dilation_growth_rate: int  # dilation of residual block j: rate**j
    compress: int  # residual block hidden width = channels // compress
    strides: tuple[int, ...]  # strided convs in order (4, 5, 6, 8): reversed `upsampling_ratios`
    hidden_size: int  # transformer width (512)
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # GELU MLP width
    norm_eps: float  # LayerNorm eps
    rope_theta: float
    num_quantizers: int  # codebooks in the checkpoint (32: 1 semantic + 31 acoustic)
    num_semantic_quantizers: int  # 1
    valid_quantizers: int  # codebooks kept per frame (`encoder_valid_num_quantizers`, 16)
    codebook_size: int  # 2048
    codebook_dim: int  # width of a codebook vector (256)
    downsample_kernel: int  # kernel of the stride-2 downsampling conv (4)
    samples_per_frame: int  # `encode_downsample_rate` (1920)
    sample_rate: int  # `input_sample_rate` (24000)

    @property
    def downsample_stride(self) -> int:
        return self.samples_per_frame // math.prod(self.strides)

    @classmethod
    def from_file(cls, path: Path) -> EncoderConfig:
        top = _Fields(read_json(path), str(path))
        f = top.sub("encoder_config")
        for key, expected in (("use_causal_conv", True), ("use_conv_shortcut", False), ("pad_mode", "constant")):
            if f.get(key) != expected:
                raise CheckpointError(f"{path}: encoder_config.{key} is {f.get(key)!r}; only {expected!r} is supported")
        if f.get("hidden_act", str) != "gelu" or f.get("audio_channels", int) != 1:
            raise CheckpointError(f"{path}: encoder_config must have hidden_act 'gelu' and audio_channels 1")
        if f.get("codebook_dim", int) != f.get("vector_quantization_hidden_dimension", int):
            raise CheckpointError(f"{path}: encoder_config codebook_dim != vector_quantization_hidden_dimension")
        strides = tuple(reversed(f.get("upsampling_ratios", list)))
        hop = math.prod(strides)
        # Mimi: kernel 2 * int(ceil(sampling_rate / hop) / frame_rate), stride 2.
        kernel = 2 * int(-(-f.get("sampling_rate", int) // hop) / f.get("_frame_rate", float))
        cfg = cls(
            num_filters=f.get("num_filters", int),
            kernel_size=f.get("kernel_size", int),
            last_kernel_size=f.get("last_kernel_size", int),
            residual_kernel_size=f.get("residual_kernel_size", int),
            num_residual_layers=f.get("num_residual_layers", int),
            dilation_growth_rate=f.get("dilation_growth_rate", int),
            compress=f.get("compress", int),
            strides=strides,
            hidden_size=f.get("hidden_size", int),
            num_layers=f.get("num_hidden_layers", int),
            num_heads=f.get("num_attention_heads", int),
            num_kv_heads=f.get("num_key_value_heads", int),
            head_dim=f.get("head_dim", int),
            intermediate_size=f.get("intermediate_size", int),
            norm_eps=f.get("norm_eps", float),
            rope_theta=f.get("rope_theta", float),
            num_quantizers=f.get("num_quantizers", int),
            num_semantic_quantizers=f.get("num_semantic_quantizers", int),
            valid_quantizers=top.get("encoder_valid_num_quantizers", int),
            codebook_size=f.get("codebook_size", int),
            codebook_dim=f.get("codebook_dim", int),
            downsample_kernel=kernel,
            samples_per_frame=top.get("encode_downsample_rate", int),
            sample_rate=top.get("input_sample_rate", int),
        )
        if hop * 2 != cfg.samples_per_frame:
            raise CheckpointError(
                f"{path}: encoder strides give {hop * 2} samples per frame, not {cfg.samples_per_frame}"
            )
        if not cfg.num_semantic_quantizers < cfg.valid_quantizers <= cfg.num_quantizers:
            raise CheckpointError(f"{path}: encoder_valid_num_quantizers {cfg.valid_quantizers} out of range")
        return cfg


# Speaker-encoder fields the released config.json leaves out; these are the reference's class
# defaults (`Qwen3TTSSpeakerEncoderConfig`), used exactly as the reference uses them.
SPEAKER_ENCODER_DEFAULTS = {
    "mel_dim": 128,
    "enc_channels": [512, 512, 512, 512, 1536],
    "enc_kernel_sizes": [5, 3, 3, 3, 1],
    "enc_dilations": [1, 2, 3, 4, 1],
    "enc_attention_channels": 128,
    "enc_res2net_scale": 8,
    "enc_se_channels": 128,
    "sample_rate": 24000,
}


@dataclass(frozen=True)
class SpeakerEncoderConfig:
    """The ECAPA-TDNN speaker encoder of Base checkpoints (`config.json`, `speaker_encoder_config`)."""

    mel_dim: int  # log-mel bins of the input (128)
    enc_dim: int  # x-vector width = talker hidden size (1024 / 2048)
    channels: tuple[int, ...]  # first TDNN, the SE-Res2Net blocks, then the aggregation layer
    kernel_sizes: tuple[int, ...]
    dilations: tuple[int, ...]
    attention_channels: int  # attentive statistics pooling bottleneck (128)
    res2net_scale: int  # Res2Net splits (8)
    se_channels: int  # squeeze-excitation bottleneck (128)
    sample_rate: int  # Hz of the audio the mel front end expects (24000)

    @classmethod
    def from_file(cls, path: Path) -> SpeakerEncoderConfig:
        """Read `speaker_encoder_config` of a Base checkpoint's config.json; absent fields take the
        reference's defaults, but enc_dim must be there and equal the talker width."""
        top = _Fields(read_json(path), str(path))
        f = top.sub("speaker_encoder_config")
        values = {**SPEAKER_ENCODER_DEFAULTS, **f.data}
        g = _Fields(values, f.where)
        cfg = cls(
            mel_dim=g.get("mel_dim", int),
            enc_dim=f.get("enc_dim", int),
            channels=tuple(g.get("enc_channels", list)),
            kernel_sizes=tuple(g.get("enc_kernel_sizes", list)),
            dilations=tuple(g.get("enc_dilations", list)),
            attention_channels=g.get("enc_attention_channels", int),
            res2net_scale=g.get("enc_res2net_scale", int),
            se_channels=g.get("enc_se_channels", int),
            sample_rate=g.get("sample_rate", int),
        )
        if not len(cfg.channels) == len(cfg.kernel_sizes) == len(cfg.dilations) >= 3:
            raise CheckpointError(f"{path}: speaker_encoder_config channel, kernel and dilation lists differ in length")
        width = top.sub("talker_config").get("hidden_size", int)
        if cfg.enc_dim != width:
            raise CheckpointError(f"{path}: speaker_encoder_config.enc_dim {cfg.enc_dim} != talker hidden_size {width}")
        return cfg
