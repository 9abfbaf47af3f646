"""Real speech for the voice-cloning tests, spoken by espeak-ng (Debian package `espeak-ng`).

espeak-ng writes 16-bit mono WAV at 22050 Hz, so every test that uses these files also runs the
resampling to 24 kHz. Lengths are fixed (cut or padded with silence) so the frame counts the tests
rely on do not depend on the espeak-ng version. Tests skip when espeak-ng is not installed.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

ESPEAK_RATE = 22050  # Hz, espeak-ng's output rate


def espeak(path: Path, text: str, voice: str = "en", samples: int | None = None, rate: int = 150) -> Path:
    """Speak `text` into the WAV file `path` (22050 Hz) at `rate` words per minute, cut or padded
    to `samples` samples."""
    exe = shutil.which("espeak-ng")
    if exe is None:
        pytest.skip("espeak-ng is not installed (Debian package espeak-ng; scripts/install.sh --test installs it)")
    subprocess.run([exe, "-v", voice, "-s", str(rate), "-w", str(path), text], check=True, capture_output=True)
    audio, rate = sf.read(path, dtype="float32")
    assert rate == ESPEAK_RATE and audio.ndim == 1
    if samples is not None:
        audio = np.pad(audio[:samples], (0, max(0, samples - len(audio))))
        sf.write(path, audio, rate, subtype="PCM_16")
    return path


def frames_at_24k(samples: int, rate: int = ESPEAK_RATE) -> int:
    """Code frames of `samples` samples at `rate` once resampled to 24 kHz."""
    return -(-int(np.ceil(samples * 24000 / rate)) // 1920)
