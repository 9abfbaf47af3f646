"""How an utterance ends when its client does not: a real uvicorn on 127.0.0.1 serving the app in a
thread, each moment reached for certain rather than timed: an answer cut by the stall rule must
end as a cut one (the chunked body without its terminator), never as a complete 200."""

from __future__ import annotations

import socket

import pytest

pytest.importorskip("fastapi")
import httpx
from hostile_support import wait_for
from server_support import LiveServer

from kazeia.server import Limits, ServerConfig, create_app

BODY = {"input": "Hello there.", "voice": "serena", "seed": 3, "ignore_eos": True, "response_format": "pcm"}


def test_an_answer_cut_by_the_stall_rule_never_ends_as_a_complete_one(engines):
    """A client that stops reading is cancelled (client_stall_s); reading on afterwards it gets an
    incomplete body, whatever the format: the end of a complete answer would pass truncated audio
    off as the whole."""
    limits = Limits(max_buffered_bytes=16 << 10, client_stall_s=1.0)
    app = create_app(engines["0.6B-custom"], ServerConfig("tiny", limits=limits, max_batch=1))
    worker = app.state.kazeia.worker
    server = LiveServer(app)
    server.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16 << 10)  # its connections inherit it
    with server, httpx.Client(base_url=server.url, timeout=60) as client:
        for response_format, stream_format in (("pcm", "audio"), ("mp3", "audio"), ("wav", "sse")):
            body = {**BODY, "max_new_tokens": 3000, "speed": 0.25, "response_format": response_format}
            with client.stream("POST", "/v1/audio/speech", json={**body, "stream_format": stream_format}) as r:
                assert r.status_code == 200
                chunks = r.iter_bytes()
                head = next(chunks)  # then nothing is read until the job has been cut
                count = len(worker.records)
                wait_for(lambda: len(worker.records) > count, 120, "the stall rule")  # noqa: B023
                assert worker.records[-1].status == "cancelled"
                if stream_format == "sse":  # an `error` event ends the events, not speech.audio.done
                    rest = head + b"".join(chunks)
                    assert b'"code":"client_stalled"' in rest and b"speech.audio.done" not in rest
                    continue
                with pytest.raises(httpx.RemoteProtocolError, match="incomplete"):
                    for _ in chunks:
                        pass
