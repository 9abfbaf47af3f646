"""Audio constants, file output, and reading reference audio for voice cloning.

Scope: writing synthesized audio (float32 mono, 24 kHz) to WAV and other soundfile formats;
decoding reference audio (files, bytes, file objects or arrays), mixing it down to mono,
resampling it to 24 kHz with soxr and rejecting audio that cannot serve as a reference.
Non-goals: fetching URLs, decoding formats libsndfile cannot read.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np

from .errors import RequestError

SAMPLE_RATE = 24000  # Hz, output of every released 12 Hz checkpoint
MIN_REFERENCE_S = 1.0  # shortest reference audio accepted, seconds (3-10 s clone best)
MAX_REFERENCE_S = 60.0  # longest, by default: its codes join every ICL prompt (a server may take less)
# Checked from the header, before anything is decoded: a file's decoded size is what it declares.
MIN_RATE, MAX_RATE = 8000, 192000  # Hz
MAX_CHANNELS = 8
MAX_DECODED_BYTES = 64 << 20  # float32 samples of all channels before mixing down (60 s at 192 kHz mono: 44 MiB)
SILENCE_PEAK = 1e-3  # a reference whose peak stays below this (-60 dBFS) is treated as silence
# Float audio lies in [-1, 1]; a little over is clipping, far over (1e20 in a float WAV) is no audio,
# and would make the speaker encoder's embedding overflow to NaN.
MAX_PEAK = 16.0


def pcm16(audio: np.ndarray) -> bytes:
    """Float audio in [-1, 1] -> little-endian signed 16-bit PCM bytes: the one conversion every
    front end uses (files, standard output, HTTP, WebSocket, Wyoming), so one utterance is one byte
    stream wherever it goes."""
    return _int16(audio).tobytes()


def _int16(audio: np.ndarray) -> np.ndarray:
    scaled = np.clip(np.asarray(audio, dtype=np.float32), -1.0, 1.0) * 32767.0
    return np.round(scaled).astype("<i2")


class AudioWriter:
    """A soundfile writer of mono float audio that arrives in pieces (`open_audio_writer`): 16-bit
    formats take the samples `pcm16` makes (soundfile's own conversion rounds differently)."""

    def __init__(self, file, pcm: bool):
        self.file, self.pcm = file, pcm

    def write(self, audio: np.ndarray) -> None:
        self.file.write(_int16(audio) if self.pcm else np.asarray(audio, dtype=np.float32))

    def close(self) -> None:
        self.file.close()

    def __enter__(self) -> AudioWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_audio_writer(path: str | Path, sample_rate: int = SAMPLE_RATE) -> AudioWriter:
    """A writer for mono audio that arrives in pieces, each written to the file at once; the format
    follows the extension (WAV without one; 16-bit PCM for WAV and FLAC, the samples `pcm16`
    makes). The header (WAV sizes, FLAC length) is complete once the writer is closed, however the
    writing ended."""
    import soundfile as sf

    path = Path(path)
    pcm = path.suffix.lower() in (".wav", ".flac", "")
    try:
        file = sf.SoundFile(
            str(path), "w", samplerate=sample_rate, channels=1, subtype="PCM_16" if pcm else None,
            format=None if path.suffix else "WAV",
        )  # fmt: skip
    except (sf.LibsndfileError, TypeError, ValueError) as e:
        raise ValueError(f"cannot write audio to {path}: {e}") from None
    return AudioWriter(file, pcm)


def write_audio(path: str | Path, audio: np.ndarray, sample_rate: int = SAMPLE_RATE) -> None:
    """Write mono float audio in [-1, 1] in one piece (`open_audio_writer`)."""
    with open_audio_writer(path, sample_rate) as file:
        file.write(audio)


def load_reference_audio(source, sample_rate: int = SAMPLE_RATE, max_seconds: float = MAX_REFERENCE_S) -> np.ndarray:
    """Reference audio for voice cloning -> mono float32 at `sample_rate` Hz.

    `source`: a path (WAV, FLAC, OGG, MP3 or anything else libsndfile reads), the bytes of such a
    file, a binary file object, or `(array, sample_rate)` with an array of shape (samples,) or
    (samples, channels) (float in [-1, 1], or signed integer PCM scaled by its type's range). Channels are
    averaged; other rates are resampled with soxr (high quality), as the reference does with
    librosa. Before any sample is decoded or resampled, the header (or the array's shape) is held
    to MIN_RATE..MAX_RATE Hz, MAX_CHANNELS channels, `max_seconds` and MAX_DECODED_BYTES. Raises
    ValueError naming the value and the limit, and for unreadable, empty, non-finite, too short (<
    MIN_REFERENCE_S), silent (peak < SILENCE_PEAK) or absurdly loud (peak > MAX_PEAK) audio.
    """
    if isinstance(max_seconds, bool) or not isinstance(max_seconds, (int, float)) or not max_seconds > 0:
        raise ValueError(f"max_seconds must be a number > 0, got {max_seconds!r}")
    audio, rate, name = _decode(source, max_seconds)
    if audio.ndim == 2:
        audio = np.mean(audio, axis=-1) if audio.shape[1] else np.zeros(0, np.float32)
    audio = audio.astype(np.float32, copy=False)
    if audio.size == 0:
        raise ValueError(f"reference audio {name} is empty")
    if not np.isfinite(audio).all():
        raise ValueError(f"reference audio {name} contains NaN or infinite samples")
    if audio.size < MIN_REFERENCE_S * rate:
        raise ValueError(
            f"reference audio {name} is too short: {audio.size / rate:.2f} s, need at least {MIN_REFERENCE_S:g} s"
        )
    peak = float(np.max(np.abs(audio)))
    if peak < SILENCE_PEAK:
        raise ValueError(f"reference audio {name} is silent (peak below {SILENCE_PEAK:g})")
    if peak > MAX_PEAK:
        raise ValueError(
            f"reference audio {name} has samples of magnitude {peak:.3g}; audio samples lie in [-1, 1] "
            f"(at most {MAX_PEAK:g} is accepted)"
        )
    return resample(audio, rate, sample_rate)


def resample(audio: np.ndarray, orig_sr: int, target_sr: int) -> np.ndarray:
    """Mono float32 audio from `orig_sr` to `target_sr` Hz: soxr "HQ", cut or zero-padded to
    ceil(len * target / orig) samples (librosa.resample's defaults, which the reference uses)."""
    if orig_sr == target_sr:
        return audio
    import soxr

    length = int(np.ceil(audio.shape[-1] * (float(target_sr) / orig_sr)))
    out = soxr.resample(np.ascontiguousarray(audio), orig_sr, target_sr, quality="HQ")
    out = out[:length] if len(out) >= length else np.pad(out, (0, length - len(out)))
    return out.astype(np.float32, copy=False)


def _decode(source, max_seconds: float) -> tuple[np.ndarray, int, str]:
    """(audio (samples,) or (samples, channels), sample rate, a name for messages)."""
    if isinstance(source, tuple):
        return _from_array(source, max_seconds)
    if isinstance(source, (str, os.PathLike)):
        path = Path(source).expanduser()
        if not path.is_file():
            raise ValueError(f"reference audio: no such file: {path}")
        return _read(str(path), str(path), max_seconds)
    if isinstance(source, (bytes, bytearray, memoryview)):
        return _read(io.BytesIO(bytes(source)), "(bytes)", max_seconds)
    if hasattr(source, "read"):
        return _read(source, getattr(source, "name", "(file object)"), max_seconds)
    raise ValueError(
        "reference audio must be a path, bytes, a binary file object or an (array, sample_rate) tuple, "
        f"got {type(source).__name__}"
    )


class ReferenceLimitError(RequestError):
    """Reference audio over one of the limits read from its header; `too_long` for its duration or
    decoded size (a rate or channel count out of range otherwise)."""

    def __init__(self, message: str, too_long: bool):
        super().__init__("audio", message)
        self.too_long = too_long


def _check_shape(name: str, rate: int, channels: int, frames: int, max_seconds: float) -> None:
    """The limits every reference is held to before a sample of it is decoded or converted."""
    if not MIN_RATE <= rate <= MAX_RATE:
        raise ReferenceLimitError(
            f"reference audio {name} declares {rate} Hz; accepted: {MIN_RATE} to {MAX_RATE} Hz", False
        )
    if not 1 <= channels <= MAX_CHANNELS:
        raise ReferenceLimitError(
            f"reference audio {name} has {channels} channels; accepted: 1 to {MAX_CHANNELS}", False
        )
    if frames > max_seconds * rate:
        raise ReferenceLimitError(
            f"reference audio {name} is {frames / rate:.1f} s long; the limit is {max_seconds:g} s", True
        )
    if frames * channels * 4 > MAX_DECODED_BYTES:
        raise ReferenceLimitError(
            f"reference audio {name} would decode to {frames * channels * 4 / 2**20:.0f} MiB; "
            f"the limit is {MAX_DECODED_BYTES >> 20} MiB",
            True,
        )


def _read(file, name: str, max_seconds: float) -> tuple[np.ndarray, int, str]:
    import soundfile as sf

    try:
        with sf.SoundFile(file) as f:
            rate, channels, frames = int(f.samplerate), int(f.channels), int(f.frames)
            _check_shape(name, rate, channels, frames, max_seconds)
            # At most what the header allowed, even if the file holds more than it declared.
            audio = f.read(frames=frames, dtype="float32", always_2d=True)
    except (sf.LibsndfileError, RuntimeError, TypeError, OSError) as e:
        raise ValueError(f"cannot read reference audio {name}: {e}") from None
    return audio, rate, str(name)


def _from_array(source: tuple, max_seconds: float) -> tuple[np.ndarray, int, str]:
    if len(source) != 2:
        raise ValueError("reference audio as a tuple must be (array, sample_rate)")
    audio, rate = source
    if isinstance(rate, bool) or not isinstance(rate, (int, np.integer)) or rate <= 0:
        raise ValueError(f"reference audio sample rate must be a positive integer, got {rate!r}")
    audio = np.asarray(audio)
    if audio.ndim not in (1, 2):
        raise ValueError(f"reference audio array must have shape (samples,) or (samples, channels), got {audio.shape}")
    _check_shape("(array)", int(rate), 1 if audio.ndim == 1 else audio.shape[1], audio.shape[0], max_seconds)
    if np.issubdtype(audio.dtype, np.signedinteger):
        audio = audio.astype(np.float32) / float(2 ** (8 * audio.dtype.itemsize - 1))
    elif not np.issubdtype(audio.dtype, np.floating):
        raise ValueError(f"reference audio array must hold float or signed integer PCM samples, got {audio.dtype}")
    return audio, int(rate), "(array)"
