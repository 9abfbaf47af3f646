"""`WS /v1/audio/speech/stream` through Starlette's TestClient: session, texts, PCM, events, errors, cancel."""

import json

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient
from server_support import FRAME_BYTES, HeldJobs, assert_pcm_equal, offline_pcm
from server_support import ws_receive as receive

from kazeia.server import Limits, ServerConfig, create_app

ROUTE = "/v1/audio/speech/stream"
TEXT = "Streaming over a socket."
LIMITS = Limits(max_input_chars=100, max_new_tokens=80, max_pending_utterances=2)


@pytest.fixture(scope="module")
def app(engines):
    return create_app(engines["0.6B-custom"], ServerConfig("tiny-custom", limits=LIMITS))


@pytest.fixture(scope="module")
def client(app):
    with TestClient(app) as client:
        yield client


def utterance(ws) -> tuple[dict, bytes, dict]:
    """audio.start, the PCM, audio.done of the next utterance."""
    start = receive(ws)
    assert start["type"] == "audio.start", start
    pcm = b""
    while isinstance(item := receive(ws), bytes):
        pcm += item
    assert item["type"] == "audio.done", item
    return start, pcm, item


def update(ws, **session) -> dict:
    ws.send_json({"type": "session.update", "session": session})
    return receive(ws)


def test_session_then_text_streams_engine_audio(client, engines):
    options = dict(seed=21, max_new_tokens=12, language="english")
    with client.websocket_connect(ROUTE) as ws:
        updated = update(ws, voice="Serena", **options)
        assert updated == {"type": "session.updated", "session": {"voice": "Serena", **options}}
        ws.send_json({"type": "input_text", "text": TEXT})
        start, pcm, done = utterance(ws)
    assert start == {
        "type": "audio.start", "utterance": 1, "sample_rate": 24000, "channels": 1, "format": "pcm_s16le", "seed": 21,
    }  # fmt: skip
    assert_pcm_equal(pcm, offline_pcm(engines["0.6B-custom"], TEXT, voice="serena", **options))
    m = done["metrics"]
    assert done["status"] == "completed" and done["utterance"] == 1
    assert m["samples"] * 2 == len(pcm) and m["frames"] * FRAME_BYTES == len(pcm) and m["seed"] == 21
    assert 0 < m["ttfb_s"] <= m["wall_s"] + m["queue_s"] and m["rtf"] > 0


def test_texts_are_spoken_in_order(client):
    with client.websocket_connect(ROUTE) as ws:
        update(ws, voice="ryan", ignore_eos=True, max_new_tokens=3)
        ws.send_json({"type": "input_text", "text": "One."})
        ws.send_json({"type": "input_text", "text": "Two."})
        first, second = utterance(ws), utterance(ws)
    assert [first[0]["utterance"], second[0]["utterance"]] == [1, 2]
    assert [first[2]["utterance"], second[2]["utterance"]] == [1, 2]
    assert len(first[1]) == len(second[1]) == 2 * FRAME_BYTES


def test_errors_leave_the_socket_and_session_usable(client):
    def error(ws, message, param, *words):
        ws.send_text(message) if isinstance(message, str) else ws.send_bytes(message)
        event = receive(ws)
        assert event["type"] == "error" and event["utterance"] is None, event
        assert event["error"]["param"] == param and event["error"]["type"] == "invalid_request_error"
        for word in words:
            assert word in event["error"]["message"], (word, event)

    with client.websocket_connect(ROUTE) as ws:
        error(ws, json.dumps({"type": "input_text", "text": TEXT}), "voice", "voice is required")
        update(ws, voice="vivian", max_new_tokens=3, ignore_eos=True)
        error(ws, "{nope", None, "not valid JSON")
        error(ws, b"\x00\x01", None, "binary")
        error(ws, json.dumps({"type": "speak"}), "type", "'speak'", "input_text")
        error(ws, json.dumps({"type": "input_text.end"}), "type", "without an open utterance")
        error(ws, json.dumps({"type": "input_text.append", "text": 5}), "text", "string")
        error(ws, json.dumps({"type": "input_text.append", "text": "x" * 101}), "text", "101", "100")
        error(ws, json.dumps({"type": "input_text.end", "text": "x"}), "text", "unknown parameter")
        error(ws, json.dumps({"type": "input_text", "text": TEXT, "voice": "ryan"}), "voice", "unknown parameter")
        error(ws, json.dumps({"type": "input_text", "text": "x" * 101}), "text", "101", "100")
        error(ws, json.dumps({"type": "input_text", "text": "  "}), "input", "empty")
        error(ws, json.dumps({"type": "session.update", "session": {"voice": "alloy"}}), "voice", "alloy", "serena")
        error(ws, json.dumps({"type": "session.update", "session": {"speed": 9}}), "speed", "0.25", "4.0")
        error(ws, json.dumps({"type": "session.update", "session": {"max_new_tokens": 81}}), "max_new_tokens", "80")
        error(ws, json.dumps({"type": "session.update", "session": "fast"}), "session", "JSON object")
        ws.send_json({"type": "input_text", "text": TEXT})  # the last good session still holds
        _, pcm, done = utterance(ws)
    assert done["status"] == "completed" and len(pcm) == 2 * FRAME_BYTES


def test_cancel_stops_the_utterance_and_drops_the_queued_ones(client, app):
    """The first utterance is held after its first audio (`HeldJobs`): it is still being spoken
    when the next texts come and when `cancel` does, however fast the machine."""
    with HeldJobs() as gate, client.websocket_connect(ROUTE) as ws:
        update(ws, voice="aiden", ignore_eos=True, max_new_tokens=80)
        ws.send_json({"type": "input_text", "text": "A long one."})
        assert receive(ws)["type"] == "audio.start"
        gate.wait_held()
        for text in ("Queued.", "Also queued.", "One too many."):
            ws.send_json({"type": "input_text", "text": text})
        while isinstance(event := receive(ws), bytes):
            pass
        assert event["type"] == "error" and event["error"]["code"] == "too_many_pending"
        ws.send_json({"type": "cancel"})
        events = []
        while sum(isinstance(e, dict) and e["type"] == "audio.done" for e in events) < 3:
            events.append(receive(ws))
    done = [e for e in events if isinstance(e, dict)]
    assert [(d["utterance"], d["status"]) for d in done] == [(2, "cancelled"), (3, "cancelled"), (1, "cancelled")]
    assert done[-1]["metrics"]["samples"] < 79 * 1920
    record = app.state.kazeia.worker.records[-1]
    assert record.status == "cancelled" and record.frames - record.frames_at_cancel <= 1


def test_a_long_text_reports_its_segments(engines):
    """A text spoken in several segments: `audio.segment` after the audio that ends each one,
    `audio.done` with the finish reason and all segments, as the engine reports them."""
    text = " ".join(f"Sentence {n} is part of a long text spoken over the socket." for n in range(14))
    options = dict(seed=6, max_new_tokens=30)
    speech = engines["0.6B-custom"].synthesize(text, voice="ryan", **options)
    assert len(speech.segments) >= 2
    limits = Limits(max_input_chars=2000, max_new_tokens=30)
    with TestClient(create_app(engines["0.6B-custom"], ServerConfig("tiny-custom", limits=limits))) as client:
        with client.websocket_connect(ROUTE) as ws:
            update(ws, voice="ryan", **options)
            ws.send_json({"type": "input_text", "text": text})
            assert receive(ws)["type"] == "audio.start"
            pcm, segments = b"", []
            while isinstance(item := receive(ws), bytes) or item["type"] == "audio.segment":
                if isinstance(item, bytes):
                    pcm += item
                else:
                    assert item["utterance"] == 1 and item["end_sample"] * 2 <= len(pcm)
                    segments.append(item)
    assert item["type"] == "audio.done" and item["finish_reason"] == speech.finish_reason
    assert [(s["text"], s["start_sample"], s["end_sample"], s["finish_reason"]) for s in segments] == [
        (s.text, s.start_sample, s.end_sample, s.finish_reason) for s in speech.segments
    ]
    assert item["segments"] == [{k: v for k, v in s.items() if k not in ("type", "utterance")} for s in segments]
    assert_pcm_equal(pcm, offline_pcm(engines["0.6B-custom"], text, voice="ryan", **options))
