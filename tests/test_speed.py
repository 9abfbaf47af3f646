"""`speed`: pace changed, pitch kept, streamed == offline, and `speed` through every entry point.

The time stretch (kazeia/speed.py) is checked on real speech spoken by espeak-ng in two languages:
the output lasts input / speed, its median F0 (pYIN) stays within 3 % of the input's, its speech
follows the input's (voiced stretches land where input time / speed puts them), and any chunk
schedule gives the offline samples, bit for bit. The engine, the CLI, the OpenAI endpoint (through the official
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
    np.testing.assert_array_equal(np.concatenate(pieces), offline)  # each frame from the same input values


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


# -- `speed` through the engine, the CLI and the servers (tiny random checkpoint) --------------
TEXT = "Speed changes the pace of speech."
OPTIONS = dict(voice="serena", language="english", seed=11, max_new_tokens=14, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(engines):
    return engines["0.6B-custom"]


@pytest.fixture(scope="module")
def normal(engine):
    return engine.synthesize(TEXT, **OPTIONS)


def test_speed_one_leaves_the_audio_untouched(engine, normal):
    for one in (1, 1.0):
        again = engine.synthesize(TEXT, speed=one, **OPTIONS)
        assert again.audio.tobytes() == normal.audio.tobytes()
    chunks = list(engine.stream(TEXT, speed=1.0, chunk_frames=3, **OPTIONS))
    assert all(len(c.audio) == 1920 * c.frames for c in chunks)  # the vocoder's samples, none held back
    np.testing.assert_array_equal(np.concatenate([c.audio for c in chunks]), normal.audio)


@pytest.mark.parametrize("speed", [0.5, 2.0])
def test_engine_speed_is_the_stretch_of_the_same_speech(engine, normal, speed):
    fast = engine.synthesize(TEXT, speed=speed, **OPTIONS)
    np.testing.assert_array_equal(fast.codes, normal.codes)  # the same speech, only its pace changed
    assert len(fast.audio) == output_length(len(normal.audio), speed)
    np.testing.assert_array_equal(fast.audio, stretch(normal.audio, speed))
    assert fast.metrics.audio_s == pytest.approx(len(normal.audio) / SAMPLE_RATE / speed, rel=1e-3)


@pytest.mark.parametrize(("first", "rest"), [(1, 1), (1, 4), (3, 2)])
def test_engine_stream_at_speed_equals_offline(engine, first, rest):
    offline = engine.synthesize(TEXT, speed=1.5, **OPTIONS)
    stream = engine.stream(TEXT, speed=1.5, first_chunk_frames=first, chunk_frames=rest, **OPTIONS)
    chunks = list(stream)
    starts = np.cumsum([0] + [len(c.audio) for c in chunks[:-1]])
    assert [c.start_sample for c in chunks] == list(starts) and chunks[-1].is_last
    streamed = np.concatenate([c.audio for c in chunks])
    np.testing.assert_array_equal(streamed, offline.audio)  # the same bits: chunk-invariant vocoder and stretch
    assert stream.metrics.audio_s == len(streamed) / SAMPLE_RATE
    assert sum(1 for c in chunks if len(c.audio)) > 1  # audio came out while generating


def test_segments_of_a_long_text_are_in_output_time(engine):
    from kazeia.segment import LongTextOptions

    text = "First sentence here. A second one follows. And a third ends it."
    long_text = LongTextOptions(segment_tokens=6, floor_frames=4, frames_per_token=1)
    options = {**OPTIONS, "max_new_tokens": 15}  # ignore_eos: 14 frames a segment, what the text allows
    slow = engine.synthesize(text, speed=0.75, long_text=long_text, **options)
    plain = engine.synthesize(text, long_text=long_text, **options)
    assert len(slow.segments) == len(plain.segments) == 3
    assert slow.segments[-1].end_sample == len(slow.audio)  # the last end is exact
    for a, b in zip(slow.segments, plain.segments, strict=True):  # each end: its input time / speed
        assert abs(a.end_sample - b.end_sample / 0.75) <= 1
        assert a.text == b.text and a.finish_reason == b.finish_reason
    stream = engine.stream(text, speed=0.75, long_text=long_text, first_chunk_frames=1, chunk_frames=3, **options)
    for chunk in stream:  # a segment comes with the chunk that completes its audio, not before
        assert all(segment.end_sample <= chunk.start_sample + len(chunk.audio) for segment in chunk.segments)
    assert list(stream.segments) == list(slow.segments)


def test_engine_refuses_a_bad_speed(engine):
    from kazeia.errors import RequestError

    for bad in (0.1, 5, "2"):
        with pytest.raises(RequestError, match="speed must be a number from 0.25 to 4.0") as refused:
            engine.synthesize(TEXT, speed=bad, **OPTIONS)
        assert refused.value.field == "speed"


def test_openai_client_speed(engine):
    openai = pytest.importorskip("openai")
    from server_support import LiveServer, assert_pcm_equal

    from kazeia.audio import pcm16
    from kazeia.server import ServerConfig, create_app

    expected = pcm16(engine.synthesize(TEXT, speed=1.5, **OPTIONS).audio)
    extra = {k: OPTIONS[k] for k in ("language", "seed", "max_new_tokens", "ignore_eos")}
    with LiveServer(create_app(engine, ServerConfig("tiny"))) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        got = client.audio.speech.create(
            model="tiny", voice="serena", input=TEXT, speed=1.5, response_format="pcm", extra_body=extra
        )
        assert_pcm_equal(got.content, expected)
        with pytest.raises(openai.BadRequestError) as refused:
            client.audio.speech.create(model="tiny", voice="serena", input=TEXT, speed=4.5, extra_body=extra)
    error = refused.value.body
    assert refused.value.status_code == 400 and error["param"] == "speed"
    assert "0.25" in error["message"] and "4.0" in error["message"]


def test_websocket_session_speed(engine):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient
    from server_support import assert_pcm_equal, offline_pcm
    from server_support import ws_receive as receive

    from kazeia.server import ServerConfig, create_app

    session = {k: v for k, v in OPTIONS.items()} | {"speed": 0.75}
    with TestClient(create_app(engine, ServerConfig("tiny"))) as client:
        with client.websocket_connect("/v1/audio/speech/stream") as ws:
            ws.send_json({"type": "session.update", "session": session})
            assert receive(ws)["session"]["speed"] == 0.75
            ws.send_json({"type": "input_text", "text": TEXT})
            pcm, message = b"", receive(ws)
            while not (isinstance(message, dict) and message["type"] == "audio.done"):
                pcm += message if isinstance(message, bytes) else b""
                message = receive(ws)
    assert_pcm_equal(pcm, offline_pcm(engine, TEXT, **session))
    assert message["metrics"]["samples"] * 2 == len(pcm)


def test_cli_say_speed(tiny_checkpoints, engine, tmp_path, capsys):
    from kazeia.cli import main

    out = tmp_path / "fast.wav"
    args = ["say", TEXT, "--model", str(tiny_checkpoints["0.6B-custom"]), "--voice", "serena", "--language",
            "english", "--seed", "11", "--max-new-tokens", "14", "--ignore-eos"]  # fmt: skip
    assert main([*args, "--speed", "2", "-o", str(out)]) == 0
    audio, _ = sf.read(out, dtype="int16")
    expected = engine.synthesize(TEXT, speed=2, **OPTIONS).audio
    assert len(audio) == len(expected)
    np.testing.assert_allclose(audio / 32767, expected, atol=2 / 32767)
    streamed = tmp_path / "streamed.wav"
    assert main([*args, "--speed", "2", "--stream", "-o", str(streamed)]) == 0
    np.testing.assert_allclose(sf.read(streamed, dtype="int16")[0], audio, atol=1)
    assert main([*args, "--speed", "9", "-o", str(out)]) == 2
    assert "speed must be a number from 0.25 to 4.0" in capsys.readouterr().err


def test_wyoming_speed_option(engine):
    pytest.importorskip("wyoming")
    import asyncio

    from server_support import whole_text_pcm
    from test_wyoming import audio_of, read_until, serve
    from wyoming.tts import Synthesize, SynthesizeVoice

    sampling = dict(ignore_eos=True, max_new_tokens=14)

    async def speak(live) -> bytes:
        async with live.client() as client:
            await client.write_event(Synthesize(text=TEXT, voice=SynthesizeVoice(name="serena")).event())
            return audio_of(await read_until(client, "audio-stop"))

    with serve(engine, dict(seed=11, speed=2.0, language="english", sampling=sampling)) as live:
        pcm = asyncio.run(speak(live))
    assert pcm == whole_text_pcm(engine, TEXT, **OPTIONS, speed=2.0)  # Wyoming speaks text as it streams
    with pytest.raises(ValueError, match="speed must be a number from 0.25 to 4.0"):
        serve(engine, dict(speed=5.0, sampling=sampling))
