"""Server endpoints through Starlette's TestClient, on the tiny checkpoints.

The audio a request streams must be the engine's own synthesis for the same seed (to 1 LSB), in
every format; every bad request gets a 4xx with an OpenAI-style error naming the field, and the
server keeps serving.
"""

import base64
import io
import re

import numpy as np
import pytest
import soundfile as sf

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient
from server_support import (
    FRAME_BYTES,
    assert_pcm_equal,
    offline_pcm,
    sse_audio,
    sse_events,
    streamed_wav_pcm,
)

from kazeia.audio import pcm16
from kazeia.server import Limits, ServerConfig, create_app
from kazeia.server.formats import available_formats

TEXT = "The server speaks exactly like the engine."
LIMITS = Limits(max_input_chars=200, max_instructions_chars=100, max_new_tokens=64, max_body_bytes=4096)


@pytest.fixture(scope="module")
def client(engines):
    app = create_app(engines["0.6B-custom"], ServerConfig("tiny-custom", limits=LIMITS))
    with TestClient(app) as client:
        yield client


def speech(client, **body):
    return client.post("/v1/audio/speech", json={"model": "tiny-custom", "input": TEXT, "voice": "serena", **body})


def test_wav_is_streamed_with_unknown_length_and_equals_engine_audio(client, engines):
    options = dict(seed=5, max_new_tokens=9, language="french")
    r = speech(client, response_format="wav", **options)
    assert r.status_code == 200 and r.headers["content-type"] == "audio/wav"
    assert r.headers["x-kazeia-seed"] == "5"
    pcm = streamed_wav_pcm(r.content)
    expected = offline_pcm(engines["0.6B-custom"], TEXT, voice="serena", **options)
    assert_pcm_equal(pcm, expected)
    audio, rate = sf.read(io.BytesIO(r.content), dtype="int16")  # a reader that knows nothing of us
    assert rate == 24000 and len(audio) * 2 == len(pcm)


def test_pcm_length_is_exact_frames(client):
    r = speech(client, response_format="pcm", seed=1, max_new_tokens=7, ignore_eos=True)
    assert r.status_code == 200 and r.headers["content-type"] == "audio/pcm"
    assert len(r.content) == 6 * FRAME_BYTES  # max_new_tokens - 1 frames


def test_sse_events_carry_the_same_audio(client):
    options = dict(seed=9, max_new_tokens=8, ignore_eos=True)
    pcm = speech(client, response_format="pcm", **options).content
    r = speech(client, response_format="pcm", stream_format="sse", **options)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert len(events) >= 3  # the first frame comes alone, then the rest, then done
    assert sse_audio(events) == pcm
    usage = events[-1]["usage"]
    assert usage["output_tokens"] == 7 and usage["input_tokens"] > 0
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]


def test_sse_wav_puts_the_header_in_the_first_delta(client):
    r = speech(client, response_format="wav", stream_format="sse", seed=2, max_new_tokens=4, ignore_eos=True)
    assert len(streamed_wav_pcm(sse_audio(sse_events(r.text)))) == 3 * FRAME_BYTES


@pytest.mark.parametrize("name", sorted(set(available_formats()) - {"pcm", "wav"}))
def test_compressed_formats_decode_to_the_right_length(client, name):
    frames = 10
    r = speech(client, response_format=name, seed=3, max_new_tokens=frames + 1, ignore_eos=True)
    assert r.status_code == 200
    expected = frames * 1920
    with sf.SoundFile(io.BytesIO(r.content)) as f:
        assert f.samplerate == 24000 and f.channels == 1
        audio = f.read(dtype="float32")
    if name == "mp3":  # a stream cannot carry the gapless header: the encoder delay stays
        assert expected <= len(audio) <= expected + 2 * 1152
    else:
        assert len(audio) == expected
    assert np.abs(audio).max() > 0.01


def test_voice_as_object_and_default_format(client):
    r = speech(client, voice={"id": "ryan"}, seed=4, max_new_tokens=3)
    assert r.status_code == 200
    assert r.headers["content-type"] == ("audio/mpeg" if "mp3" in available_formats() else "audio/wav")


def _error(r, status, param, *words):
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error")
    for word in words:
        assert word in error["message"], (word, error["message"])
    return error


BAD = [
    ({"input": ""}, 400, "input", ["empty"]),
    ({"input": "x" * 201}, 400, "input", ["201", "200"]),
    ({"input": None}, 400, "input", ["required"]),
    ({"input": 5}, 400, "input", ["string"]),
    ({"voice": "alloy"}, 400, "voice", ["alloy", "serena", "ryan"]),
    ({"voice": 7}, 400, "voice", ["voice"]),
    ({"voice": None}, 400, "voice", ["required", "serena"]),
    ({"language": "klingon"}, 400, "language", ["klingon", "french"]),
    ({"response_format": "aac"}, 400, "response_format", ["aac", "wav", "pcm"]),
    ({"response_format": "ogg"}, 400, "response_format", ["ogg", "opus"]),
    ({"speed": 0.2}, 400, "speed", ["0.2", "0.25", "4.0"]),
    ({"speed": 9}, 400, "speed", ["0.25", "4.0"]),
    ({"speed": "fast"}, 400, "speed", ["number"]),
    ({"stream_format": "chunks"}, 400, "stream_format", ["chunks", "sse"]),
    ({"temperature": 5}, 400, "temperature", ["at most 2.0"]),
    ({"temperature": 0}, 400, "temperature", [">= 0.001"]),
    ({"top_p": 2}, 400, "top_p", ["(0, 1]"]),
    ({"top_k": 1.5}, 400, "top_k", ["integer"]),
    ({"max_new_tokens": 65}, 400, "max_new_tokens", ["at most 64"]),
    ({"max_new_tokens": 1}, 400, "max_new_tokens", [">= 2"]),
    ({"repetition_penalty": 3}, 400, "repetition_penalty", ["at most 2.0"]),
    ({"do_sample": "yes"}, 400, "do_sample", ["True or False"]),
    ({"seed": -1}, 400, "seed", ["2**63"]),
    ({"seed": "7"}, 400, "seed", ["integer"]),
    ({"instructions": "Speak softly."}, 400, "instructions", ["0.6B", "instructions"]),
    ({"instructions": "x" * 101}, 400, "instructions", ["101", "100"]),
    ({"emotion": "happy"}, 400, "emotion", ["unknown parameter", "voice"]),
    ({"model": "whisper-1"}, 404, "model", ["whisper-1", "tiny-custom", "tts-1"]),
]


@pytest.mark.parametrize(("fields", "status", "param", "words"), BAD, ids=[str(b[0])[:40] for b in BAD])
def test_bad_request_is_named(client, fields, status, param, words):
    _error(speech(client, **fields), status, param, *words)


def test_bad_bodies(client):
    json_headers = {"content-type": "application/json"}
    post = lambda content: client.post("/v1/audio/speech", content=content, headers=json_headers)  # noqa: E731
    _error(post(b"{not json"), 400, None, "not valid JSON")
    _error(post(b"[1, 2]"), 400, None, "JSON object", "list")
    _error(post(b"\xff\xfe"), 400, None, "not valid JSON")
    _error(post(b'{"input": "' + b"a" * 5000 + b'"}'), 413, None, "4096")
    _error(post(b"[" * 2000 + b"]" * 2000), 400, None, "nested too deeply")
    _error(post(b'{"input": "\\ud800 lone", "voice": "ryan"}'), 400, "input", "not valid Unicode")


def test_json_endpoints_take_only_json(client):
    """A cross-site page can POST text/plain without asking first (a CORS simple request): refused."""
    body = b'{"input": "Hello.", "voice": "ryan"}'
    for content_type in ("text/plain", "application/x-www-form-urlencoded", None):
        headers = {"content-type": content_type} if content_type else {}
        r = client.post("/v1/audio/speech", content=body, headers=headers)
        assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type", r.text
    ok = client.post("/v1/audio/speech", content=body, headers={"content-type": "application/json; charset=utf-8"})
    assert ok.status_code != 415


def test_unknown_routes_and_methods_get_openai_errors(client):
    assert _error(client.get("/v1/nothing"), 404, None, "/v1/nothing")["code"] == "not_found"
    assert _error(client.get("/v1/audio/speech"), 405, None, "GET")["code"] == "method_not_allowed"


def test_server_keeps_serving_after_bad_requests(client):
    for fields, *_ in BAD:
        speech(client, **fields)
    r = speech(client, response_format="pcm", seed=1, max_new_tokens=3, ignore_eos=True)
    assert r.status_code == 200 and len(r.content) == 2 * FRAME_BYTES


def test_models_voices_health(client, engines):
    engine = engines["0.6B-custom"]
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["tiny-custom"]
    assert models["data"][0]["model_type"] == "custom_voice" and models["data"][0]["object"] == "model"
    voices = client.get("/v1/audio/voices").json()
    assert [v["id"] for v in voices["data"]] == engine.voices
    assert voices["languages"] == engine.languages and voices["supports_instructions"] is False
    assert voices["formats"][:2] == ["pcm", "wav"]
    health = client.get("/health").json()
    paces = health.pop("paces")  # audio seconds a second of the utterances spoken so far, if enough
    assert all(int(n) >= 1 and pace > 0 for n, pace in paces.items()), paces
    assert health.pop("admits") in range(1, 5)  # at most --max-batch (4)
    assert health == {"status": "ok", "model": "tiny-custom", "active": 0, "queue_depth": 0, "behind": 0,
                      "admission": "measured"}  # fmt: skip


def _metric(text: str, name: str, absent: float | None = None) -> float:
    """A sample's value; `absent` for a labelled series not yet seen (a counter before its first count)."""
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    if match is None and absent is not None:
        return absent
    assert match, name
    return float(match.group(1))


def test_metrics_count_requests_errors_and_latency(client):
    before = client.get("/metrics").text
    speech(client, voice="nobody")
    speech(client, response_format="pcm", seed=1, max_new_tokens=4, ignore_eos=True)
    r = client.get("/metrics")
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    after = r.text
    for line in after.splitlines():  # every line is a comment or `name{labels} number`
        assert line.startswith("# ") or re.fullmatch(r"[a-z_]+(\{[^}]*\})? [-+0-9.eInf]+", line), line
    route = '{route="/v1/audio/speech"}'
    assert _metric(after, "kazeia_requests_total" + route) == _metric(before, "kazeia_requests_total" + route, 0.0) + 2
    errors = 'kazeia_request_errors_total{route="/v1/audio/speech",status="400"}'
    assert _metric(after, errors) == _metric(before, errors, 0.0) + 1
    assert _metric(after, "kazeia_ttfb_seconds_count") == _metric(before, "kazeia_ttfb_seconds_count") + 1
    assert _metric(after, "kazeia_rtf_count") == _metric(before, "kazeia_rtf_count") + 1
    assert _metric(after, 'kazeia_ttfb_seconds_bucket{le="+Inf"}') == _metric(after, "kazeia_ttfb_seconds_count")
    assert _metric(after, "kazeia_streams_active") == 0 and _metric(after, "kazeia_queue_depth") == 0


def test_voice_design_takes_no_voice_and_needs_instructions(engines):
    app = create_app(engines["1.7B-design"], ServerConfig("tiny-design", limits=LIMITS))
    with TestClient(app) as client:
        post = lambda **b: client.post("/v1/audio/speech", json={"input": TEXT, **b})  # noqa: E731
        r = post(instructions="A calm, low voice.", voice="", response_format="pcm", max_new_tokens=4, ignore_eos=True)
        assert r.status_code == 200 and len(r.content) == 3 * FRAME_BYTES
        _error(post(instructions="A calm voice.", voice="serena"), 400, "voice", "instructions")
        _error(post(), 400, "instructions", "VoiceDesign", "instructions")
        voices = client.get("/v1/audio/voices").json()
        assert voices["data"] == [] and voices["supports_instructions"] is True


def test_inputs_are_bounded_in_tokens_and_positions(engines):
    """Characters are not tokens: 300 rare characters stay under a character limit and make far
    more tokens; prompt + max_new_tokens are held to the server's positions too. Refused before any
    generation, naming the field."""
    limits = Limits(max_input_chars=4096, max_input_tokens=100, max_positions=150, max_new_tokens=64)
    with TestClient(create_app(engines["0.6B-custom"], ServerConfig("tiny-custom", limits=limits))) as client:
        rare = "\U00013000" * 300  # Egyptian hieroglyphs: several tokens each
        _error(speech(client, input=rare), 400, "input", "tokens long", "at most 100")
        words = " ".join(["word"] * 90)  # under 100 tokens, but its prompt + 64 frames exceed 150 positions
        _error(speech(client, input=words, max_new_tokens=64), 400, "max_new_tokens", "allowed 150 positions")
        r = speech(client, input="Short.", max_new_tokens=5, response_format="pcm")
        assert r.status_code == 200


LONG_INPUT = " ".join(
    f"Sentence number {n} of a long article, read aloud by the server in one voice." for n in range(12)
)  # ~200 tokens: more than one segment of 96


@pytest.fixture(scope="module")
def long_client(engines):
    limits = Limits(max_input_chars=2000, max_new_tokens=40, max_response_bytes=300_000)
    with TestClient(create_app(engines["0.6B-custom"], ServerConfig("tiny-custom", limits=limits))) as client:
        yield client


def test_long_input_streams_segments_and_a_finish_reason(long_client, engines):
    """A long input is one utterance spoken in segments: SSE sends each segment as its audio is
    out, then the done event with the finish reason and all segments; the audio is the engine's."""
    options = dict(seed=3, language="english")
    speech = engines["0.6B-custom"].synthesize(LONG_INPUT, voice="serena", max_new_tokens=40, **options)
    assert len(speech.segments) >= 2
    r = long_client.post(
        "/v1/audio/speech",
        json={"input": LONG_INPUT, "voice": "serena", "response_format": "pcm", "stream_format": "sse", **options},
    )
    assert r.status_code == 200
    events = sse_events(r.text)
    segments = [e for e in events if e["type"] == "speech.segment"]
    done = events[-1]
    assert done["type"] == "speech.audio.done" and done["finish_reason"] == speech.finish_reason
    expected = [
        {"index": s.index, "text": s.text, "start_s": s.start_s, "end_s": s.end_s, "start_sample": s.start_sample,
         "end_sample": s.end_sample, "finish_reason": s.finish_reason}
        for s in speech.segments
    ]  # fmt: skip
    assert [{k: v for k, v in e.items() if k != "type"} for e in segments] == expected
    assert done["segments"] == expected
    audio = sse_audio([e for e in events if e["type"] != "speech.segment"])
    assert_pcm_equal(audio, pcm16(speech.audio))
    assert segments[-1]["end_sample"] * 2 == len(audio)
    seen = 0  # each segment event comes after the audio that ends it
    for event in events:
        if event["type"] == "speech.audio.delta":
            seen += len(base64.b64decode(event["audio"]))
        elif event["type"] == "speech.segment":
            assert event["end_sample"] * 2 <= seen


def test_stream_false_answers_whole_with_a_finish_reason_header(long_client, engines):
    body = {"input": "A short one.", "voice": "serena", "response_format": "pcm", "seed": 2}
    streamed = long_client.post("/v1/audio/speech", json=body)
    whole = long_client.post("/v1/audio/speech", json={**body, "stream": False})
    assert whole.status_code == 200 and whole.content == streamed.content
    expected = engines["0.6B-custom"].synthesize("A short one.", voice="serena", seed=2, max_new_tokens=40)
    assert whole.headers["x-kazeia-finish-reason"] == expected.finish_reason
    assert "x-kazeia-finish-reason" not in streamed.headers
    _error(long_client.post("/v1/audio/speech", json={**body, "input": LONG_INPUT, "stream": False}), 413, "stream")
    _error(long_client.post("/v1/audio/speech", json={**body, "stream": "no"}), 400, "stream", "true or false")
    _error(
        long_client.post("/v1/audio/speech", json={**body, "stream": False, "stream_format": "sse"}),
        400,
        "stream",
        "stream_format",
    )
