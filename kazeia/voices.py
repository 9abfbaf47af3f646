"""Clone voices of the Base checkpoints: made once from reference audio, saved, reused.

Scope: `Voice` (an x-vector, plus the reference's codes and transcript in ICL mode, and the
identity of the checkpoint it was made for), its file format (one safetensors file whose metadata
holds the JSON fields), `Cloner` (the two encoders of a Base checkpoint: reference audio -> codes
and x-vector) and `Priming` (the vocoder state after the reference frames, cached per voice, which
ICL audio continues from, and the reference samples the reference package's cut keeps before it).
Non-goals: prompt layouts (prompt.py), audio file decoding (audio.py).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .config import ModelConfig, SpeakerEncoderConfig
from .encoder import Encoder
from .lru import LRU
from .speaker import SpeakerEncoder
from .vocoder import Vocoder, VocoderState, WindowCache

FORMAT = "kazeia.voice/1"  # metadata "format" of voice files this version reads and writes
METADATA_KEY = "kazeia.voice"  # safetensors metadata entry holding the JSON fields
MODES = ("icl", "x_vector")


@dataclass(frozen=True)
class VoiceModel:
    """The checkpoint a voice belongs to: an x-vector only means something to the talker trained
    with the speaker encoder that made it."""

    size: str  # tts_model_size of the checkpoint ("0b6" | "1b7")
    width: int  # x-vector width = talker hidden size
    speaker_encoder: str  # sha256 (hex) of the speaker-encoder weights in float32

    def describe(self) -> str:
        return f"a {self.size} Base checkpoint (width {self.width}, speaker encoder {self.speaker_encoder[:12]})"


@dataclass(frozen=True, eq=False)
class Voice:
    """A cloned voice. Make one with `Engine.create_voice`, pass it as `voice=` to `synthesize` or
    `stream` as often as needed (nothing is re-encoded), keep it with `save` / `Voice.load`."""

    x_vector: torch.Tensor  # (width,) float32 speaker embedding of the reference audio
    ref_codes: torch.Tensor | None  # (frames, 16) int64 codes of the reference audio; ICL mode only
    ref_text: str | None  # transcript of the reference audio; ICL mode only
    model: VoiceModel

    def __post_init__(self) -> None:
        x = self.x_vector
        if not isinstance(x, torch.Tensor) or x.dim() != 1 or not x.is_floating_point():
            raise ValueError("voice x_vector must be a 1-D float tensor")
        if x.shape[0] != self.model.width:
            raise ValueError(f"voice x_vector has {x.shape[0]} values, its model says {self.model.width}")
        if not bool(torch.isfinite(x).all()):  # it would make every utterance's prompt NaN
            raise ValueError(
                "voice x_vector holds NaN or infinite values: the reference audio gave no usable embedding"
            )
        if (self.ref_codes is None) != (self.ref_text is None):
            raise ValueError("an ICL voice needs both ref_codes and ref_text; an x-vector voice neither")
        codes = self.ref_codes
        if codes is not None:
            if codes.dim() != 2 or codes.shape[0] < 1 or codes.dtype != torch.int64:
                raise ValueError(f"voice ref_codes must be int64 of shape (frames, 16), got {tuple(codes.shape)}")
            if not isinstance(self.ref_text, str) or not self.ref_text.strip():
                raise ValueError("voice ref_text must be a non-empty string")

    @property
    def mode(self) -> str:
        """ "icl" (reference codes + transcript + x-vector) or "x_vector" (x-vector only)."""
        return "icl" if self.ref_codes is not None else "x_vector"

    @property
    def ref_frames(self) -> int:
        """Frames (80 ms) of reference audio the voice carries (0 in x-vector mode)."""
        return 0 if self.ref_codes is None else int(self.ref_codes.shape[0])

    def save(self, path: str | os.PathLike) -> None:
        """Write the voice to one safetensors file (written to a temporary name, then renamed)."""
        from safetensors import SafetensorError
        from safetensors.torch import save_file

        tensors = {"x_vector": self.x_vector.detach().float().cpu().contiguous()}
        if self.ref_codes is not None:
            tensors["ref_codes"] = self.ref_codes.detach().cpu().contiguous()
        meta = {"format": FORMAT, "mode": self.mode, "ref_text": self.ref_text, "model": self.model.__dict__}
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        try:
            save_file(tensors, str(tmp), metadata={METADATA_KEY: json.dumps(meta, ensure_ascii=False)})
            os.replace(tmp, path)
        except (OSError, SafetensorError) as e:
            tmp.unlink(missing_ok=True)
            raise ValueError(f"cannot write voice file {path}: {e}") from None

    @classmethod
    def load(cls, path: str | os.PathLike) -> Voice:
        """Read a voice file written by `save`; anything else is a ValueError naming the file."""
        tensors, meta = _read_voice_file(Path(path))
        try:
            model = VoiceModel(**meta["model"])
            if meta["format"] != FORMAT or meta["mode"] not in MODES:
                raise ValueError(f"unsupported format {meta['format']!r} / mode {meta['mode']!r}")
            icl = meta["mode"] == "icl"
            if set(tensors) != ({"x_vector", "ref_codes"} if icl else {"x_vector"}):
                raise ValueError(f"tensors {sorted(tensors)} do not match mode {meta['mode']!r}")
            return cls(tensors["x_vector"], tensors.get("ref_codes"), meta["ref_text"] if icl else None, model)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path} is not a valid Kazeia voice file: {e}") from None


def _read_voice_file(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    from safetensors import SafetensorError, safe_open

    if not path.is_file():
        raise ValueError(f"no voice file at {path}")
    try:
        with safe_open(str(path), "pt") as f:
            text = (f.metadata() or {}).get(METADATA_KEY)
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise ValueError(f"{path} is not a Kazeia voice file: {e}") from None
    if text is None:
        raise ValueError(f"{path} is a safetensors file but not a Kazeia voice file (no {METADATA_KEY!r} metadata)")
    try:
        meta = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: corrupt voice metadata: {e}") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{path}: corrupt voice metadata")
    return tensors, meta


class Cloner:
    """The two encoders of a Base checkpoint, float32 on the engine's device."""

    def __init__(self, encoder: Encoder, speaker: SpeakerEncoder, model: VoiceModel):
        self.encoder, self.speaker, self.model = encoder, speaker, model

    @classmethod
    def load(cls, root: Path, cfg: ModelConfig, device: torch.device | str) -> Cloner:
        """Load `speaker_encoder.*` of model.safetensors and `encoder.*` of speech_tokenizer/model.safetensors."""
        speaker_cfg = SpeakerEncoderConfig.from_file(root / "config.json")
        speaker = SpeakerEncoder.load(speaker_cfg, root / "model.safetensors", device)
        encoder = Encoder.load(root / "speech_tokenizer", device)
        model = VoiceModel(cfg.tts_model_size, speaker.cfg.enc_dim, _fingerprint(speaker))
        return cls(encoder, speaker, model)

    def encode(self, audio: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Mono float32 audio at 24 kHz -> (codes (frames, 16) int64, x-vector (width,) float32), on the CPU."""
        device = next(self.speaker.parameters()).device
        wave = torch.from_numpy(np.ascontiguousarray(audio, dtype=np.float32))[None].to(device)  # (1, L)
        codes = self.encoder(wave)[0].cpu()
        x_vector = self.speaker(wave)[0].cpu()
        return codes, x_vector


def _fingerprint(module: torch.nn.Module) -> str:
    """sha256 over the module's tensors (names, shapes and float32 values), in name order."""
    digest = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        digest.update(f"{name}:{tuple(tensor.shape)};".encode())
        digest.update(tensor.detach().float().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


@dataclass(frozen=True)
class Primed:
    """The vocoder after decoding a voice's reference frames."""

    state: VocoderState  # never advanced itself: callers continue from `copy_state(state)`
    tail: np.ndarray  # (1920,) float32, the last frame of the reference's audio


def copy_state(state: VocoderState) -> VocoderState:
    """An independent copy of a streaming vocoder state."""
    caches = [WindowCache(c.k.clone(), c.v.clone()) for c in state.caches]
    return VocoderState(tails=[t.clone() for t in state.tails], caches=caches, position=state.position)


def icl_cut(ref_frames: int, total_frames: int, samples: int) -> int:
    """Samples the reference drops from the decode of reference + generated frames in ICL mode:
    `int(ref_len / total_len * n_samples)` in double precision, exactly as qwen-tts computes it.
    Float rounding makes it ref_frames * 1920 - 1 (keeping the reference's last sample) for about
    4% of length pairs, ref_frames * 1920 otherwise."""
    return int(ref_frames / max(total_frames, 1) * samples)


class Priming:
    """Where an ICL voice's audio continues from: the vocoder state after its reference frames,
    cached for recently used voices (least recently used dropped), keyed by the reference codes,
    so a voice's reference frames are decoded once, not per call."""

    def __init__(self, vocoder: Vocoder, capacity: int = 8):
        self.vocoder = vocoder
        self._primed: LRU[bytes, Primed] = LRU(capacity)  # by the reference codes' hash and shape

    def state(self, ref: torch.Tensor) -> VocoderState:
        """A fresh copy of the state after an ICL voice's reference codes `ref` (frames, 16), to
        stream from."""
        return copy_state(self._get(ref).state)

    def lead(self, ref: torch.Tensor, generated: int) -> np.ndarray:
        """The reference samples that come before the audio of `generated` frames made after the
        reference codes `ref` (frames, 16). The reference package decodes reference + generated
        frames and drops the first `icl_cut(...)` samples, which keeps 0 samples of the reference,
        or 1 by its float rounding; the generated frames' own audio is their decode on `state(ref)`."""
        per_frame = self.vocoder.cfg.samples_per_frame
        total = ref.shape[0] + generated
        kept = ref.shape[0] * per_frame - icl_cut(ref.shape[0], total, total * per_frame)
        tail = self._get(ref).tail
        return tail[len(tail) - kept :]

    @torch.inference_mode()
    def reference_chunked(self, ref: torch.Tensor, codes: torch.Tensor) -> np.ndarray:
        """The reference package's own decode of an ICL result, for comparisons: reference + generated
        frames with its 300-frame restarts, the first `icl_cut(...)` samples dropped."""
        per_frame = self.vocoder.cfg.samples_per_frame
        total = ref.shape[0] + codes.shape[0]
        both = torch.cat((ref, codes.cpu())).to(self.vocoder.pre_conv.conv.weight.device)
        return _numpy(self.vocoder.decode_reference_chunked(both))[icl_cut(ref.shape[0], total, total * per_frame) :]

    @torch.inference_mode()
    def _get(self, ref_codes: torch.Tensor) -> Primed:
        codes = ref_codes.to(self.vocoder.pre_conv.conv.weight.device)
        key = hashlib.sha256(codes.cpu().numpy().tobytes()).digest() + bytes(str(tuple(codes.shape)), "ascii")
        primed = self._primed.get(key)
        if primed is None:
            state = self.vocoder.new_state()
            audio = self.vocoder.decode_blocks(codes[None], state)[0]
            primed = Primed(state, _numpy(audio[-self.vocoder.cfg.samples_per_frame :]))
            self._primed.put(key, primed)
        return primed


def _numpy(audio: torch.Tensor) -> np.ndarray:
    return audio.float().cpu().numpy().astype(np.float32, copy=False)
