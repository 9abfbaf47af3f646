"""Random requests thrown at the app: whatever the content, only 2xx/4xx, never a dropped socket.

Bodies mix arbitrary JSON (any nesting, NaN, Infinity and 1e400, huge numbers, lone surrogates, in
keys as in values) with plausible values of the real fields, so that random requests get past the
first checks and into the deeper ones; raw bodies add invalid JSON, deep nesting and other content
types; WebSocket messages add unknown types and sizes around the message limit; Wyoming events add
unknown types, hostile data and payloads, and sizes around the event limit. After each example the
server must still speak a normal request on the same socket or connection: nothing it was sent may
have broken it, and no answer is a 5xx or an `internal_error`.
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
hostile_keys = st.text(max_size=6) | st.sampled_from(["\ud800", "\udfff x", "\x00", "", "k" * 300, "voice\u202e"])
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(hostile_keys, inner, max_size=3),
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
speech_bodies = (
    st.fixed_dictionaries({}, optional=field_value)
    | st.dictionaries(hostile_keys, json_values)
    | st.builds(lambda known, odd: {**known, **odd}, st.fixed_dictionaries({}, optional=field_value),
                st.dictionaries(hostile_keys, json_values, max_size=2))
)  # fmt: skip
HUGE = "1e400"  # reads as infinity in Python
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
    | st.builds(dict, type=st.sampled_from(MESSAGE_TYPES) | st.text(max_size=12), text=json_values)
    | st.builds(dict, type=st.just("input_text.append"), text=st.sampled_from(["Hello <|im_", "end|> there", ""]))
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
@given(body=speech_bodies, huge=st.booleans())
def test_random_speech_bodies_get_2xx_or_4xx(client, body, huge):
    content = json.dumps(body)  # NaN and Infinity as Python writes them
    if huge:
        content = content.replace("null", HUGE, 1)
    with client.stream("POST", "/v1/audio/speech", content=content, headers={"Content-Type": "application/json"}) as r:
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


LIMIT = 256 * 1024  # the fixture's max_body_bytes
sized = st.integers(-64, 64).map(lambda d: '{"type": "input_text", "text": "' + "x" * (LIMIT - 34 + d) + '"}')


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=st.lists(ws_messages | sized | st.binary(max_size=16) | st.text(max_size=16), min_size=1, max_size=6))
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


@pytest.fixture(scope="module")
def wyoming(tiny_checkpoints, tmp_path_factory):
    """`kazeia wyoming` in a process of its own, with the limits of the app above (events of 64 kB)."""
    pytest.importorskip("wyoming")
    from hostile_support import start_wyoming
    from server_support import stop_process

    log = tmp_path_factory.mktemp("wyoming-fuzz") / "wyoming.log"
    args = ["--max-input-chars", "100", "--max-new-tokens", "6", "--limit", "max_body_bytes=65536", "--seed", "1"]
    args += ["--text-timeout", "0.5", "--text-deadline", "3", "--log-level", "warning"]
    process, port = start_wyoming(tiny_checkpoints["0.6B-custom"], *args, log=log)
    yield port
    stop_process(process)


WYOMING_TYPES = ["describe", "synthesize", "synthesize-start", "synthesize-chunk", "synthesize-stop", "ping"]
voices = json_values | st.builds(dict, name=st.text(max_size=5))
event_data = st.fixed_dictionaries({}, optional={"text": st.text(max_size=30) | json_values, "voice": voices}) | (
    st.dictionaries(hostile_keys, json_values, max_size=4)
)
wyoming_events = st.tuples(
    st.sampled_from(WYOMING_TYPES) | st.text(max_size=12),
    event_data,
    st.sampled_from([0, 2, 70_000]).map(lambda n: b"p" * n),  # 70 kB: over the 64 kB event limit
    st.booleans(),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(events=st.lists(wyoming_events, min_size=1, max_size=5))
def test_random_wyoming_events_never_drop_the_connection(wyoming, events):
    """Any well-formed event (its header a JSON line whose lengths are right), whatever its type,
    data and size, is answered without an internal error, and the connection goes on: a ping after
    them gets its pong."""
    from hostile_support import WyomingClient, wyoming_event

    with WyomingClient(wyoming) as client:
        for kind, data, payload, huge in events:
            raw = json.dumps(data).replace("null", HUGE, 1) if huge else json.dumps(data)
            client.sock.sendall(wyoming_event(kind, raw_data=raw.encode("utf-8", "surrogatepass"), payload=payload))
        client.send("synthesize-stop")  # whatever is open ends (an error if nothing is)
        client.send("ping", {"text": "after the noise"})
        while True:
            event = client.read(120)
            assert event is not None, "the server closed the connection"
            kind, data, _ = event
            assert kind != "error" or data.get("code") != "internal_error", data
            if kind == "pong" and data.get("text") == "after the noise":
                break
