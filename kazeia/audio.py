"""Audio constants and file output.

Scope: writing synthesized audio (float32 mono, 24 kHz) to WAV and other soundfile formats.
Non-goals: resampling and reading reference audio (voice cloning) live elsewhere.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

SAMPLE_RATE = 24000  # Hz, output of every released 12 Hz checkpoint
SAMPLES_PER_FRAME = 1920  # 80 ms of audio per code frame


def pcm16(audio: np.ndarray) -> bytes:
    """Float audio in [-1, 1] -> little-endian signed 16-bit PCM bytes."""
    scaled = np.clip(np.asarray(audio, dtype=np.float32), -1.0, 1.0) * 32767.0
    return np.round(scaled).astype("<i2").tobytes()


def open_wav_writer(path: str | Path, sample_rate: int = SAMPLE_RATE):
    """A soundfile writer for audio that arrives in pieces; the header is complete once it is closed."""
    import soundfile as sf

    try:
        return sf.SoundFile(str(path), "w", samplerate=sample_rate, channels=1, subtype="PCM_16", format="WAV")
    except (sf.LibsndfileError, TypeError, ValueError) as e:
        raise ValueError(f"cannot write audio to {path}: {e}") from None


def write_audio(path: str | Path, audio: np.ndarray, sample_rate: int = SAMPLE_RATE) -> None:
    """Write mono float audio in [-1, 1]; the format follows the extension (16-bit PCM for .wav)."""
    import soundfile as sf

    path = Path(path)
    subtype = "PCM_16" if path.suffix.lower() in (".wav", ".flac", "") else None
    try:
        sf.write(
            str(path),
            np.asarray(audio, dtype=np.float32),
            sample_rate,
            subtype=subtype,
            format=None if path.suffix else "WAV",
        )
    except (sf.LibsndfileError, TypeError, ValueError) as e:
        raise ValueError(f"cannot write audio to {path}: {e}") from None
