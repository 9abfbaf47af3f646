"""Hostile requests against the real `kazeia serve` (a tiny Base checkpoint, so voices can be
uploaded): audio bombs, token amplification, deep JSON, empty-delta holds. Each is refused with a
4xx naming what is wrong, the server's peak memory grows by less than 200 MB on any of them, and a
live text kept "alive" with empty deltas frees the worker within the configured bounds.
"""

import io
import json
import struct
import time

import numpy as np
import pytest

pytest.importorskip("fastapi")
import httpx
import soundfile as sf
from server_support import proc_status, start_cli_server, stop_process

GROWTH_KB = 200 * 1024
TEXT_TIMEOUT, TEXT_DEADLINE = 0.6, 2.5


@pytest.fixture(scope="module")
def server(tiny_checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    args = ("--voices-dir", str(root / "voices"), "--log-level", "warning")
    args += ("--text-timeout", str(TEXT_TIMEOUT), "--text-deadline", str(TEXT_DEADLINE))
    args += ("--allow-ignore-eos", "--limit", "max_uploads=2")  # the holds below use ignore_eos
    process, url = start_cli_server(tiny_checkpoints["0.6B-base"], *args, log=root / "serve.log")
    yield process, url
    stop_process(process)


def _wav(rate: int, frames: int, channels: int = 1, fmt: str = "WAV", silent: bool = False) -> bytes:
    data = io.BytesIO()
    if silent:  # compresses to almost nothing in FLAC, whatever its length
        audio = np.zeros((frames, channels), np.int16)
    else:
        audio = np.random.default_rng(0).integers(-9000, 9000, (frames, channels), dtype=np.int16)
    sf.write(data, audio, rate, format=fmt, subtype="PCM_16")
    return data.getvalue()


def _lying_wav() -> bytes:
    """A 44-byte header that declares 4 GiB of 192 kHz stereo samples, and no samples at all."""
    fmt = struct.pack("<4sIHHIIHH", b"fmt ", 16, 1, 2, 192_000, 192_000 * 4, 4, 16)
    return b"RIFF" + struct.pack("<I", 0xFFFFFFFF) + b"WAVE" + fmt + b"data" + struct.pack("<I", 0xFFFFFFF0)


def _peak_growth(process, send, *args, **kwargs) -> tuple[httpx.Response, int]:
    """send(*args, **kwargs), and how much the server's peak RSS grew meanwhile (kB)."""
    before = proc_status(process.pid, "VmHWM")
    response = send(*args, **kwargs)
    return response, proc_status(process.pid, "VmHWM") - before


def test_hostile_requests_are_refused_within_the_memory_bound(server):
    process, url = server
    rare = "\U00020000" * 4096  # 4096 characters, ~3 tokens each
    cases = {
        "100 Hz wav (2 MB)": ("audio", _wav(100, 1_000_000), "declares 100 Hz"),
        "1 Hz wav": ("audio", _wav(1, 200_000), "declares 1 Hz"),
        "8-channel flac": ("audio", _wav(8000, 2_000_000, 8, "FLAC", silent=True), "250.0 s long"),
        "lying header": ("audio", _lying_wav(), "reference audio"),
        "64 KiB transcript": ("ref_text", "言" * 65_536, None),
    }
    with httpx.Client(base_url=url, timeout=60) as client:
        client.get("/health")  # warm
        for name, (field, payload, words) in cases.items():
            if field == "audio":
                files, data = {"audio": ("ref.bin", payload)}, {"name": "bomb", "ref_text": "Hello."}
            else:
                files, data = {"audio": ("ref.wav", _wav(16000, 48000))}, {"name": "bomb", "ref_text": payload}
            r, growth = _peak_growth(process, client.post, "/v1/audio/voices", data=data, files=files)
            assert 400 <= r.status_code < 500, (name, r.status_code, r.text[:200])
            assert words is None or words in r.json()["error"]["message"], (name, r.text[:300])
            assert growth < GROWTH_KB, f"{name}: peak RSS grew by {growth >> 10} MiB"
        json_cases = {
            "rare characters": json.dumps({"model": "tts-1", "input": rare, "voice": "nobody"}),
            "deep nesting": "[" * 200_000,
            "huge numbers": json.dumps({"model": "tts-1", "input": "hi", "voice": "x", "max_new_tokens": 10**300}),
        }
        for name, body in json_cases.items():
            headers = {"Content-Type": "application/json"}
            r, growth = _peak_growth(process, client.post, "/v1/audio/speech", content=body, headers=headers)
            assert 400 <= r.status_code < 500, (name, r.status_code, r.text[:200])
            assert growth < GROWTH_KB, f"{name}: peak RSS grew by {growth >> 10} MiB"
        assert client.get("/health").json()["status"] == "ok"


def test_empty_deltas_do_not_hold_the_worker(server, ref_voice):
    """A live text kept open by empty and blank deltas every 0.1 s ends at text_timeout; one that
    trickles real text forever ends at text_deadline (the error names which). Either way the worker
    is free afterwards."""
    from websockets.sync.client import connect

    _, url = server
    ws_url = url.replace("http", "ws") + "/v1/audio/speech/stream"
    session = {"voice": ref_voice, "max_new_tokens": 4000, "ignore_eos": True}
    for delta, bound, name in (("", TEXT_TIMEOUT, "text_timeout"), (" ", TEXT_TIMEOUT, "text_timeout"),
                               ("a ", TEXT_DEADLINE, "text_deadline")):  # fmt: skip
        with connect(ws_url) as ws:
            ws.send(json.dumps({"type": "session.update", "session": session}))
            assert '"session.updated"' in ws.recv(timeout=10)
            ws.send(json.dumps({"type": "input_text.append", "text": "Holding the worker "}))
            started, ended = time.monotonic(), None
            while ended is None and time.monotonic() - started < bound + 10:
                ws.send(json.dumps({"type": "input_text.append", "text": delta}))
                try:
                    while True:
                        message = ws.recv(timeout=0.1)
                        if isinstance(message, str) and json.loads(message)["type"] in ("error", "audio.done"):
                            ended = json.loads(message)
                            break
                except TimeoutError:
                    pass
            held = time.monotonic() - started
        assert ended is not None and ended["type"] == "error", (delta, ended)
        assert ended["error"]["code"] == "text_timeout" and f"{bound:g} s ({name})" in ended["error"]["message"], ended
        assert held >= bound, f"delta {delta!r} ended after {held:.1f} s, before its bound of {bound} s"


@pytest.fixture(scope="module")
def ref_voice(server):
    """A saved x-vector voice on the server (the Base checkpoint speaks only saved voices)."""
    _, url = server
    files, data = {"audio": ("ref.wav", _wav(16000, 48000))}, {"name": "holder", "x_vector_only": "true"}
    r = httpx.post(url + "/v1/audio/voices", data=data, files=files, timeout=60)
    assert r.status_code == 201, r.text
    return "holder"


def _upload(url: str, name: str, audio: bytes, timeout: float = 60, **fields) -> httpx.Response:
    files, data = {"audio": ("ref.wav", audio)}, {"name": name, **fields}
    return httpx.post(url + "/v1/audio/voices", data=data, files=files, timeout=timeout)


def test_uploads_are_bounded_and_leave_the_server_answering(server):
    """Two uploads whose bodies never finish arriving hold both upload places (--limit
    max_uploads=2): a third is a 503 at once, the voice list still answers, and once they are gone
    uploads are taken again."""
    import socket

    from hostile_support import wait_for

    _, url = server
    port = int(url.rsplit(":", 1)[1])
    head = (
        b"POST /v1/audio/voices HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1000000\r\n"
        b"Content-Type: multipart/form-data; boundary=b\r\n\r\n--b\r\n"
    )
    holders = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
    try:
        for sock in holders:
            sock.sendall(head)
        bad_name = lambda: _upload(url, "!", _wav(16000, 48000), x_vector_only="true")  # noqa: E731
        refused = wait_for(lambda: (r := bad_name()).status_code == 503 and r, 60, "a third upload refused")
        assert refused.json()["error"]["code"] == "busy" and "Retry-After" in refused.headers
        assert httpx.get(url + "/v1/audio/voices", timeout=10).status_code == 200
    finally:
        for sock in holders:
            sock.close()
    wait_for(lambda: bad_name().status_code == 400, 60, "uploads taken again")


def test_a_megabyte_voice_name_is_refused_before_any_lookup(server):
    """Bounded before it reaches the saved voices (or difflib's suggestions), and never echoed whole."""
    _, url = server
    body = {"input": "Hi.", "voice": "v" * 1_000_000}
    r = httpx.post(url + "/v1/audio/speech", json=body, timeout=60)
    assert r.status_code == 400 and len(r.content) < 2048, (r.status_code, len(r.content))
    assert r.json()["error"]["code"] == "string_above_max_length" and r.json()["error"]["param"] == "voice"


def test_float_audio_far_outside_its_range_is_refused(server):
    """A float WAV of samples around 1e20 would give a NaN x-vector and a voice failing every request."""
    _, url = server
    data = io.BytesIO()
    audio = 1e20 * np.sin(np.arange(48000) / 5)
    sf.write(data, audio.astype(np.float32), 16000, format="WAV", subtype="FLOAT")
    r = _upload(url, "loud", data.getvalue(), x_vector_only="true")
    assert r.status_code == 400 and r.json()["error"]["param"] == "audio", r.text[:300]
    assert "magnitude" in r.json()["error"]["message"]
    assert "loud" not in httpx.get(url + "/v1/audio/voices", timeout=10).text


def test_kazeia_serve_refuses_ignore_eos_unless_allowed(engines):
    """The command's default: a request asking for ignore_eos is a 400 naming it; with
    --allow-ignore-eos it is spoken."""
    from fastapi.testclient import TestClient

    from kazeia.cli import build_parser
    from kazeia.server import create_app
    from kazeia.server.commands import server_config

    body = {"input": "Hi.", "voice": "serena", "ignore_eos": True, "max_new_tokens": 3, "response_format": "pcm"}
    for flags, status in (([], 400), (["--allow-ignore-eos"], 200)):
        args = build_parser().parse_args(["serve", "--model", "tiny", *flags])
        with TestClient(create_app(engines["0.6B-custom"], server_config(args, "tiny"))) as client:
            r = client.post("/v1/audio/speech", json=body)
        assert r.status_code == status, r.text[:300]
        if status == 400:
            assert r.json()["error"]["param"] == "ignore_eos"
