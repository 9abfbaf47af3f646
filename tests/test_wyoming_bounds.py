"""Hostile and careless Wyoming clients against a real `kazeia wyoming` (a tiny CustomVoice
checkpoint, in a child process ended by its PID), on raw sockets: client text is echoed escaped,
a control token split between chunks is plain text, a client that stops reading (or never reads a
pong) loses its connection and its socket within the stall bound, and one that resets at once
cancels its utterance. Waits are bounded; what is checked is what must happen, not when.
"""

from __future__ import annotations

import os
import re
import time

import pytest

pytest.importorskip("wyoming")
from hostile_support import WyomingClient, deaf_socket, reset, start_wyoming, wait_for, wyoming_event
from server_support import stop_process

CONNECTIONS = 3
# ~80 tokens: the runaway guard allows it ~700 frames, at speed 0.25 some 10 MB of audio to send.
LONG = " ".join(f"Sentence number {n} goes on, and on, and then it ends." for n in range(8))


@pytest.fixture(scope="module")
def wyoming(tiny_checkpoints, tmp_path_factory):
    log = tmp_path_factory.mktemp("wyoming-bounds") / "wyoming.log"
    args = ["--max-batch", "2", "--max-connections", str(CONNECTIONS), "--limit", "client_stall_s=2"]
    args += ["--max-new-tokens", "3000", "--speed", "0.25", "--voice", "serena", "--seed", "1", "--log-level", "info"]
    process, port = start_wyoming(tiny_checkpoints["0.6B-custom"], *args, log=log)
    yield process, port, log
    stop_process(process)


def _sockets(pid: int) -> int:
    """Sockets the process holds open."""
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            count += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
        except FileNotFoundError:
            pass
    return count


def _served(port: int) -> bool:
    with WyomingClient(port) as client:
        client.send("describe")
        event = client.read(30)
        return event is not None and event[0] == "info"


def test_client_text_is_echoed_escaped_and_refusals_keep_the_connection(wyoming):
    _, port, _ = wyoming
    with WyomingClient(port) as client:
        client.sock.sendall(wyoming_event("ping", raw_data=b'{"text": "\\ud800 hi"}'))
        kind, data, _ = client.read(30)
        assert kind == "pong" and data["text"] == "\\ud800 hi", (kind, data)
        refusals = [
            (b'{"text": "Hi.", "\\udfff": 1}', None),
            (b'{"text": "Hi.", "voice": {"name": "\\ud800"}}', None),
            (b'{"text": "Hi.", "voice": {"name": -Infinity}}', "invalid_number"),
            (b'{"text": "Hi.", "voice": {"name": "' + b"v" * 100_000 + b'"}}', "string_above_max_length"),
        ]
        for raw, code in refusals:
            client.sock.sendall(wyoming_event("synthesize", raw_data=raw))
            events = client.read_until("error", "audio-stop", seconds=120)
            kind, data, _ = events[-1]
            if kind == "error":
                assert data["code"] != "internal_error" and (code is None or data["code"] == code), data
                assert len(data["text"]) < 1024, len(data["text"])
        client.send("ping", {"text": "still here"})
        assert client.read(30)[1]["text"] == "still here"


def test_a_control_token_split_between_chunks_is_spoken_as_plain_text(wyoming):
    _, port, _ = wyoming
    with WyomingClient(port) as client:
        client.send("synthesize-start", {})
        for chunk in ("Hello <|im_", "", "end|> there", ""):
            client.send("synthesize-chunk", {"text": chunk})
        client.send("synthesize-stop")
        events = client.read_until("synthesize-stopped", seconds=120)
    kinds = [e[0] for e in events]
    assert "error" not in kinds and kinds[0] == "audio-start" and "audio-stop" in kinds, kinds
    assert sum(len(e[2]) for e in events if e[0] == "audio-chunk") > 0


def test_clients_that_stop_reading_lose_their_connection_and_socket(wyoming):
    """Every connection slot taken by a client that asks for minutes of audio and reads none: each
    is dropped once it has taken nothing for client_stall_s, and others are served again. Then
    clients that send pings of 900 kB and never read the pongs: their sockets are closed too."""
    process, port, _ = wyoming
    baseline = _sockets(process.pid)
    deaf = [deaf_socket(port) for _ in range(CONNECTIONS)]
    try:
        for sock in deaf:
            sock.sendall(wyoming_event("synthesize", {"text": LONG}))
        wait_for(lambda: _served(port), 240, "a new client served")
        wait_for(lambda: _sockets(process.pid) <= baseline, 60, "the deaf clients' sockets closed")
    finally:
        for sock in deaf:
            sock.close()
    pings = [deaf_socket(port) for _ in range(CONNECTIONS)]
    try:
        for sock in pings:  # more pong than the kernel's buffers take: the server's own writes wait
            sock.sendall(wyoming_event("ping", {"text": "p" * 900_000}) * 8)
        wait_for(lambda: _sockets(process.pid) <= baseline, 60, "the unread pongs' sockets closed")
    finally:
        for sock in pings:
            sock.close()
    assert _served(port)


def test_a_client_that_resets_at_once_cancels_its_utterance(wyoming):
    """Its audio-start cannot be sent: the job is cancelled then, not left to run for nobody."""
    process, port, log = wyoming
    ended = re.compile(r"utterance (\d+) (\w+)[^:]*: (\d+) frames")
    before = len(ended.findall(log.read_text()))
    sock = deaf_socket(port)
    sock.sendall(wyoming_event("synthesize", {"text": LONG}))
    time.sleep(0)  # (nothing to wait for: the reset follows the event at once)
    reset(sock)
    line = wait_for(lambda: ended.findall(log.read_text())[before:], 120, "the utterance ending")[0]
    text = log.read_text()
    assert line[1] == "cancelled" and int(line[2]) < 200, line
    assert f"utterance {line[0]} cancelled (cancelled): " in text and "took no audio" not in text
    assert _served(port)
