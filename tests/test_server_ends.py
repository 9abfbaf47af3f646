"""How an utterance ends when its client does not: a real uvicorn on 127.0.0.1 serving the app in a
thread, the worker held at a gate the test opens, so each moment is reached for certain rather
than timed. A client that leaves while its stream is being made must not freeze the event loop;
an answer cut by the stall rule must end as a cut one (the chunked body without its terminator),
never as a complete 200."""

from __future__ import annotations

import socket
import threading

import pytest

pytest.importorskip("fastapi")
import httpx
from hostile_support import wait_for
from server_support import LiveServer

from kazeia.server import Limits, ServerConfig, create_app

BODY = {"input": "Hello there.", "voice": "serena", "seed": 3, "ignore_eos": True, "response_format": "pcm"}


class GatedEngine:
    """The engine, but `stream_request` (where an ICL voice's reference is decoded) waits at a gate."""

    def __init__(self, engine):
        self.engine, self.entered, self.gate = engine, threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def stream_request(self, *args, **kwargs):
        self.entered.set()
        assert self.gate.wait(120), "the gate was never opened"
        return self.engine.stream_request(*args, **kwargs)


def test_a_client_leaving_while_its_stream_is_made_never_freezes_the_loop(engines):
    """Its cancel runs on the event loop while the worker is still making the stream: /health must
    answer meanwhile, and the job ends cancelled once the stream exists."""
    app = create_app(engines["0.6B-custom"], ServerConfig("tiny", max_batch=1))
    worker = app.state.kazeia.worker
    gated = worker.engine = GatedEngine(worker.engine)
    try:
        with LiveServer(app) as server, httpx.Client(base_url=server.url, timeout=10) as client:
            with client.stream("POST", "/v1/audio/speech", json={**BODY, "max_new_tokens": 400}):
                assert gated.entered.wait(60)
                job = next(iter(worker._current))
            # The client is gone; the loop must notice and cancel without waiting for the worker.
            wait_for(lambda: client.get("/health").status_code == 200 and job.cancelled, 60, "cancelled")
            assert client.get("/health").json()["status"] == "ok"
            gated.gate.set()
            wait_for(lambda: worker.records and worker.records[-1].id == job.id, 60, "the job ending")
            record = worker.records[-1]
            assert record.status == "cancelled" and record.frames <= record.frames_at_cancel + 1, record
    finally:
        gated.gate.set()


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
