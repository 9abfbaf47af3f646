"""Random requests thrown at the app: whatever the content, only 2xx/4xx, never a dropped socket.

Bodies mix arbitrary JSON (any nesting, NaN, huge numbers, lone surrogates) with plausible values
of the real fields, so that random requests get past the first checks and into the deeper ones;
raw bodies add invalid JSON, deep nesting and other content types. After each example the server
must still speak a normal request: nothing it was sent may have broken it.
"""

import json

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_support import ws_receive

from kazeia.server import Limits, ServerConfig, create_app
from kazeia.server.params import SESSION_FIELDS, SPEECH_FIELDS
from kazeia.server.websocket import MESSAGE_TYPES, ROUTE

NORMAL = {"model": "tiny-custom", "input": "Still here.", "voice": "serena", "max_new_tokens": 3}
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()  # NaN and infinities included: Python's JSON reader accepts them
    | st.text(max_size=20)
    | st.sampled_from(["\ud800", "\x00", "", " ", "\u202e", "a" * 300])
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
numbers = st.floats(-2, 5) | st.sampled_from([0, 1e-300, -0.0, 1e300, 2**64, True])
PLAUSIBLE = {
    "model": st.sampled_from(["tiny-custom", "tts-1", "gpt-4o-mini-tts", "other"]),
    "input": st.text(max_size=40),
    "voice": st.sampled_from(["serena", "ryan", "nobody", "SERENA"]) | st.builds(dict, name=st.text(max_size=8)),
    "instructions": st.text(max_size=30),
    "response_format": st.sampled_from(["wav", "pcm", "mp3", "flac", "opus", "aac", "ogg"]),
    "stream_format": st.sampled_from(["sse", "audio", "chunks"]),
    "speed": numbers,
    "language": st.sampled_from(["english", "auto", "Chinese", "klingon"]),
    "seed": st.integers(-(2**70), 2**70),
    "max_new_tokens": st.integers(-3, 6),
    "top_k": st.integers(-3, 100),
    "subtalker_top_k": st.integers(-3, 100),
}
field_value = {name: json_values | PLAUSIBLE.get(name, numbers) for name in SPEECH_FIELDS}
speech_bodies = st.fixed_dictionaries({}, optional=field_value) | st.dictionaries(st.text(max_size=10), json_values)
raw_bodies = st.tuples(
    st.sampled_from(
        ["application/json", "text/plain", "application/x-www-form-urlencoded", "", "application/json; charset=latin-1"]
    ),
    st.binary(max_size=64)
    | st.integers(1, 200_000).map(lambda n: b"[" * n)
    | st.integers(1, 50_000).map(lambda n: b'{"a":' * n),
)  # fmt: skip
session_options = st.fixed_dictionaries({}, optional={name: field_value[name] for name in SESSION_FIELDS})
ws_messages = (
    st.builds(dict, type=st.sampled_from(MESSAGE_TYPES), text=st.text(max_size=30))
    | st.builds(dict, type=st.just("session.update"), session=session_options | json_values)
    | st.dictionaries(
        st.sampled_from(["type", "text", "session", "extra"]), json_values | st.sampled_from(MESSAGE_TYPES)
    )
    | json_values
)


@pytest.fixture(scope="module")
def client(engines):
    limits = Limits(max_input_chars=100, max_new_tokens=6, max_body_bytes=256 * 1024)
    config = ServerConfig("tiny-custom", limits=limits, text_timeout=0.5, text_deadline=3.0)
    with TestClient(create_app(engines["0.6B-custom"], config)) as client:
        yield client


def _answered_sanely(response) -> None:
    assert response.status_code < 500, (response.status_code, response.text[:300])
    if response.status_code >= 400:
        error = response.json()["error"]  # an OpenAI-style error naming what is wrong
        assert error["message"] and "Traceback" not in error["message"] and "0x7f" not in error["message"]


def _still_serving(client) -> None:
    r = client.post("/v1/audio/speech", json={**NORMAL, "response_format": "pcm"})
    assert r.status_code == 200 and len(r.content) > 0


@FUZZ
@given(body=speech_bodies)
def test_random_speech_bodies_get_2xx_or_4xx(client, body):
    with client.stream(
        "POST", "/v1/audio/speech", content=json.dumps(body), headers={"Content-Type": "application/json"}
    ) as r:
        data = r.read()
    _answered_sanely(r)
    if r.status_code == 200:
        assert len(data) > 0
    _still_serving(client)


@FUZZ
@given(raw=raw_bodies)
def test_random_raw_bodies_get_4xx(client, raw):
    kind, data = raw
    headers = {"Content-Type": kind} if kind else {}
    r = client.post("/v1/audio/speech", content=data, headers=headers)
    _answered_sanely(r)
    assert r.status_code >= 400  # none of these is a valid request
    _still_serving(client)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=st.lists(ws_messages | st.binary(max_size=16) | st.text(max_size=16), min_size=1, max_size=6))
def test_random_websocket_messages_never_close_the_socket(client, messages):
    with client.websocket_connect(ROUTE) as ws:
        for message in messages:
            if isinstance(message, bytes):
                ws.send_bytes(message)
            elif isinstance(message, str):
                ws.send_text(message)  # maybe not JSON at all
            else:
                ws.send_text(json.dumps(message))
        # Whatever came before: end any live text, cancel what is spoken, then a normal request.
        ws.send_json({"type": "input_text.end"})
        ws.send_json({"type": "cancel"})
        ws.send_json({"type": "session.update", "session": {"voice": "serena", "max_new_tokens": 3}})
        for _ in range(10_000):
            item = ws_receive(ws)  # a closed socket raises here
            if isinstance(item, dict):
                assert item["type"] in ("session.updated", "error", "audio.start", "audio.done"), item
                if item["type"] == "error":
                    assert item["error"]["message"] and item["error"].get("code") != "internal_error", item
                if item["type"] == "session.updated" and item["session"].get("max_new_tokens") == 3:
                    break
        else:
            raise AssertionError("the final session.update was never answered")
        ws.send_json({"type": "input_text", "text": "After the noise."})
        while True:  # earlier utterances end cancelled; this one is spoken in full
            item = ws_receive(ws)
            if isinstance(item, bytes) or item["type"] in ("audio.start", "session.updated", "error"):
                continue
            assert item["type"] == "audio.done", item
            if item["status"] == "completed":
                break
            assert item["status"] == "cancelled", item
    _still_serving(client)


def test_a_huge_integer_literal_is_a_400_and_keeps_the_socket(client):
    """Python refuses integers of more than 4300 digits with a ValueError of its own."""
    huge = "1" * 5000
    r = client.post(
        "/v1/audio/speech", content=f'{{"input": "x", "seed": {huge}}}', headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    with client.websocket_connect(ROUTE) as ws:
        ws.send_text(f'{{"type": "cancel", "x": {huge}}}')
        error = ws_receive(ws)
        assert error["type"] == "error" and error["error"]["code"] == "invalid_json"
        ws.send_json({"type": "session.update", "session": {"voice": "serena"}})
        assert ws_receive(ws)["type"] == "session.updated"
