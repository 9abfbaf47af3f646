"""Behind real time: the server's count of streams whose audio comes later than a listener plays it.

A listener starts playing at an utterance's first audio and keeps a 250 ms buffer (PLAYOUT_S, the
qualification's standard); the stream is behind when its audio made so far is over 250 ms short of
the time since. The worker's clock is replaced by one the test drives, so no figure depends on how
fast this machine is. A real uvicorn serves the app (LiveServer): a stream held at the gate must
reach its client before it ends, which the TestClient of older Starlette releases does not do.
"""

import asyncio
import itertools
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")
import httpx
from server_support import HeldJobs, LiveServer

from kazeia.audio import SAMPLE_RATE
from kazeia.server import ServerConfig, create_app
from kazeia.server import worker as worker_module
from kazeia.server.job import PLAYOUT_S, Job

HOLD_S = 120  # bound of one request's wait (a held stream's body waits for the gate, not for this)
SPEECH = {"input": "Pace.", "voice": "serena", "response_format": "pcm", "max_new_tokens": 12, "ignore_eos": True}


def _job(live=None) -> Job:
    loop = asyncio.new_event_loop()
    try:
        return Job(SimpleNamespace(live=live), None, loop)
    finally:
        loop.close()


def test_a_job_falls_behind_once_its_audio_is_later_than_the_buffer():
    job = _job()
    assert job.late_s(100.0) == 0.0  # no audio yet: nothing to be late for
    assert not job.made(SAMPLE_RATE, 100.0)  # one second of audio at once
    assert job.late_s(100.5) == pytest.approx(-0.5)
    assert not job.made(SAMPLE_RATE // 2, 101.0 + PLAYOUT_S - 0.01)  # just within the buffer
    assert job.made(SAMPLE_RATE // 2, 101.5 + PLAYOUT_S + 0.01)  # the buffer ran dry before it
    assert job.fell_behind and not job.made(SAMPLE_RATE, 110.0)  # counted once per utterance
    assert job.late_s(110.0) == pytest.approx(110.0 - 100.0 - 3.0)


def test_live_text_waits_for_its_client_and_is_never_behind():
    job = _job(live=object())
    job.made(1, 0.0)
    assert job.late_s(60.0) == 0.0 and not job.made(1, 60.0)


class _Clock:
    """time for the worker module: perf_counter moves `step` seconds at each reading."""

    def __init__(self, step: float):
        self._ticks = itertools.count()
        self.step = step

    def perf_counter(self) -> float:
        return 1000.0 + self.step * next(self._ticks)

    monotonic = staticmethod(time.monotonic)


def _metric(client, name: str) -> float:
    line = next(x for x in client.get("/metrics").text.splitlines() if x.startswith(name + " "))
    return float(line.split()[1])


@pytest.mark.parametrize("step, late", [(10.0, True), (0.0, False)])
def test_health_and_metrics_count_streams_behind_real_time(engines, monkeypatch, step, late):
    app = create_app(engines["0.6B-custom"], ServerConfig("tiny-custom"))
    monkeypatch.setattr(worker_module, "time", _Clock(step))
    with LiveServer(app) as live, httpx.Client(base_url=live.url, timeout=HOLD_S) as client:
        before = _metric(client, "kazeia_streams_fell_behind_total")
        with HeldJobs(as_client=False) as gate, client.stream("POST", "/v1/audio/speech", json=SPEECH) as answer:
            chunks = answer.iter_bytes()
            next(chunks)  # the first piece of audio is out; the worker waits at the gate for the second
            gate.wait_held()
            health = client.get("/health").json()
            assert health["active"] == 1 and health["behind"] == int(late)
            assert _metric(client, "kazeia_streams_behind") == int(late)
            gate.release()
            for _ in chunks:
                pass
        assert client.get("/health").json()["behind"] == 0  # nothing in flight
        assert _metric(client, "kazeia_streams_fell_behind_total") == before + int(late)


def _second_while_held(client, gate: HeldJobs, refused: bool) -> dict | None:
    """A second utterance while the first waits at `gate`: refused (503 with Retry-After; its error
    returned) or let in and spoken to its end. The gate is opened either way."""
    if refused:
        answer = client.post("/v1/audio/speech", json=SPEECH)
        assert answer.status_code == 503 and int(answer.headers["retry-after"]) >= 1
        gate.release()
        return answer.json()["error"]
    with client.stream("POST", "/v1/audio/speech", json=SPEECH) as second:
        assert second.status_code == 200
        gate.release()
        assert b"".join(second.iter_bytes())
    return None


@pytest.mark.parametrize("admission", ["measured", "behind", "all"])
def test_a_new_stream_is_refused_while_one_is_behind_unless_all_are_let_in(engines, monkeypatch, admission):
    """--admission measured/behind: 503 (at_capacity) with Retry-After to a new utterance while a
    stream is behind, and admitted again once none is; with `all` the new one is admitted."""
    app = create_app(engines["0.6B-custom"], ServerConfig("tiny-custom", max_batch=2, admission=admission))
    monkeypatch.setattr(worker_module, "time", _Clock(10.0))  # every stream is late
    with LiveServer(app) as live, httpx.Client(base_url=live.url, timeout=HOLD_S) as client:
        with HeldJobs(as_client=False) as gate, client.stream("POST", "/v1/audio/speech", json=SPEECH) as answer:
            chunks = answer.iter_bytes()
            next(chunks)
            gate.wait_held()
            assert client.get("/health").json()["behind"] == 1
            error = _second_while_held(client, gate, refused=admission != "all")
            if error is not None:
                assert error["code"] == "at_capacity" and "fall behind real time" in error["message"]
            for _ in chunks:
                pass
        assert client.post("/v1/audio/speech", json=SPEECH).status_code == 200  # one alone is always let in


@pytest.mark.parametrize("admission", ["measured", "behind"])
def test_the_measured_pace_refuses_one_stream_too_many(engines, monkeypatch, admission):
    """A server whose streams were measured slower than real time alone refuses a second one at
    once (`measured`), though nothing is behind now; `behind` lets it in. The clock stands still,
    so no stream is ever late; the evidence is put in as the worker would."""
    app = create_app(engines["0.6B-custom"], ServerConfig("tiny-custom", max_batch=2, admission=admission))
    monkeypatch.setattr(worker_module, "time", _Clock(0.0))
    worker = app.state.kazeia.worker
    worker.capacity.observe(1, audio_s=1.0, waited_s=3.0, now=1000.0)  # alone at a third of real time
    with LiveServer(app) as live, httpx.Client(base_url=live.url, timeout=HOLD_S) as client:
        health = client.get("/health").json()
        assert health["admission"] == admission and health["paces"] == {"1": 0.333}
        assert health["admits"] == (1 if admission == "measured" else 2)
        assert _metric(client, "kazeia_streams_admitted_at_most") == health["admits"]
        with HeldJobs(as_client=False) as gate, client.stream("POST", "/v1/audio/speech", json=SPEECH) as answer:
            chunks = answer.iter_bytes()
            next(chunks)
            gate.wait_held()
            assert client.get("/health").json()["behind"] == 0
            error = _second_while_held(client, gate, refused=admission == "measured")
            assert (error or {}).get("code") == ("at_capacity" if admission == "measured" else None)
            for _ in chunks:
                pass


@pytest.mark.parametrize("step, frames, measured", [(10.0, 11, True), (0.0, 11, False), (10.0, 1, False)])
def test_each_chunk_a_server_waits_for_is_evidence_of_its_pace(engines, monkeypatch, step, frames, measured):
    """The worker times each chunk it waits for after the first (which waits for the prompt): with a
    clock that jumps 10 s at every reading, an utterance spoken alone shows a pace far below real
    time; with one that stands still, no time was waited and nothing is learnt; nor from a
    one-frame utterance, whose one chunk is its first."""
    app = create_app(engines["0.6B-custom"], ServerConfig("tiny-custom", max_batch=2))
    monkeypatch.setattr(worker_module, "time", _Clock(step))
    with LiveServer(app) as live, httpx.Client(base_url=live.url, timeout=HOLD_S) as client:
        spoken = client.post("/v1/audio/speech", json={**SPEECH, "max_new_tokens": frames + 1})
        assert spoken.status_code == 200 and len(spoken.content) == frames * 1920 * 2
        paces = client.get("/health").json()["paces"]
    if measured:
        assert set(paces) == {"1"} and paces["1"] < 0.1  # 10 frames (0.8 s) over >= 10 s waits
    else:
        assert paces == {}
