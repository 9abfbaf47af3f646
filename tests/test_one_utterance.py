"""One utterance, one byte stream: the same text, voice, options and seed give the same 16-bit PCM
on every path (`synthesize`; `stream` under any chunk schedule; live text under any delta split;
a scheduler beside other streams; HTTP pcm and wav, streamed or whole, and SSE; WebSocket whole and
live; Wyoming one-shot and streamed), at any speed, for short and long texts."""

import asyncio
import base64
import hashlib
import io
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("fastapi")
pytest.importorskip("wyoming")
import httpx
import soundfile
from fastapi.testclient import TestClient
from server_support import (
    LiveServer,
    free_port,
    llm_tokens,
    sse_events,
    streamed_wav_pcm,
    ws_receive,
)
from wyoming.client import AsyncTcpClient
from wyoming.tts import Synthesize, SynthesizeChunk, SynthesizeStart, SynthesizeStop, SynthesizeVoice

from kazeia.audio import pcm16
from kazeia.options import SynthesisOptions
from kazeia.server import Limits, ServerConfig, create_app
from kazeia.server.config import WyomingSettings
from kazeia.server.wyoming import WyomingService

TEXTS = [
    "Hello there.",
    "The first sentence is short. A second one follows it! Does a third one ask something?",
    " ".join(f"Sentence number {i} makes this reply a little longer, and longer." for i in range(9)),  # 2 segments
]
CAP = 24  # talker tokens a segment: segments end at the cap (a random model rarely ends itself)
CONFIG = ServerConfig("tiny-custom", limits=Limits(max_new_tokens=600), max_batch=2)


def md5(pcm: bytes) -> str:
    return hashlib.md5(pcm).hexdigest()


@pytest.fixture(scope="module")
def http(engines):
    with LiveServer(create_app(engines["0.6B-custom"], CONFIG)) as server:
        yield server


def _deltas(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted(c % (len(text) + 1) for c in cuts), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def _engine_paths(engine, text: str, options: dict, schedules, cuts, neighbours) -> dict[str, bytes]:
    got = {}
    for first, rest in schedules:
        with engine.stream(text, first_chunk_frames=first, chunk_frames=rest, **options) as stream:
            got[f"stream {first}/{rest}"] = b"".join(pcm16(c.audio) for c in stream)
    with engine.stream(iter(_deltas(text, cuts)), **options) as stream:
        got["live"] = b"".join(pcm16(c.audio) for c in stream)
    with engine.scheduler(max_batch=3) as scheduler:
        others = [scheduler.stream(TEXTS[k % 2], voice="ryan", seed=k, max_new_tokens=CAP) for k in neighbours]
        threads = [threading.Thread(target=lambda s=s: list(s)) for s in others]
        for thread in threads:
            thread.start()
        with scheduler.stream(text, **options) as stream:
            got["scheduler"] = b"".join(pcm16(c.audio) for c in stream)
        for thread in threads:
            thread.join(120)
    return got


def _http_paths(url: str, text: str, options: dict) -> dict[str, bytes]:
    body = {"input": text, **options}
    got = {}
    with httpx.Client(base_url=url, timeout=120) as http:
        for stream in (True, False):
            got[f"http pcm stream={stream}"] = http.post(
                "/v1/audio/speech", json={**body, "response_format": "pcm", "stream": stream}
            ).content
        wav = http.post("/v1/audio/speech", json={**body, "response_format": "wav"}).content
        got["http wav stream"] = streamed_wav_pcm(wav)
        whole = http.post("/v1/audio/speech", json={**body, "response_format": "wav", "stream": False}).content
        got["http wav whole"] = soundfile.read(io.BytesIO(whole), dtype="int16")[0].tobytes()
        sse = http.post("/v1/audio/speech", json={**body, "response_format": "pcm", "stream_format": "sse"}).text
        events = sse_events(sse)
        assert events[-1]["type"] == "speech.audio.done"
        got["sse"] = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")
    return got


def _websocket_paths(engine, text: str, options: dict, cuts) -> dict[str, bytes]:
    def utterance(ws) -> bytes:
        assert ws_receive(ws)["type"] == "audio.start"
        pcm, segments = b"", 0
        while isinstance(item := ws_receive(ws), bytes) or item["type"] == "audio.segment":
            if isinstance(item, bytes):
                pcm += item
            else:  # a text spoken in several segments marks each end after its audio
                assert item["index"] == segments, item
                segments += 1
        assert item["type"] == "audio.done" and item["status"] == "completed", item
        return pcm

    got = {}
    with TestClient(create_app(engine, CONFIG)) as client, client.websocket_connect("/v1/audio/speech/stream") as ws:
        ws.send_json({"type": "session.update", "session": options})
        assert ws_receive(ws)["type"] == "session.updated"
        ws.send_json({"type": "input_text", "text": text})
        got["websocket"] = utterance(ws)
        for delta in _deltas(text, cuts):
            ws.send_json({"type": "input_text.append", "text": delta})
        ws.send_json({"type": "input_text.end"})
        got["websocket live"] = utterance(ws)
    return got


def _wyoming_paths(engine, text: str, options: dict) -> dict[str, bytes]:
    settings = WyomingSettings(SynthesisOptions(**{k: v for k, v in options.items() if k != "voice"}))
    service = WyomingService(engine, ServerConfig("tiny", limits=Limits(max_new_tokens=600)), settings)
    voice = SynthesizeVoice(name=options["voice"])

    async def read_audio(client, end: str) -> bytes:
        pcm = b""
        while (event := await asyncio.wait_for(client.read_event(), 120)).type != end:
            assert event.type in ("audio-start", "audio-chunk", "audio-stop"), event
            pcm += event.payload or b""
        return pcm

    async def speak() -> dict[str, bytes]:
        port = free_port()
        task = asyncio.create_task(service.run(f"tcp://127.0.0.1:{port}"))
        try:
            for _ in range(600):  # its listening socket is up within a few event-loop turns
                try:
                    _, writer = await asyncio.open_connection("127.0.0.1", port)
                    writer.close()
                    break
                except OSError:
                    await asyncio.sleep(0.05)
            async with AsyncTcpClient("127.0.0.1", port) as client:
                await client.write_event(Synthesize(text=text, voice=voice).event())
                whole = await read_audio(client, "audio-stop")
                await client.write_event(SynthesizeStart(voice=voice).event())
                for token in llm_tokens(text):
                    await client.write_event(SynthesizeChunk(text=token).event())
                await client.write_event(SynthesizeStop().event())
                streamed = await read_audio(client, "synthesize-stopped")
            return {"wyoming": whole, "wyoming streamed": streamed}
        finally:
            task.cancel()

    return asyncio.run(speak())


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    which=st.integers(0, len(TEXTS) - 1),
    voice=st.sampled_from(["serena", "ryan"]),
    seed=st.integers(0, 2**31),
    sampled=st.booleans(),
    speed=st.sampled_from([1.0, 1.5, 0.8]),
    schedules=st.lists(st.tuples(st.integers(1, 5), st.integers(1, 13)), min_size=3, max_size=3),
    cuts=st.lists(st.integers(0, 1000), max_size=30),
    neighbours=st.lists(st.integers(0, 9), max_size=2),
)
def test_every_path_gives_the_same_bytes(
    engines, http, which, voice, seed, sampled, speed, schedules, cuts, neighbours
):
    engine, text = engines["0.6B-custom"], TEXTS[which]
    options = dict(voice=voice, seed=seed, speed=speed, non_streaming_mode=False, max_new_tokens=CAP)
    options.update(do_sample=sampled, subtalker_dosample=sampled)
    expected = pcm16(engine.synthesize(text, **options).audio)
    assert np.frombuffer(expected, "<i2").any()
    got = _engine_paths(engine, text, options, schedules, cuts, neighbours)
    got |= _http_paths(http.url, text, options)
    got |= _websocket_paths(engine, text, options, cuts)
    got |= _wyoming_paths(engine, text, options)
    differ = sorted(path for path, pcm in got.items() if md5(pcm) != md5(expected))
    assert not differ, f"{differ} differ from synthesize's {len(expected)} bytes"
