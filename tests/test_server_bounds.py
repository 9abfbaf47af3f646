"""Hostile and careless clients against a real `kazeia serve` (a tiny CustomVoice checkpoint, in a
child process ended by its PID): each trigger of a 5xx, an unbounded claim or a held slot gets a
4xx or a clean, documented end, and the server keeps serving. Waits are bounded; nothing depends on
how fast this machine is, only on what the server must do eventually (and within the bound).
"""

from __future__ import annotations

import json
import re
import time
from urllib.parse import quote

import pytest

pytest.importorskip("fastapi")
import httpx
from hostile_support import deaf_socket, http_post, peek, read_all, wait_for
from server_support import start_cli_server, stop_process
from websockets.sync.client import connect

KEY = "kazeia-clé-7f3a9"  # not ASCII: it must still match, as UTF-8 bytes
AUTH = {"Authorization": b"Bearer " + KEY.encode()}
STALL_S = 2.0
CONNECTIONS = 5
HELD = dict(voice="serena", seed=5, ignore_eos=True, non_streaming_mode=False)


@pytest.fixture(scope="module")
def server(tiny_checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("bounds")
    log = root / "serve.log"
    args = ["--api-key", KEY, "--allow-ignore-eos", "--max-batch", "2", "--queue-size", "8"]
    args += ["--max-connections", str(CONNECTIONS), "--limit", f"client_stall_s={STALL_S}"]
    args += ["--limit", "max_response_bytes=200000", "--text-timeout", "30", "--log-level", "info"]
    process, url = start_cli_server(tiny_checkpoints["0.6B-custom"], *args, log=log)
    yield process, url, log
    stop_process(process)


@pytest.fixture
def client(server):
    _, url, _ = server
    with httpx.Client(base_url=url, headers=AUTH, timeout=60) as client:
        yield client


def _post(client, body: str | dict) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    return client.post("/v1/audio/speech", content=content, headers={"Content-Type": "application/json"})


def _ws(url: str) -> str:
    return url.replace("http", "ws") + "/v1/audio/speech/stream?api%5Fkey=" + quote(KEY)


def _events(ws, until: tuple[str, ...], seconds: float = 60) -> tuple[list[dict], bytes]:
    """JSON events and audio bytes up to the first event of a type in `until`."""
    events, audio, deadline = [], b"", time.monotonic() + seconds
    while True:
        message = ws.recv(timeout=max(0.1, deadline - time.monotonic()))
        if isinstance(message, bytes):
            audio += message
            continue
        events.append(json.loads(message))
        if events[-1]["type"] in until:
            return events, audio


def _still_serving(client) -> None:
    r = _post(client, {"input": "Still here.", "voice": "serena", "max_new_tokens": 4, "response_format": "pcm"})
    assert r.status_code == 200 and len(r.content) > 0, r.text[:200]


def test_client_text_is_echoed_escaped_and_bounded(server, client):
    """A lone surrogate in a key or a value, a non-finite number, a megabyte name: each a 400 naming
    the field, with the client's text escaped and cut in the message (never a 500)."""
    _, url, _ = server
    cases = [
        ('{"input": "Hi.", "voice": "serena", "\\ud800": 1}', "\\ud800", "unknown_parameter"),
        ('{"input": "Hi.", "voice": -Infinity}', "voice", "invalid_number"),
        ('{"input": "Hi.", "voice": "serena", "speed": NaN}', "speed", "invalid_number"),
        ('{"input": "Hi.", "voice": "serena", "temperature": 1e400}', "temperature", "invalid_number"),
        (json.dumps({"input": "Hi.", "voice": "v" * 1_000_000}), "voice", "string_above_max_length"),
        (json.dumps({"input": "Hi.", "voice": "serena", "model": 5}), "model", "invalid_value"),
    ]
    for body, param, code in cases:
        r = _post(client, body)
        assert r.status_code == 400, (body[:60], r.status_code, r.text[:300])
        error = r.json()["error"]
        assert (error["param"], error["code"]) == (param, code), error
        assert len(r.content) < 2048, len(r.content)
    with connect(_ws(url), max_size=None) as ws:
        ws.send('{"type": "session.update", "session": {"voice": "serena", "\\ud800": 1}}')
        error = _events(ws, ("error",))[0][-1]["error"]
        assert error["code"] == "unknown_parameter" and "\\ud800" in error["message"], error
        ws.send(json.dumps({"type": "session.update", "session": {"voice": "serena", "max_new_tokens": 3}}))
        assert _events(ws, ("session.updated",))[0][-1]["type"] == "session.updated"
        ws.send('{"type": "input_text.append", "text": "Hi \\udfff"}')
        error = _events(ws, ("error",))[0][-1]["error"]
        assert error["param"] == "text" and error["code"] == "invalid_value" and "\\udfff" in error["message"]
        ws.send('{"type": "input_text", "text": "Fine.", "x": NaN}')
        assert _events(ws, ("error",))[0][-1]["error"]["code"] == "invalid_number"
    _still_serving(client)


def test_keys_and_models_in_odd_spellings(server, client):
    """The key is matched as UTF-8 bytes (a header is read as latin-1), `?api%5Fkey=` authenticates a
    WebSocket and is redacted from the access log like `?api_key=`; a message over max_body_bytes
    is a 413 event on a socket that stays open (the protocol's own limit lies beyond it)."""
    _, url, log = server
    assert client.get("/v1/models").status_code == 200
    assert httpx.get(url + "/v1/models", headers={"Authorization": b"Bearer kazeia-cl\xc3"}).status_code == 401
    with connect(_ws(url), max_size=None) as ws:
        ws.send(json.dumps({"type": "input_text", "text": "x" * (1 << 20)}))  # 1 MiB and its envelope
        error = _events(ws, ("error",))[0][-1]["error"]
        assert error["code"] == "body_too_large", error
        ws.send(json.dumps({"type": "session.update", "session": {"voice": "ryan"}}))
        assert _events(ws, ("session.updated",))[0][-1]["type"] == "session.updated"
    text = wait_for(lambda: (t := log.read_text("utf-8", "replace")) and "api%5Fkey=***" in t and t, 30, "log")
    assert KEY not in text and quote(KEY) not in text


def test_a_control_token_split_between_deltas_is_spoken_as_its_plain_text(server):
    """ "<|im_" then "end|> there": spoken, as the whole text is, as plain text (no internal error)."""
    _, url, _ = server
    session = {**HELD, "max_new_tokens": 12}
    with connect(_ws(url), max_size=None) as ws:
        ws.send(json.dumps({"type": "session.update", "session": session}))
        _events(ws, ("session.updated",))
        for delta in ("Hello <|im_", "end|> there"):
            ws.send(json.dumps({"type": "input_text.append", "text": delta}))
        ws.send(json.dumps({"type": "input_text.end"}))
        live_events, live = _events(ws, ("audio.done", "error"))
        ws.send(json.dumps({"type": "input_text", "text": "Hello <|im_end|> there"}))
        whole_events, whole = _events(ws, ("audio.done", "error"))
    assert live_events[-1]["type"] == whole_events[-1]["type"] == "audio.done", (live_events, whole_events)
    assert live_events[-1]["status"] == "completed" and len(live) == 11 * 1920 * 2
    assert live == whole


def test_a_live_text_is_held_to_the_token_limit(server):
    """4096 tokens of live text at most, as for `input` (2000 rare characters make ~6000)."""
    _, url, _ = server
    with connect(_ws(url), max_size=None) as ws:
        ws.send(json.dumps({"type": "session.update", "session": {**HELD, "max_new_tokens": 8}}))
        _events(ws, ("session.updated",))
        for _ in range(4):
            ws.send(json.dumps({"type": "input_text.append", "text": "\U00020000" * 500}))
        ws.send(json.dumps({"type": "input_text.end"}))
        event = _events(ws, ("audio.done", "error"))[0][-1]
    assert event["type"] == "error" and event["error"]["param"] == "text", event
    assert re.search(r"input is \d+ tokens long; at most 4096", event["error"]["message"]), event


def test_a_request_is_bounded_by_its_text_whatever_its_options(server, client):
    """1000 one-line paragraphs with ignore_eos and max_new_tokens 4096 would be ~90 hours of work:
    refused with a 400 naming max_new_tokens and the largest that fits."""
    r = _post(client, {"input": "a.\n\n" * 1000, "voice": "serena", "ignore_eos": True, "max_new_tokens": 4096,
                       "stream": False})  # fmt: skip
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert error["param"] == "max_new_tokens" and "at most" in error["message"], error
    _still_serving(client)


def test_flac_is_bounded_while_it_is_made(server, client):
    """FLAC is held whole until its end: over max_response_bytes (200 kB here) it is a 413 as soon as
    it is, long before its 799 frames are made."""
    metric = re.compile(r"^kazeia_audio_seconds_total (\S+)$", re.M)
    before = float(metric.search(client.get("/metrics").text).group(1))
    body = {"input": "Hello there.", **HELD, "max_new_tokens": 800, "response_format": "flac", "stream": False}
    r = _post(client, body)
    assert r.status_code == 413 and r.json()["error"]["code"] == "response_too_large", r.text[:300]
    spoken = float(metric.search(client.get("/metrics").text).group(1)) - before
    assert 0 < spoken < 799 * 0.08 / 2, spoken  # it stopped early: 200 kB of FLAC is far less than half
    _still_serving(client)


def test_clients_that_never_read_do_not_hold_the_server(server, client):
    """Clients on every --max-connections slot ask for minutes of audio and never read a byte: each is
    dropped once it has taken nothing for client_stall_s, its job cancelled, and the server answers
    the others again; none of them receives the end of a complete answer."""
    _, url, _ = server
    port = int(url.rsplit(":", 1)[1])
    body = {"input": "Hello there.", **HELD, "max_new_tokens": 3000, "speed": 0.25, "response_format": "pcm"}
    deaf = []
    for _ in range(CONNECTIONS - 1):  # uvicorn counts the connection asking: one more gets a 503
        deaf.append(deaf_socket(port))
        deaf[-1].sendall(http_post("/v1/audio/speech", body, {"Authorization": "Bearer " + KEY}))
        wait_for(lambda: peek(deaf[-1], 12) == b"HTTP/1.1 200", 60, "its answer starting")
    try:
        health = wait_for(lambda: (r := httpx.get(url + "/health", timeout=5)).status_code == 200 and r.json(), 240,
                          "the server answering again")  # fmt: skip
        wait_for(lambda: httpx.get(url + "/health", timeout=5).json()["active"] == 0, 60, "every job ended")
        assert health["status"] == "ok"
        for sock in deaf:
            answer = read_all(sock, 30)[0]
            assert answer.startswith(b"HTTP/1.1 200"), answer[:64]
            assert not answer.endswith(b"\r\n0\r\n\r\n"), "a cut answer ended as a complete one"
    finally:
        for sock in deaf:
            sock.close()
    _still_serving(client)


def test_streamed_encoders_hold_only_what_is_not_sent():
    """MP3 and Opus keep a frame or a page of encoded audio, not the whole utterance; FLAC, sent
    whole at its end, holds it all (and is bounded as the whole answer is: above)."""
    import numpy as np

    from kazeia.server.formats import available_formats

    chunk = np.random.default_rng(0).uniform(-0.5, 0.5, 7680).astype(np.float32)
    for name, audio_format in available_formats().items():
        encoder = audio_format.make()
        sent = len(encoder.header())
        for _ in range(100):  # 32 s of audio
            sent += len(encoder.encode(chunk))
        held = encoder.held
        tail = encoder.finish()
        if name == "flac":
            assert sent == 0 and 100_000 < held <= len(tail), (held, len(tail))
        else:
            assert held < 16_384 and sent > 0, (name, held)
