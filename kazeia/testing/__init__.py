"""Random-weight checkpoints in the released layout, for tests and benchmarks.

`write_checkpoint(dir, size="0.6B", kind="custom_voice", tiny=True)` writes config.json,
generation_config.json, tokenizer files, model.safetensors and speech_tokenizer/{config.json,
model.safetensors} exactly as a released Qwen3-TTS 12 Hz checkpoint lays them out. The JSON and
tokenizer files are the released ones (shipped in `kazeia/reference_files`); the weights are
deterministic random tensors. `tiny=True` shrinks every width and depth (token ids, codec ids,
vocabularies and the 1920-samples-per-frame upsampling stay as released) so that the whole engine
runs in seconds; `tiny=False` keeps the real dimensions, for benchmarks.

Scales: linear weights ~ N(0, 1/fan_in) keep activations near unit RMS through the stacks, so the
random model behaves like a transformer rather than saturating; embeddings ~ N(0, 1); norms at 1.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from .clone import TINY_SPEAKER, encoder_tensors, speaker_tensors, tiny_encoder_config
from .vocoder import random_vocoder_tensors, tiny_speech_tokenizer_config

FILES = Path(__file__).resolve().parent.parent / "reference_files"
CHECKPOINTS = {
    ("0.6B", "custom_voice"): "Qwen3-TTS-12Hz-0.6B-CustomVoice",
    ("1.7B", "custom_voice"): "Qwen3-TTS-12Hz-1.7B-CustomVoice",
    ("1.7B", "voice_design"): "Qwen3-TTS-12Hz-1.7B-VoiceDesign",
    ("0.6B", "base"): "Qwen3-TTS-12Hz-0.6B-Base",
    ("1.7B", "base"): "Qwen3-TTS-12Hz-1.7B-Base",
}
# Tiny widths. The 1.7B-like talker is wider than its code predictor, as in the release, so the
# small_to_mtp projection exists; the 0.6B-like one has equal widths and no projection.
TINY_TALKER = {"0.6B": 64, "1.7B": 96}
TINY_STACK = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128)
TINY_PREDICTOR = dict(hidden_size=64, **TINY_STACK)
TINY_TEXT_HIDDEN = 32


def model_config(size: str, kind: str, tiny: bool) -> dict:
    """The released config.json of (size, kind), shrunk when `tiny`."""
    name = CHECKPOINTS.get((size, kind))
    if name is None:
        choices = sorted(CHECKPOINTS)
        raise ValueError(f"no released checkpoint of size {size!r} and kind {kind!r}; choose from {choices}")
    cfg = json.loads((FILES / name / "config.json").read_text())
    if tiny:
        talker = cfg["talker_config"]
        talker.update(hidden_size=TINY_TALKER[size], text_hidden_size=TINY_TEXT_HIDDEN, **TINY_STACK)
        talker["code_predictor_config"].update(TINY_PREDICTOR)
        if kind == "base":
            cfg["speaker_encoder_config"].update(TINY_SPEAKER, enc_dim=TINY_TALKER[size])
    return cfg


def _normal(shape: tuple[int, ...], std: float, gen: torch.Generator | None, dtype: torch.dtype) -> torch.Tensor:
    if gen is None:  # shapes only
        return torch.empty(shape, dtype=dtype, device="meta")
    return (torch.randn(shape, generator=gen) * std).to(dtype)


def _linear(out: int, inp: int, gen, dtype) -> torch.Tensor:
    return _normal((out, inp), inp**-0.5, gen, dtype)


def _stack_tensors(prefix: str, c: dict, gen, dtype) -> dict[str, torch.Tensor]:
    """Tensors of one Qwen3 decoder stack (layers + final norm) under `prefix`."""
    H, inner, hd = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    ones = lambda n: torch.ones(n, dtype=dtype, device="cpu" if gen is not None else "meta")  # noqa: E731
    out = {f"{prefix}norm.weight": ones(H)}
    for i in range(c["num_hidden_layers"]):
        p = f"{prefix}layers.{i}."
        out.update(
            {
                p + "input_layernorm.weight": ones(H),
                p + "post_attention_layernorm.weight": ones(H),
                p + "self_attn.q_proj.weight": _linear(q, H, gen, dtype),
                p + "self_attn.k_proj.weight": _linear(kv, H, gen, dtype),
                p + "self_attn.v_proj.weight": _linear(kv, H, gen, dtype),
                p + "self_attn.o_proj.weight": _linear(H, q, gen, dtype),
                p + "self_attn.q_norm.weight": ones(hd),
                p + "self_attn.k_norm.weight": ones(hd),
                p + "mlp.gate_proj.weight": _linear(inner, H, gen, dtype),
                p + "mlp.up_proj.weight": _linear(inner, H, gen, dtype),
                p + "mlp.down_proj.weight": _linear(H, inner, gen, dtype),
            }
        )
    return out


def model_tensors(
    cfg: dict, gen: torch.Generator | None, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """Every tensor of `model.safetensors` for a config.json dict, with released names.

    With `gen=None` the tensors live on the meta device (names and shapes only)."""
    t, cp = cfg["talker_config"], cfg["talker_config"]["code_predictor_config"]
    H, T, P = t["hidden_size"], t["text_hidden_size"], cp["hidden_size"]
    out = _stack_tensors("talker.model.", t, gen, dtype)
    out.update(
        {
            "talker.model.text_embedding.weight": _normal((t["text_vocab_size"], T), 1.0, gen, dtype),
            "talker.model.codec_embedding.weight": _normal((t["vocab_size"], H), 1.0, gen, dtype),
            "talker.text_projection.linear_fc1.weight": _linear(T, T, gen, dtype),
            "talker.text_projection.linear_fc1.bias": _normal((T,), 0.02, gen, dtype),
            "talker.text_projection.linear_fc2.weight": _linear(H, T, gen, dtype),
            "talker.text_projection.linear_fc2.bias": _normal((H,), 0.02, gen, dtype),
            "talker.codec_head.weight": _linear(t["vocab_size"], H, gen, dtype),
        }
    )
    out.update(_stack_tensors("talker.code_predictor.model.", cp, gen, dtype))
    for g in range(t["num_code_groups"] - 1):
        embedding = _normal((cp["vocab_size"], H), 1.0, gen, dtype)
        out[f"talker.code_predictor.model.codec_embedding.{g}.weight"] = embedding
        out[f"talker.code_predictor.lm_head.{g}.weight"] = _linear(cp["vocab_size"], P, gen, dtype)
    if H != P:
        out["talker.code_predictor.small_to_mtp_projection.weight"] = _linear(P, H, gen, dtype)
        out["talker.code_predictor.small_to_mtp_projection.bias"] = _normal((P,), 0.02, gen, dtype)
    if cfg["tts_model_type"] == "base":
        out.update(speaker_tensors(cfg, gen, dtype))
    return out


def write_checkpoint(
    directory: str | Path,
    size: str = "0.6B",
    kind: str = "custom_voice",
    *,
    tiny: bool = True,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write a complete random-weight checkpoint directory; returns its path."""
    root = Path(directory)
    (root / "speech_tokenizer").mkdir(parents=True, exist_ok=True)
    cfg = model_config(size, kind, tiny)
    source = FILES / CHECKPOINTS[(size, kind)]
    for name in ("generation_config.json", "tokenizer_config.json", "preprocessor_config.json"):
        shutil.copyfile(source / name, root / name)
    for name in ("vocab.json", "merges.txt"):
        shutil.copyfile(FILES / "text-tokenizer" / name, root / name)
    preprocessor = "speech_tokenizer/preprocessor_config.json"
    shutil.copyfile(source / preprocessor, root / preprocessor)
    (root / "config.json").write_text(json.dumps(cfg, indent=2))
    speech_cfg = json.loads((source / "speech_tokenizer" / "config.json").read_text())
    if tiny:
        speech_cfg = tiny_encoder_config(tiny_speech_tokenizer_config(speech_cfg))
    (root / "speech_tokenizer" / "config.json").write_text(json.dumps(speech_cfg, indent=2))

    gen = torch.Generator().manual_seed(seed)
    save_file(model_tensors(cfg, gen, dtype), str(root / "model.safetensors"))
    from ..config import VocoderConfig

    vocoder_cfg = VocoderConfig.from_file(root / "speech_tokenizer" / "config.json")
    vocoder = random_vocoder_tensors(vocoder_cfg, gen)
    if kind == "base":  # the encoder turns reference audio into codes (voice cloning)
        vocoder.update(encoder_tensors(speech_cfg, gen))
    save_file(vocoder, str(root / "speech_tokenizer" / "model.safetensors"))
    return root
