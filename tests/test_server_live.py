"""A real uvicorn on 127.0.0.1: the official OpenAI client, streaming, disconnects, a full queue.

Tests that need an utterance to be still under way (audio arriving while it is generated, a
client that leaves, a full queue) hold the worker at a gate (`HeldJobs`) rather than count on the
machine being slow enough: the utterance cannot end before the test lets it or cancels it."""

import contextlib
import io
import json
import re
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")
import httpx
import soundfile as sf
from server_support import (
    FRAME_BYTES,
    HEADER_BYTES,
    HeldJobs,
    LiveServer,
    assert_pcm_equal,
    offline_pcm,
    sse_audio,
    sse_events,
    streamed_wav_pcm,
)

from kazeia.server import Limits, ServerConfig, create_app

TEXT = "A real server on a real socket."
LONG = dict(ignore_eos=True, max_new_tokens=150)  # 149 frames: seconds of work, to be cut short


@pytest.fixture(scope="module")
def live(engines):
    config = ServerConfig("tiny-custom", queue_size=1, limits=Limits(max_new_tokens=150))
    with LiveServer(create_app(engines["0.6B-custom"], config)) as server:
        yield server


def _generating_threads() -> int:
    return sum(t.name == "kazeia-generate" for t in threading.enumerate())


@pytest.fixture(autouse=True)
def idle_after(live):
    """Every test leaves the worker idle and no generation thread behind."""
    yield
    worker, deadline = live.app.state.kazeia.worker, time.monotonic() + 20
    while (worker.active or _generating_threads()) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert worker.active == 0 and worker.queue_depth == 0 and _generating_threads() == 0


def _body(**fields) -> dict:
    return {"model": "tiny-custom", "input": TEXT, "voice": "serena", **fields}


def _wait_for_record(worker, job_count: int):
    deadline = time.monotonic() + 20
    while len(worker.records) < job_count and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(worker.records) >= job_count, "the job never ended"
    return worker.records[job_count - 1]


def test_openai_client_streams_a_valid_wav(live, engines, tmp_path):
    openai = pytest.importorskip("openai")
    # timeout: the first piece must come while the rest is held
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="not-needed", max_retries=0, timeout=60)
    options = {"seed": 17, "max_new_tokens": 20, "ignore_eos": True, "language": "english"}
    request = dict(model="tiny-custom", voice="serena", input=TEXT, response_format="wav", extra_body=options)
    with HeldJobs() as gate, client.audio.speech.with_streaming_response.create(**request) as response:
        assert response.headers["content-type"] == "audio/wav"
        stream = response.iter_bytes()
        gate.wait_held()
        pieces = [next(stream)]  # it arrives in pieces, as generated: this one before the rest exists
        gate.release()
        pieces += list(stream)
    data = b"".join(pieces)
    (tmp_path / "openai.wav").write_bytes(data)
    audio, rate = sf.read(tmp_path / "openai.wav", dtype="int16")
    assert rate == 24000 and len(audio) == 19 * 1920
    expected = offline_pcm(engines["0.6B-custom"], TEXT, voice="serena", **options)
    assert_pcm_equal(streamed_wav_pcm(data), expected)


@pytest.mark.parametrize("model", ["tts-1", "gpt-4o-mini-tts"])
def test_apps_written_for_openai_name_its_models(live, model, tmp_path):
    """OpenAI's model ids are accepted for the served model (apps that know only those work)."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="not-needed", max_retries=0)
    with client.audio.speech.with_streaming_response.create(
        model=model, voice="serena", input=TEXT, response_format="wav", extra_body={"max_new_tokens": 5}
    ) as response:
        data = response.read()
    (tmp_path / "app.wav").write_bytes(data)
    audio, rate = sf.read(tmp_path / "app.wav", dtype="int16")
    assert rate == 24000 and 1 <= len(audio) // 1920 <= 4


def test_openai_client_sse_and_errors(live):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="not-needed", max_retries=0)
    with client.audio.speech.with_streaming_response.create(
        model="tiny-custom",
        voice="ryan",
        input=TEXT,
        response_format="pcm",
        stream_format="sse",
        extra_body={"max_new_tokens": 6, "ignore_eos": True},
    ) as response:
        events = sse_events(response.read().decode())
    assert len(sse_audio(events)) == 5 * FRAME_BYTES and events[-1]["usage"]["output_tokens"] == 5
    with pytest.raises(openai.BadRequestError) as bad:
        client.audio.speech.create(model="tiny-custom", voice="alloy", input=TEXT)
    assert bad.value.status_code == 400 and "unknown voice 'alloy'" in bad.value.message
    with pytest.raises(openai.BadRequestError, match="speed"):  # beyond OpenAI's 0.25-4.0
        client.audio.speech.create(model="tiny-custom", voice="ryan", input=TEXT, speed=5.0)


def test_audio_arrives_while_it_is_generated(live):
    worker = live.app.state.kazeia.worker
    with HeldJobs() as gate, httpx.Client(base_url=live.url, timeout=30) as client:
        with client.stream("POST", "/v1/audio/speech", json=_body(response_format="wav", **LONG)) as response:
            received = b""
            pieces = response.iter_bytes()
            while len(received) <= HEADER_BYTES:  # comes while the worker is held after its first chunk
                received += next(pieces)
            gate.wait_held()
            assert worker.active == 1  # the first audio is here and the utterance goes on
            gate.release()
            received += b"".join(pieces)
    assert len(streamed_wav_pcm(received)) == 149 * FRAME_BYTES


def test_client_disconnect_stops_generation_within_one_frame(live):
    worker = live.app.state.kazeia.worker
    jobs = len(worker.records)
    with HeldJobs(), httpx.Client(base_url=live.url, timeout=30) as client:  # it cannot end before the client leaves
        with client.stream("POST", "/v1/audio/speech", json=_body(response_format="pcm", **LONG)) as response:
            next(response.iter_bytes())
        record = _wait_for_record(worker, jobs + 1)
    assert record.status == "cancelled"
    assert record.frames - record.frames_at_cancel <= 1 and record.frames < 149


def test_a_whole_response_client_that_leaves_stops_generation(live):
    """`stream: false` sends nothing before the end, so the server polls for a client that left."""
    worker = live.app.state.kazeia.worker
    jobs = len(worker.records)
    with HeldJobs(), httpx.Client(base_url=live.url, timeout=0.5) as client:  # held: no answer before it leaves
        with pytest.raises(httpx.ReadTimeout):  # leaves while the whole answer is being made
            client.post("/v1/audio/speech", json=_body(response_format="pcm", stream=False, **LONG))
        record = _wait_for_record(worker, jobs + 1)
    assert record.status == "cancelled" and record.frames < 149


def test_websocket_disconnect_stops_generation_within_one_frame(live):
    from websockets.sync.client import connect

    worker = live.app.state.kazeia.worker
    jobs = len(worker.records)
    with HeldJobs():  # the utterance cannot end before its client leaves
        with connect(live.url.replace("http", "ws") + "/v1/audio/speech/stream") as ws:
            session = {"voice": "eric", "ignore_eos": True, "max_new_tokens": 150}
            ws.send(json.dumps({"type": "session.update", "session": session}))
            assert '"session.updated"' in ws.recv(timeout=10)
            ws.send('{"type": "input_text", "text": "Goodbye."}')
            assert '"audio.start"' in ws.recv(timeout=10)
            assert isinstance(ws.recv(timeout=10), bytes)
        record = _wait_for_record(worker, jobs + 1)
    assert record.status == "cancelled"
    assert record.frames - record.frames_at_cancel <= 1 and record.frames < 149


def _refused_503(client) -> int:
    found = re.search(r'^kazeia_request_errors_total\{route="/v1/audio/speech",status="503"\} (\d+)$',
                      client.get("/metrics").text, re.M)  # fmt: skip
    return int(found.group(1)) if found else 0


def test_full_queue_is_refused_with_503_and_retry_after(live):
    """`max_batch` utterances generating (each held after its first audio) and one waiting fill the
    queue (queue_size 1): the next is refused, and every one ends cancelled when its client leaves."""
    worker = live.app.state.kazeia.worker
    jobs, places = len(worker.records), worker.max_batch
    body = _body(response_format="pcm", **LONG)
    with HeldJobs(), httpx.Client(base_url=live.url, timeout=30) as client, contextlib.ExitStack() as streams:
        refused = _refused_503(client)  # earlier tests' cut answers count too
        readers = []  # kept: a reader that is dropped closes its response (its client leaves)
        for _ in range(places):
            response = streams.enter_context(client.stream("POST", "/v1/audio/speech", json=body))
            assert response.status_code == 200
            readers.append(response.iter_bytes())
            next(readers[-1])  # its first audio: a serving thread has it, and is held there
        waiting = streams.enter_context(client.stream("POST", "/v1/audio/speech", json=body))
        assert waiting.status_code == 200 and worker.queue_depth == 1  # no serving thread is free
        response = streams.enter_context(client.stream("POST", "/v1/audio/speech", json=body))
        assert response.status_code == 503
        assert worker.queue_depth == 1 and worker.active == places + 1
        assert int(response.headers["retry-after"]) >= 1
        error = json.loads(response.read())["error"]
        assert error["code"] == "queue_full" and error["type"] == "server_error" and "busy" in error["message"]
        assert _refused_503(client) == refused + 1
        streams.close()  # every client leaves
        _wait_for_record(worker, jobs + places + 1)  # each ends once its client has gone (not at once)
    statuses = [r.status for r in list(worker.records)[jobs:]]
    assert statuses == ["cancelled"] * (places + 1), statuses


def test_wav_from_the_server_reads_with_soundfile(live):
    with httpx.Client(base_url=live.url, timeout=30) as client:
        r = client.post("/v1/audio/speech", json=_body(response_format="wav", max_new_tokens=5, ignore_eos=True))
    audio, rate = sf.read(io.BytesIO(r.content))
    assert rate == 24000 and len(audio) == 4 * 1920


def test_a_client_that_reads_nothing_is_cancelled_not_buffered(engines):
    """A client that sends a request and never reads: the utterance holds at most
    max_buffered_bytes for it, and is cancelled after client_stall_s, as if the client had left."""
    import json
    import socket

    limits = Limits(max_new_tokens=1200, max_buffered_bytes=16_000, client_stall_s=1.0)
    with LiveServer(create_app(engines["0.6B-custom"], ServerConfig("tiny-custom", limits=limits))) as server:
        body = json.dumps(_body(response_format="pcm", ignore_eos=True, max_new_tokens=1200)).encode()
        head = "POST /v1/audio/speech HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        request = head.encode() + f"Content-Length: {len(body)}\r\n\r\n".encode() + body
        with socket.create_connection(("127.0.0.1", server.port)) as client:
            client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # keep the kernel's share small
            client.sendall(request)
            worker = server.app.state.kazeia.worker
            deadline = time.monotonic() + 60
            while not worker.records and time.monotonic() < deadline:
                time.sleep(0.05)
            record = worker.records[0]
        assert record.status == "cancelled" and record.frames < 1199  # stopped long before its end


def test_a_client_that_takes_a_chunk_now_and_then_is_cancelled():
    """Taking one chunk just before each stall deadline must not hold the worker for hours: the
    worker's waits for room are bounded in all by stall_s + the audio generated so far."""
    import asyncio

    from kazeia.server.job import Job

    loop = asyncio.new_event_loop()
    try:
        job = Job(None, None, loop, max_buffered=100, stall_s=0.3)  # no generation: 0 s of audio
        taken = []

        async def trickle():  # one chunk every 0.2 s, each wait shorter than stall_s
            async for item in job.outcomes():
                taken.append(item)
                await asyncio.sleep(0.2)

        async def producer_done() -> None:  # the worker's side ends once cancelled, or after all 20
            while producer.is_alive():
                await asyncio.sleep(0.05)

        producer = threading.Thread(target=lambda: [job.put(b"x" * 100) for _ in range(20)], daemon=True)
        consumer = loop.create_task(trickle())
        producer.start()
        loop.run_until_complete(asyncio.wait_for(producer_done(), 60))
        consumer.cancel()
        loop.run_until_complete(asyncio.gather(consumer, return_exceptions=True))
    finally:
        loop.close()
    assert not producer.is_alive() and job.stalled and job.cancelled
    assert len(taken) < 6  # stopped after ~0.3 s of waiting, not after 20 chunks (4 s)
