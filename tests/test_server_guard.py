"""Who may use a server: Host names (DNS rebinding), page origins (CORS, WebSocket), the API key.

Browsers are modelled by the headers they send: a page's `fetch` or WebSocket carries `Origin`,
a rebound name carries its own `Host`. The real `kazeia serve` is checked for its defaults (a
loopback server refuses foreign Host names; the key may come from KAZEIA_API_KEY; a server on
every address without a key warns).
"""

import logging
import os

import httpx
import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient
from server_support import start_cli_server, stop_process
from starlette.websockets import WebSocketDisconnect

from kazeia.server import Limits, ServerConfig, create_app
from kazeia.server.guard import RedactKeys, loopback_hosts

KEY = "kz-test-key-0123"
SPEECH = {"model": "tiny-custom", "input": "Guarded.", "voice": "serena", "max_new_tokens": 3}
ROUTE = "/v1/audio/speech/stream"
# A socket's idle limit where a test checks it: long beside the moment between connecting and sending
# the first message (the clock runs from the connection), short enough to wait out.
IDLE_S = 1.0


def _client(engines, **config) -> TestClient:
    limits = Limits(max_new_tokens=8)
    return TestClient(create_app(engines["0.6B-custom"], ServerConfig("tiny-custom", limits=limits, **config)))


def test_a_loopback_server_answers_to_loopback_names_only(engines):
    assert loopback_hosts("127.0.0.1") == loopback_hosts("::1") == loopback_hosts("localhost")
    assert loopback_hosts("0.0.0.0") is None and loopback_hosts("192.168.1.20") is None
    assert "127.0.0.2" in loopback_hosts("127.0.0.2") and "::ffff:127.0.0.1" in loopback_hosts("::ffff:127.0.0.1")
    assert loopback_hosts("::ffff:10.0.0.1") is None
    with _client(engines, allowed_hosts=loopback_hosts("127.0.0.1")) as client:
        for host in ("127.0.0.1:8000", "localhost", "LOCALHOST:1234", "[::1]:8000", "127.0.0.1"):
            assert client.get("/v1/models", headers={"Host": host}).status_code == 200, host
        for host in ("evil.example", "evil.example:8000", "127.0.0.1.evil.example", "", "[::2]:80"):
            r = client.get("/v1/audio/voices", headers={"Host": host})
            assert r.status_code == 421, host
            assert r.json()["error"]["code"] == "host_not_allowed" and "127.0.0.1" in r.json()["error"]["message"]
        r = client.post("/v1/audio/speech", json=SPEECH, headers={"Host": "rebound.example:8000"})
        assert r.status_code == 421
        with pytest.raises(WebSocketDisconnect) as refused:
            with client.websocket_connect(ROUTE, headers={"Host": "rebound.example"}):
                pass
        assert refused.value.code == 1008


def test_pages_of_other_origins_are_refused_and_get_no_cors_headers(engines):
    with _client(engines) as client:  # TestClient's Host is "testserver"
        evil = {"Origin": "https://evil.example"}
        for r in (
            client.post("/v1/audio/speech", json=SPEECH, headers=evil),
            client.post("/v1/audio/speech", content=b"{}", headers={**evil, "Content-Type": "text/plain"}),
            client.get("/v1/audio/voices", headers=evil),
            client.delete("/v1/audio/voices/anyone", headers=evil),
        ):
            assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"
            assert "access-control-allow-origin" not in r.headers
        preflight = {**evil, "Access-Control-Request-Method": "POST"}
        r = client.options("/v1/audio/speech", headers=preflight)
        assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
        with pytest.raises(WebSocketDisconnect) as refused:
            with client.websocket_connect(ROUTE, headers=evil):
                pass
        assert refused.value.code == 1008
        # The server's own page (the demo) and clients that send no Origin are served.
        own = client.post("/v1/audio/speech", json=SPEECH, headers={"Origin": "http://testserver"})
        assert own.status_code == 200 and len(own.content) > 44
        assert "access-control-allow-origin" not in own.headers  # same origin needs none
        with client.websocket_connect(ROUTE, headers={"Origin": "http://testserver"}) as ws:
            ws.send_json({"type": "session.update", "session": {"voice": "serena"}})
            assert ws.receive_json()["type"] == "session.updated"


def test_configured_origins_are_served_with_cors_headers(engines):
    page = "https://app.example"
    with _client(engines, allowed_origins=(page,)) as client:
        r = client.options(
            "/v1/audio/speech",
            headers={
                "Origin": page,
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "content-type",
            },
        )
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == page
        r = client.post("/v1/audio/speech", json=SPEECH, headers={"Origin": page})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == page
        assert "x-kazeia-seed" in r.headers["access-control-expose-headers"].lower()
        with client.websocket_connect(ROUTE, headers={"Origin": page}) as ws:
            ws.send_json({"type": "session.update", "session": {"voice": "serena"}})
            assert ws.receive_json()["type"] == "session.updated"
        r = client.get("/v1/models", headers={"Origin": "https://app.example.evil"})
        assert r.status_code == 403 and "access-control-allow-origin" not in r.headers


def test_an_api_key_is_required_as_openai_clients_send_it(engines):
    with _client(engines, api_key=KEY) as client:
        for headers in ({}, {"Authorization": "Bearer wrong-key-0000"}, {"Authorization": KEY},
                        {"Authorization": f"Basic {KEY}"}, {"Authorization": f"Bearer {KEY}x"}):  # fmt: skip
            r = client.post("/v1/audio/speech", json=SPEECH, headers=headers)
            assert r.status_code == 401, headers
            assert r.json()["error"]["code"] == "invalid_api_key" and r.headers["www-authenticate"] == "Bearer"
            assert KEY not in r.text
        assert client.get("/health").status_code == 200  # liveness probes and the demo page need none
        assert client.get("/").status_code == 200
        assert client.get("/v1/audio/voices?api_key=" + KEY).status_code == 401  # the query is for sockets only
        bearer = {"Authorization": f"Bearer {KEY}"}
        assert client.get("/v1/models", headers=bearer).status_code == 200
        assert client.post("/v1/audio/speech", json=SPEECH, headers=bearer).status_code == 200
        for route, headers in ((ROUTE, {}), (ROUTE + "?api_key=nope-nope-nope", {})):
            with pytest.raises(WebSocketDisconnect) as refused:
                with client.websocket_connect(route, headers=headers):
                    pass
            assert refused.value.code == 1008
        for route, headers in ((ROUTE + "?api_key=" + KEY, {}), (ROUTE, bearer)):
            with client.websocket_connect(route, headers=headers) as ws:
                ws.send_json({"type": "session.update", "session": {"voice": "serena"}})
                assert ws.receive_json()["type"] == "session.updated"


def test_the_openai_client_passes_its_api_key(engines, tmp_path):
    openai = pytest.importorskip("openai")
    from server_support import LiveServer

    config = ServerConfig(
        "tiny-custom", limits=Limits(max_new_tokens=8), api_key=KEY, allowed_hosts=loopback_hosts("127.0.0.1")
    )
    with LiveServer(create_app(engines["0.6B-custom"], config)) as server:
        good = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
        with good.audio.speech.with_streaming_response.create(
            model="tts-1", voice="serena", input="Keyed.", response_format="wav", extra_body={"max_new_tokens": 3}
        ) as response:
            data = response.read()
        assert data[:4] == b"RIFF" and len(data) > 44
        bad = openai.OpenAI(base_url=server.url + "/v1", api_key="someone-else", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.audio.speech.create(model="tts-1", voice="serena", input="Keyed.")


def test_an_idle_websocket_is_closed(engines):
    with _client(engines, ws_idle_s=IDLE_S) as client:
        with client.websocket_connect(ROUTE) as ws:
            ws.send_json({"type": "session.update", "session": {"voice": "serena", "max_new_tokens": 3}})
            ws.send_json({"type": "input_text.append", "text": "Spoken, then nothing."})  # busy from here
            ws.send_json({"type": "input_text.end"})
            assert ws.receive_json()["type"] == "session.updated"
            while (
                not isinstance(message := ws.receive(), dict)
                or message.get("text") is None
                or ('"audio.done"' not in message["text"])
            ):
                pass
            closed = ws.receive()  # nothing more to say or speak: closed after IDLE_S
        assert closed["type"] == "websocket.close" and closed["code"] == 1000 and "idle" in closed["reason"]


def test_a_socket_whose_live_text_ended_badly_is_idle_too(engines):
    """An utterance left open after its audio ended (here: text_timeout) only drops deltas: the
    socket is idle and closed like any other, so it cannot hold a connection slot forever."""
    with _client(engines, ws_idle_s=IDLE_S, text_timeout=0.2) as client:
        with client.websocket_connect(ROUTE) as ws:
            ws.send_json({"type": "session.update", "session": {"voice": "serena", "max_new_tokens": 6}})
            ws.send_json({"type": "input_text.append", "text": "And then nothing "})  # busy until it times out
            assert ws.receive_json()["type"] == "session.updated"
            while (message := ws.receive()).get("text") is None or '"text_timeout"' not in message["text"]:
                assert message["type"] == "websocket.send", message
            closed = ws.receive()
        assert closed["type"] == "websocket.close" and "idle" in closed["reason"]


def test_api_keys_in_websocket_paths_are_not_logged():
    record = logging.LogRecord(
        "uvicorn.error", logging.INFO, __file__, 1, '%s - "WebSocket %s" [accepted]',
        ("127.0.0.1:5000", f"/v1/audio/speech/stream?api_key={KEY}&x=1"), None,
    )  # fmt: skip
    assert RedactKeys().filter(record)
    assert KEY not in record.getMessage() and "api_key=***&x=1" in record.getMessage()


def test_kazeia_serve_guards_by_default(tiny_checkpoints, tmp_path, monkeypatch):
    monkeypatch.setenv("KAZEIA_API_KEY", KEY)
    log = tmp_path / "loopback.log"
    process, url = start_cli_server(tiny_checkpoints["0.6B-custom"], "--log-level", "warning", log=log)
    try:
        assert httpx.get(url + "/v1/models").status_code == 401
        assert httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
        rebound = {"Authorization": f"Bearer {KEY}", "Host": "rebound.example"}
        assert httpx.get(url + "/v1/models", headers=rebound).status_code == 421
    finally:
        stop_process(process)
    assert "without an API key" not in log.read_text()


def test_kazeia_serve_on_every_address_without_a_key_warns(tiny_checkpoints, tmp_path, monkeypatch):
    monkeypatch.delenv("KAZEIA_API_KEY", raising=False)
    log = tmp_path / "open.log"
    process, url = start_cli_server(tiny_checkpoints["0.6B-custom"], "--host", "0.0.0.0", log=log)
    try:
        assert httpx.get(url + "/v1/models", headers={"Host": "speech.lan:8000"}).status_code == 200
    finally:
        stop_process(process)
    text = log.read_text()
    assert "serving on 0.0.0.0 without an API key" in text and "--api-key" in text, text
    assert os.environ.get("KAZEIA_API_KEY") is None
