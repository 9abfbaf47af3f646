"""Saved voices on a Base (voice-clone) checkpoint: upload, list, speak, delete, persist, refuse.

Reference audio is real speech from espeak-ng (22050 Hz, so uploads are resampled too). The audio a
saved voice speaks must be the engine's own stream with that voice, ICL priming of the vocoder
included, to the sample.
"""

import io
import json

import numpy as np
import pytest
import soundfile as sf

pytest.importorskip("fastapi")
from clone_support import ESPEAK_RATE, espeak
from fastapi.testclient import TestClient
from server_support import FRAME_BYTES

from kazeia import Voice
from kazeia.audio import pcm16
from kazeia.server import Limits, ServerConfig, create_app

REF_TEXT = "Hello, this is a reference voice for cloning."
TEXT = "A saved voice speaks from the server."
LIMITS = Limits(max_new_tokens=64, max_upload_bytes=300_000, max_reference_s=4.0)
SPEAK = dict(seed=13, max_new_tokens=12, ignore_eos=True, language="english")


@pytest.fixture(scope="module")
def ref_wav(tmp_path_factory) -> bytes:
    path = espeak(tmp_path_factory.mktemp("ref") / "ref.wav", REF_TEXT, "en", 59000)  # 2.7 s
    return path.read_bytes()


def wav_bytes(audio: np.ndarray, rate: int = ESPEAK_RATE) -> bytes:
    buffer = io.BytesIO()
    sf.write(buffer, audio, rate, format="WAV", subtype="PCM_16")
    return buffer.getvalue()


def base_app(engines, directory, name: str = "0.6B-base"):
    return create_app(engines[name], ServerConfig("tiny-base", limits=LIMITS, voices_dir=directory))


def upload(client, name, audio: bytes | None, **fields):
    files = {"audio": ("ref.wav", audio, "audio/wav")} if audio is not None else None
    data = {"name": name, **fields} if name is not None else fields
    return client.post("/v1/audio/voices", data=data, files=files)


def stream_pcm(engine, text: str, **options) -> bytes:
    with engine.stream(text, first_chunk_frames=1, chunk_frames=4, **options) as stream:
        return b"".join(pcm16(chunk.audio) for chunk in stream)


def speak(client, voice, **fields):
    body = {"input": TEXT, "voice": voice, "response_format": "pcm", **SPEAK, **fields}
    return client.post("/v1/audio/speech", json=body)


def error_of(r, status: int, param, *words) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"], (word, error["message"])
    return error


def test_create_list_speak_and_delete(engines, ref_wav, tmp_path):
    engine = engines["0.6B-base"]
    with TestClient(base_app(engines, tmp_path)) as client:
        assert client.get("/v1/audio/voices").json()["data"] == []
        r = upload(client, "Me", ref_wav, ref_text=REF_TEXT)
        assert r.status_code == 201, r.text
        created = r.json()
        assert created["id"] == "me" and created["mode"] == "icl" and created["ref_text"] == REF_TEXT
        assert created["kind"] == "saved" and created["ref_frames"] == 34
        r = upload(client, "narrator-2", ref_wav, x_vector_only="true")
        assert r.status_code == 201 and r.json()["mode"] == "x_vector" and r.json()["ref_text"] is None
        listed = client.get("/v1/audio/voices").json()
        assert [v["id"] for v in listed["data"]] == ["me", "narrator-2"]
        assert listed["model_type"] == "base" and listed["supports_voice_creation"] is True
        assert sorted(p.name for p in tmp_path.iterdir()) == ["me.voice", "narrator-2.voice"]

        saved = Voice.load(tmp_path / "me.voice")
        expected = stream_pcm(engine, TEXT, voice=saved, **SPEAK)
        r = speak(client, "ME")  # names are case-insensitive
        assert r.status_code == 200 and r.headers["x-kazeia-seed"] == "13"
        assert r.content == expected  # the vocoder continues after the reference frames (ICL priming)
        fresh = engine.create_voice(io.BytesIO(ref_wav), ref_text=REF_TEXT)
        assert stream_pcm(engine, TEXT, voice=fresh, **SPEAK) == expected  # the file holds the same voice

        with client.websocket_connect("/v1/audio/speech/stream") as ws:
            ws.send_json({"type": "session.update", "session": {"voice": "narrator-2", **SPEAK}})
            assert ws.receive_json()["session"]["voice"] == "narrator-2"
            ws.send_json({"type": "input_text", "text": TEXT})
            assert ws.receive_json()["type"] == "audio.start"
            pcm = b""
            while (message := ws.receive()).get("bytes") is not None:
                pcm += message["bytes"]
            assert json.loads(message["text"])["status"] == "completed"
        narrator = Voice.load(tmp_path / "narrator-2.voice")
        assert pcm == stream_pcm(engine, TEXT, voice=narrator, **SPEAK) and len(pcm) == 11 * FRAME_BYTES

        r = client.delete("/v1/audio/voices/me")
        assert r.status_code == 200 and r.json() == {"id": "me", "object": "voice", "deleted": True}
        assert not (tmp_path / "me.voice").exists()
        error_of(client.delete("/v1/audio/voices/me"), 404, None, "unknown voice 'me'", "1 saved voice")
        error_of(speak(client, "me"), 400, "voice", "unknown voice 'me'", "1 saved voice (GET /v1/audio/voices")
        error_of(speak(client, "narator-2"), 400, "voice", "close matches: narrator-2")
        assert [v["id"] for v in client.get("/v1/audio/voices").json()["data"]] == ["narrator-2"]


def test_saved_voices_survive_a_restart(engines, ref_wav, tmp_path):
    with TestClient(base_app(engines, tmp_path)) as client:
        assert upload(client, "keeper", ref_wav, ref_text=REF_TEXT).status_code == 201
        before = speak(client, "keeper").content
    with TestClient(base_app(engines, tmp_path)) as client:  # a new server on the same directory
        assert [v["id"] for v in client.get("/v1/audio/voices").json()["data"]] == ["keeper"]
        r = speak(client, "keeper")
        assert r.status_code == 200 and r.content == before and len(before) == 11 * FRAME_BYTES


def test_bad_uploads_and_names_are_refused(engines, ref_wav, tmp_path):
    audio, _ = sf.read(io.BytesIO(ref_wav), dtype="float32")
    with TestClient(base_app(engines, tmp_path)) as client:
        assert upload(client, "taken", ref_wav, x_vector_only="1").status_code == 201
        error = error_of(upload(client, "Taken", ref_wav, x_vector_only="1"), 409, "name", "already exists")
        assert error["code"] == "voice_exists"
        for bad in ("../evil", "a/b", "", "-x", "x" * 65, "dot.name", "über"):
            error_of(upload(client, bad, ref_wav, x_vector_only="1"), 400, "name", "not a valid voice name")
        error_of(upload(client, None, ref_wav, x_vector_only="1"), 400, "name", "name is required")
        error_of(upload(client, "nofile", None, ref_text=REF_TEXT), 400, "audio", "required")
        many = upload(client, "many", None, **{f"f{i}": "x" for i in range(9)})  # a form of 10 fields
        assert error_of(many, 400, None, "form cannot be read")["code"] == "invalid_multipart"
        error_of(upload(client, "junk", b"not audio at all", ref_text=REF_TEXT), 400, "audio", "reference audio")
        short = wav_bytes(audio[: ESPEAK_RATE // 2])
        error_of(upload(client, "short", short, ref_text=REF_TEXT), 400, "audio", "too short")
        silent = wav_bytes(np.zeros(ESPEAK_RATE * 2, np.float32))
        error_of(upload(client, "silent", silent, ref_text=REF_TEXT), 400, "audio", "silent")
        long = wav_bytes(np.tile(audio, 2))  # 5.4 s, over max_reference_s 4
        assert error_of(upload(client, "long", long, x_vector_only="1"), 400, "audio", "the limit is 4 s")["code"] == (
            "audio_too_long"
        )
        error_of(upload(client, "notext", ref_wav), 400, "ref_text", "transcript", "x_vector_only")
        error_of(upload(client, "both", ref_wav, ref_text=REF_TEXT, x_vector_only="yes"), 400, "ref_text", "not used")
        error_of(upload(client, "flag", ref_wav, x_vector_only="maybe"), 400, "x_vector_only", "'maybe'")
        error_of(upload(client, "extra", ref_wav, x_vector_only="1", speaker="me"), 400, "speaker", "unknown parameter")
        big = client.post("/v1/audio/voices", data={"name": "big"}, files={"audio": ("a.wav", b"\0" * 300_001)})
        assert error_of(big, 413, None, "300000")["code"] == "body_too_large"
        as_json = client.post("/v1/audio/voices", json={"name": "j", "audio": "UklGRg=="})
        assert error_of(as_json, 415, None, "multipart/form-data")["code"] == "unsupported_media_type"
        error_of(client.delete("/v1/audio/voices/taken.voice"), 400, "name", "not a valid voice name")
        assert client.delete("/v1/audio/voices/..%2Ftaken").status_code == 404  # no route: a name has no '/'
        for voice in ("../taken", "/etc/passwd", str(tmp_path / "taken.voice"), "taken.voice"):
            error_of(speak(client, voice), 400, "voice", "unknown voice", "1 saved voice")
        error_of(speak(client, None), 400, "voice", "voice is required", "POST /v1/audio/voices")
        error_of(speak(client, "taken", instructions="Softly."), 400, "instructions", "Base")
        assert sorted(p.name for p in tmp_path.iterdir()) == ["taken.voice"]  # nothing else was written
        assert speak(client, "taken").status_code == 200  # and the server keeps serving


def test_foreign_and_broken_voice_files(engines, ref_wav, tmp_path):
    other = engines["1.7B-base"].create_voice(io.BytesIO(ref_wav), x_vector_only=True)
    other.save(tmp_path / "other.voice")  # made with another checkpoint
    (tmp_path / "broken.voice").write_bytes(b"garbage")
    (tmp_path / "Not A Name.voice").write_bytes(b"ignored")
    with TestClient(base_app(engines, tmp_path)) as client:
        assert client.get("/v1/audio/voices").json()["data"] == []  # neither can speak here
        error_of(speak(client, "other"), 400, "voice", "made with a 1b7 Base checkpoint")
        assert error_of(speak(client, "broken"), 500, None, "cannot be read")["code"] == "voice_unreadable"


def test_other_checkpoints_have_no_saved_voices(engines, ref_wav, tmp_path):
    app = create_app(engines["0.6B-custom"], ServerConfig("tiny-custom", voices_dir=tmp_path / "unused"))
    with TestClient(app) as client:
        voices = client.get("/v1/audio/voices").json()
        assert voices["supports_voice_creation"] is False and voices["data"][0]["kind"] == "preset"
        r = upload(client, "me", ref_wav, ref_text=REF_TEXT)
        assert error_of(r, 400, None, "needs a Base checkpoint")["code"] == "unsupported_model"
        error_of(client.delete("/v1/audio/voices/serena"), 404, None, "no saved voices")
    assert not (tmp_path / "unused").exists()


def test_a_voice_transcript_is_bounded_in_tokens(engines, ref_wav, tmp_path):
    limits = Limits(max_new_tokens=64, max_upload_bytes=300_000, max_reference_s=4.0, max_ref_text_tokens=20)
    app = create_app(engines["0.6B-base"], ServerConfig("tiny-base", limits=limits, voices_dir=tmp_path))
    with TestClient(app) as client:
        long_text = "a transcript far longer than twenty tokens, " * 4
        error_of(upload(client, "chatty", ref_wav, ref_text=long_text), 400, "ref_text", "tokens long", "at most 20")
        assert not (tmp_path / "chatty.voice").exists()


def test_saved_voices_are_bounded_in_number(engines, ref_wav, tmp_path):
    limits = Limits(max_new_tokens=64, max_upload_bytes=300_000, max_reference_s=4.0, max_voices=2)
    app = create_app(engines["0.6B-base"], ServerConfig("tiny-base", limits=limits, voices_dir=tmp_path))
    with TestClient(app) as client:
        for name in ("one", "two"):
            assert upload(client, name, ref_wav, x_vector_only="1").status_code == 201
        error = error_of(upload(client, "three", ref_wav, x_vector_only="1"), 409, "name", "at most 2 voices")
        assert error["code"] == "too_many_voices" and not (tmp_path / "three.voice").exists()
        assert client.delete("/v1/audio/voices/one").status_code == 200
        assert upload(client, "three", ref_wav, x_vector_only="1").status_code == 201
