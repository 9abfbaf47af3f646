"""The scripts in examples/ run as a user runs them (a child process), and give the engine's own audio."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from clone_support import espeak

from kazeia import Engine, Voice
from kazeia.audio import pcm16

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run(script: str, *args: str) -> str:
    done = subprocess.run([sys.executable, str(EXAMPLES / script), *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


def read_wav(path: Path) -> np.ndarray:
    """The 16-bit samples of a mono 24 kHz WAV file."""
    audio, rate = sf.read(path, dtype="int16")
    assert rate == 24000 and audio.ndim == 1
    return audio.astype(np.int32)


def as_pcm(audio: np.ndarray) -> np.ndarray:
    """Float audio as every front end stores it (kazeia.audio.pcm16): WAV files included."""
    return np.frombuffer(pcm16(audio), "<i2").astype(np.int32)


def test_stream_writes_the_engine_audio_as_it_comes(tiny_checkpoints, engines, tmp_path):
    out = tmp_path / "hello.wav"
    printed = run("stream.py", "Hello there.", "--model", str(tiny_checkpoints["0.6B-custom"]), "-o", str(out),
                  "--seed", "3", "--max-new-tokens", "12")  # fmt: skip
    expected = engines["0.6B-custom"].synthesize("Hello there.", voice="ryan", seed=3, max_new_tokens=12)
    np.testing.assert_array_equal(read_wav(out), as_pcm(expected.audio))
    assert "first audio after" in printed


def test_openai_client_against_a_live_server(tiny_checkpoints, engines, tmp_path):
    pytest.importorskip("openai")
    from server_support import LiveServer

    from kazeia.server import ServerConfig, create_app

    engine = engines["0.6B-custom"]
    out = tmp_path / "speech.wav"
    with LiveServer(create_app(engine, ServerConfig("tiny"))) as server:
        printed = run("openai_client.py", "Hello there.", "--base-url", server.url + "/v1", "-o", str(out),
                      "--seed", "5", "--max-new-tokens", "9")  # fmt: skip
    expected = engine.synthesize("Hello there.", voice="ryan", language="english", seed=5, max_new_tokens=9)
    np.testing.assert_array_equal(read_wav(out), as_pcm(expected.audio))
    assert "seed 5" in printed


def test_clone_voice_once_then_reuse_it(tiny_checkpoints, tmp_path):
    reference = espeak(tmp_path / "me.wav", "This is how I speak, slowly and clearly.")
    voice_file, out = tmp_path / "me.voice", tmp_path / "cloned.wav"
    args = ["Bonjour.", "--model", str(tiny_checkpoints["0.6B-base"]), "--audio", str(reference),
            "--transcript", "This is how I speak, slowly and clearly.", "--voice-file", str(voice_file),
            "--seed", "2", "--max-new-tokens", "8"]  # fmt: skip
    run("clone_voice.py", *args, "-o", str(out))
    first = read_wav(out)
    created = voice_file.stat().st_mtime_ns
    run("clone_voice.py", *args, "-o", str(out))  # the saved voice is reused, not encoded again
    assert voice_file.stat().st_mtime_ns == created
    np.testing.assert_array_equal(read_wav(out), first)
    engine = Engine.load(tiny_checkpoints["0.6B-base"])
    expected = engine.synthesize("Bonjour.", voice=Voice.load(voice_file), seed=2, max_new_tokens=8)
    np.testing.assert_array_equal(first, as_pcm(expected.audio))
