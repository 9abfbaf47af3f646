"""The Wyoming server (Home Assistant) against the `wyoming` package's own client, on 127.0.0.1.

A real server runs in a thread on its own event loop; the client drives it the way Home Assistant
does: a stream of one `synthesize-chunk` per LLM token, then the whole text in a `synthesize`, then
`synthesize-stop`, reading until `synthesize-stopped`. The audio must start before the last token is
sent (the client holds the rest back until it has) and be the engine's audio of the whole text with
the same seed; bad events are answered with `error` on a connection that goes on serving; a client
that leaves stops its generation within a frame. Tests that need an utterance to be still under way
hold the worker at a gate (`HeldJobs`) rather than count on the machine being slow enough.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

pytest.importorskip("wyoming")
from server_support import FRAME_BYTES, HeldJobs, free_port, llm_tokens, offline_pcm, stop_process, whole_text_pcm
from wyoming.client import AsyncTcpClient
from wyoming.error import Error
from wyoming.event import Event, async_read_event, async_write_event
from wyoming.info import Describe, Info
from wyoming.ping import Ping
from wyoming.tts import Synthesize, SynthesizeChunk, SynthesizeStart, SynthesizeStop, SynthesizeVoice

from kazeia.options import SynthesisOptions
from kazeia.server import Limits, ServerConfig
from kazeia.server.config import WyomingSettings
from kazeia.server.wyoming import WyomingService

REPLY = "Sure! The kitchen lights are on now, and the thermostat is set to twenty one degrees."
OPTIONS = dict(seed=23, ignore_eos=True, max_new_tokens=48)  # a random model rarely ends by itself
LONG_WAIT_S = 120.0  # a text_timeout that no test waits out (but the one that tests it)
# A connection's idle limit where a test checks it: long beside the moment between connecting and
# sending a first event, short enough to wait out.
IDLE_S = 1.0
FIRST_TOKENS = 4  # of the reply, sent before the speech starts: "Sure! The kitchen", three stable tokens
CODES = ["zh", "en", "fr", "de", "it", "ja", "ko", "pt", "ru", "es"]  # chinese ... spanish, by Kazeia's names


class LiveWyoming:
    """`service` serving tcp://127.0.0.1:PORT from a thread with its own event loop."""

    def __init__(self, service: WyomingService):
        self.service, self.port = service, free_port()
        self.loop = asyncio.new_event_loop()
        self.task: asyncio.Task | None = None
        self.thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.task = self.loop.create_task(self.service.run(f"tcp://127.0.0.1:{self.port}"))
        try:
            self.loop.run_until_complete(self.task)
        except asyncio.CancelledError:
            pass

    def __enter__(self) -> LiveWyoming:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not _accepts(self.port):
            assert time.monotonic() < deadline and self.thread.is_alive(), "the Wyoming server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.loop.call_soon_threadsafe(self.task.cancel)
        self.thread.join(30)
        assert not self.thread.is_alive(), "the Wyoming server did not stop"

    def client(self) -> AsyncTcpClient:
        return AsyncTcpClient("127.0.0.1", self.port)


def _accepts(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def serve(engine, settings: dict | None = None, **config) -> LiveWyoming:
    """A Wyoming server of `engine`; `settings`: every utterance's options (SynthesisOptions fields,
    the sampling ones under "sampling") and "idle_s"."""
    limits = config.pop("limits", Limits(max_input_chars=200, max_new_tokens=600))
    settings = dict(settings or dict(seed=OPTIONS["seed"], sampling=dict(ignore_eos=True, max_new_tokens=48)))
    idle = {"idle_s": settings.pop("idle_s")} if "idle_s" in settings else {}
    options = SynthesisOptions(**settings.pop("sampling", {}), **settings)
    config = ServerConfig("tiny", limits=limits, **config)
    return LiveWyoming(WyomingService(engine, config, WyomingSettings(options, **idle)))


@pytest.fixture(scope="module")
def live(engines):
    with serve(engines["0.6B-custom"], text_timeout=LONG_WAIT_S) as live:
        yield live


@pytest.fixture(scope="module")
def long_live(engines):
    """Utterances of 599 frames, more than a stream generates ahead of its reader: held after their
    first audio (`HeldJobs`), they are still being generated when the test looks."""
    with serve(engines["0.6B-custom"], dict(seed=23, sampling=dict(ignore_eos=True, max_new_tokens=600))) as live:
        yield live


async def read_until(client, *ends: str) -> list[Event]:
    """Events up to and including the first whose type is in `ends`."""
    events = []
    while not events or events[-1].type not in ends:
        event = await asyncio.wait_for(client.read_event(), 30)
        assert event is not None, f"the connection closed after {[e.type for e in events]}"
        events.append(event)
    return events


def audio_of(events: list[Event]) -> bytes:
    """The PCM of an utterance's events, checking its one format: 24 kHz, 16-bit, mono."""
    starts = [e for e in events if e.type == "audio-start"]
    assert len(starts) == 1, [e.type for e in events]
    chunks = [e for e in events if e.type == "audio-chunk"]
    for event in (*starts, *chunks):
        assert (event.data["rate"], event.data["width"], event.data["channels"]) == (24000, 2, 1)
    return b"".join(e.payload for e in chunks)


def test_home_assistant_stream_is_spoken_while_the_reply_is_written(live, engines):
    tokens = llm_tokens(REPLY)
    assert len(tokens) >= 15 and "".join(tokens) == REPLY
    voice = SynthesizeVoice(name="serena")  # Home Assistant sends a name and no language

    async def home_assistant() -> tuple[list[Event], bool]:
        async with live.client() as client:
            heard = asyncio.Event()  # the first audio has come

            async def write_text() -> bool:
                await client.write_event(SynthesizeStart(voice=voice).event())
                for token in tokens[:FIRST_TOKENS]:
                    await client.write_event(SynthesizeChunk(text=token).event())
                try:  # speech must start before the rest of the reply is written
                    await asyncio.wait_for(heard.wait(), 60)
                except asyncio.TimeoutError:
                    return False
                for token in tokens[FIRST_TOKENS:]:
                    await client.write_event(SynthesizeChunk(text=token).event())
                    await asyncio.sleep(0.01)  # the pace of a fast LLM
                await client.write_event(Synthesize(text=REPLY, voice=voice).event())  # ignored in a stream
                await client.write_event(SynthesizeStop().event())
                return True

            writer = asyncio.create_task(write_text())
            events = []
            while not events or events[-1].type != "synthesize-stopped":
                events += await read_until(client, "audio-chunk", "synthesize-stopped")
                if events[-1].type == "audio-chunk":
                    heard.set()
            return events, await writer

    events, early = asyncio.run(home_assistant())
    assert early, "speech started only after the last text chunk"
    kinds = [e.type for e in events]
    assert kinds[0] == "audio-start" and kinds[-2:] == ["audio-stop", "synthesize-stopped"], kinds
    assert set(kinds[1:-2]) == {"audio-chunk"}
    pcm = audio_of(events)
    assert len(pcm) == 47 * FRAME_BYTES
    assert pcm == whole_text_pcm(engines["0.6B-custom"], REPLY, voice="serena", **OPTIONS)


def test_one_shot_synthesize_streams_audio_while_it_is_generated(long_live, engines):
    live, worker = long_live, long_live.service.worker

    async def speak(gate: HeldJobs) -> tuple[list[Event], int]:
        async with live.client() as client:
            # SynthesizeVoice sends a language only without a name; the protocol carries both.
            voice = {"name": "Ryan", "language": "en-US"}
            await client.write_event(Event("synthesize", {"text": "Good morning.", "voice": voice}))
            events = await read_until(client, "audio-chunk")  # comes while the rest is held
            generating = worker.active  # the first chunk is out: the utterance is still being generated
            gate.release()
            return events + await read_until(client, "audio-stop"), generating

    with HeldJobs() as gate:
        events, generating = asyncio.run(speak(gate))
    assert generating == 1
    chunks = [len(e.payload) for e in events if e.type == "audio-chunk"]
    assert chunks[:9] == [n * FRAME_BYTES for n in (1, 2, 2, 2, 3, 3, 3, 4, 4)]  # the schedule: 1, then up to 4
    long = dict(OPTIONS, max_new_tokens=600)
    expected = whole_text_pcm(engines["0.6B-custom"], "Good morning.", voice="ryan", language="english", **long)
    assert audio_of(events) == expected and len(expected) == 599 * FRAME_BYTES  # the streaming layout


def test_describe_lists_the_voices_and_languages(live, engines):
    async def describe() -> Info:
        async with live.client() as client:
            await client.write_event(Describe().event())
            return Info.from_event((await read_until(client, "info"))[-1])

    (program,) = asyncio.run(describe()).tts
    assert program.name == "kazeia" and program.installed and program.supports_synthesize_streaming
    assert program.attribution.url == "https://github.com/QwenLM/Qwen3-TTS"
    names = ["aiden", "dylan", "eric", "ono_anna", "ryan", "serena", "sohee", "uncle_fu", "vivian"]
    assert [v.name for v in program.voices] == names == engines["0.6B-custom"].voices
    assert {v.description for v in program.voices} >= {"Uncle Fu", "Ono Anna"}
    assert all(v.languages == CODES and v.installed for v in program.voices)


def test_saved_voices_of_a_base_checkpoint_are_listed_and_spoken(engines, tmp_path):
    engine = engines["0.6B-base"]
    rng = np.random.default_rng(5)
    engine.create_voice((rng.standard_normal(24000 * 2).astype(np.float32) * 0.1, 24000), x_vector_only=True).save(
        tmp_path / "nora.voice"
    )

    async def session(live) -> tuple[Info, list[Event]]:
        async with live.client() as client:
            await client.write_event(Describe().event())
            info = Info.from_event((await read_until(client, "info"))[-1])
            await client.write_event(Synthesize(text="Welcome home.").event())  # no voice: the first saved
            return info, await read_until(client, "audio-stop", "error")

    settings = dict(seed=3, language="fr", sampling=dict(ignore_eos=True, max_new_tokens=8))
    with serve(engine, settings, voices_dir=tmp_path) as live:
        info, events = asyncio.run(session(live))
    assert [(v.name, v.languages) for v in info.tts[0].voices] == [("nora", CODES)]
    options = dict(language="french", seed=3, ignore_eos=True, max_new_tokens=8)
    expected = offline_pcm(engine, "Welcome home.", voice=str(tmp_path / "nora.voice"), **options)
    pcm = audio_of(events)
    assert len(pcm) == 7 * FRAME_BYTES
    assert np.max(np.abs(np.frombuffer(pcm, "<i2").astype(int) - np.frombuffer(expected, "<i2"))) <= 1


async def send_raw(writer: asyncio.StreamWriter, data: bytes) -> None:
    writer.write(data)
    await writer.drain()


async def expect_error(reader: asyncio.StreamReader, code: str, *words: str) -> None:
    event = await asyncio.wait_for(async_read_event(reader), 10)
    assert event is not None and Error.is_type(event.type), event
    error = Error.from_event(event)
    assert error.code == code and all(w in error.text for w in words), error


def test_every_bad_event_is_answered_with_error_and_the_connection_goes_on(live):
    limit = live.service.config.limits.max_body_bytes

    async def hostile() -> list[Event]:
        reader, writer = await asyncio.open_connection("127.0.0.1", live.port)
        send = lambda event: async_write_event(event, writer)  # noqa: E731
        await send(Synthesize(text="Hi.", voice=SynthesizeVoice(name="nobody")).event())
        await expect_error(reader, "invalid_value", "unknown voice 'nobody'", "serena")
        await send(Synthesize(text="Hi.", voice=SynthesizeVoice(language="xx")).event())
        await expect_error(reader, "invalid_value", "unknown language 'xx'", "en (english)")
        await send(Synthesize(text="x" * 201).event())
        await expect_error(reader, "string_above_max_length", "text is 201 characters", "at most 200")
        await send(Synthesize(text="   ").event())
        await expect_error(reader, "invalid_value", "text is empty")
        await send(Event("synthesize", {"text": 42}))
        await expect_error(reader, "missing_parameter", "a string")
        await send(Event("synthesize", {"text": "Hi.", "text_format": "ssml"}))
        await expect_error(reader, "invalid_value", "'ssml' is not supported")
        await send(SynthesizeChunk(text="no stream").event())
        await expect_error(reader, "no_open_stream", "synthesize-chunk without synthesize-start")
        await send(SynthesizeStop().event())
        await expect_error(reader, "no_open_stream", "synthesize-stop without synthesize-start")
        await send(Event("transcribe", {}))
        await expect_error(reader, "unknown_event", "'transcribe'")
        await send_raw(writer, b"{not json\n")
        await expect_error(reader, "invalid_json", "event header")
        await send_raw(writer, b'["a list"]\n')
        await expect_error(reader, "invalid_json", "must be a JSON object")
        await send_raw(writer, json.dumps({"type": "synthesize", "data_length": -1}).encode() + b"\n")
        await expect_error(reader, "invalid_event", "data_length")
        big = limit + 1  # declared and sent: read past without being kept
        await send_raw(writer, json.dumps({"type": "synthesize", "payload_length": big}).encode() + b"\n" + bytes(big))
        await expect_error(reader, "event_too_large", f"the limit is {limit}")
        await send_raw(writer, b'{"type": "synthesize", "data": {"text": "' + b"y" * 100_000 + b'"}}\n')
        await expect_error(reader, "event_too_large", "header line is too long")
        # Out of order in a stream: a second start, then an empty stream and one over the limit.
        await send(SynthesizeStart().event())
        await send(SynthesizeStart().event())
        await expect_error(reader, "out_of_order", "a stream is open")
        await send(Synthesize(text="ignored inside a stream").event())
        await send(SynthesizeChunk(text="  ").event())
        await send(SynthesizeStop().event())
        await expect_error(reader, "invalid_value", "text is empty")
        assert (await async_read_event(reader)).type == "synthesize-stopped"
        await send(SynthesizeStart().event())
        await send(SynthesizeChunk(text="a" * 150).event())
        assert (await async_read_event(reader)).type == "audio-start"
        await send(SynthesizeChunk(text="b" * 51).event())  # 201 characters in all
        await send(SynthesizeChunk(text="dropped").event())
        await send(SynthesizeStop().event())
        events = []
        while not events or events[-1].type != "synthesize-stopped":
            events.append(await asyncio.wait_for(async_read_event(reader), 30))
        errors = [Error.from_event(e) for e in events if e.type == "error"]
        assert len(errors) == 1 and errors[0].code == "string_above_max_length", events
        assert "this stream would be 201 characters" in errors[0].text
        assert [e.type for e in events if e.type != "audio-chunk"][-2:] == ["audio-stop", "synthesize-stopped"]
        # Still serving: a ping, then a whole text.
        await send(Ping(text="still there?").event())
        pong = await async_read_event(reader)
        assert (pong.type, pong.data["text"]) == ("pong", "still there?")
        await send(Synthesize(text="All good.", voice=SynthesizeVoice(name="vivian")).event())
        events = []
        while not events or events[-1].type not in ("audio-stop", "error"):
            events.append(await asyncio.wait_for(async_read_event(reader), 30))
        writer.close()
        return events

    events = asyncio.run(hostile())
    assert len(audio_of(events)) == 47 * FRAME_BYTES
    assert live.service.connections == 0 or _settles(lambda: live.service.connections == 0)


def _settles(condition, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_a_synthesize_while_speaking_is_refused(live):
    async def twice(gate: HeldJobs) -> list[Event]:
        async with live.client() as client:
            await client.write_event(Synthesize(text="One.").event())
            await client.write_event(Synthesize(text="Two.").event())
            refused = await read_until(client, "error")  # "One." is held: still speaking
            gate.release()
            return refused + await read_until(client, "audio-stop")

    with HeldJobs() as gate:
        events = asyncio.run(twice(gate))
    errors = [Error.from_event(e) for e in events if e.type == "error"]
    assert [e.code for e in errors] == ["out_of_order"] and "still speaking" in errors[0].text
    assert len(audio_of(events)) == 47 * FRAME_BYTES


def _record(worker, count: int):
    assert _settles(lambda: len(worker.records) >= count), "the job did not end"
    return worker.records[count - 1]


@pytest.mark.parametrize("streamed", [False, True], ids=["synthesize", "stream"])
def test_a_client_that_leaves_stops_its_generation_within_a_frame(long_live, streamed):
    live, worker, service = long_live, long_live.service.worker, long_live.service
    jobs = len(worker.records)

    async def leave() -> None:
        async with live.client() as client:
            if streamed:
                await client.write_event(SynthesizeStart().event())
                await client.write_event(SynthesizeChunk(text="Tell me a long story about ").event())
            else:
                await client.write_event(Synthesize(text="Tell me a long story.").event())
            await read_until(client, "audio-chunk")

    with HeldJobs():  # the utterance cannot end before its client leaves
        asyncio.run(leave())
        record = _record(worker, jobs + 1)
    assert record.status == "cancelled" and record.frames < 599
    assert record.frames - record.frames_at_cancel <= 1
    assert _settles(lambda: worker.active == 0 and service.connections == 0)


def test_blank_chunks_never_hold_the_worker(engines):
    """Blank chunks take no worker; a stream that stops advancing fails at text_timeout (0.6 s),
    however long blank chunks keep coming."""

    async def stall(live) -> tuple[list[Event], float]:
        worker = live.service.worker
        async with live.client() as client:
            await client.write_event(SynthesizeStart().event())
            for _ in range(5):
                await client.write_event(SynthesizeChunk(text=" ").event())
            await client.write_event(Ping(text="after the blanks").event())
            assert (await read_until(client, "pong"))[-1].data["text"] == "after the blanks"  # all handled
            assert worker.active == 0 and not worker.records  # nothing queued for blank text
            started = time.perf_counter()
            await client.write_event(SynthesizeChunk(text="Hello").event())
            timed_out = asyncio.Event()

            async def blanks() -> None:
                while not timed_out.is_set():  # blank chunks until the timeout: they do not keep it alive
                    await client.write_event(SynthesizeChunk(text=" ").event())
                    await asyncio.sleep(0.1)
                await client.write_event(SynthesizeStop().event())

            keep_alive = asyncio.create_task(blanks())
            events = await read_until(client, "error")
            waited = time.perf_counter() - started
            timed_out.set()
            events += await read_until(client, "synthesize-stopped")
            await keep_alive
            return events, waited

    with serve(engines["0.6B-custom"], text_timeout=0.6) as live:
        events, waited = asyncio.run(stall(live))
        record = _record(live.service.worker, 1)
    error = Error.from_event(next(e for e in events if e.type == "error"))
    assert error.code == "text_timeout" and "0.6 s" in error.text and waited >= 0.6
    assert [e.type for e in events if e.type != "audio-chunk"][-2:] == ["audio-stop", "synthesize-stopped"]
    assert record.status == "failed"


@pytest.mark.parametrize("max_batch", [1, ServerConfig("m").max_batch])
def test_the_queue_is_bounded(engines, max_batch):
    """queue_size 1: max_batch utterances generating (each held after its first audio) and one
    waiting; the next connection is refused."""

    async def crowd(live) -> Error:
        clients = [live.client() for _ in range(max_batch + 2)]
        for client in clients:
            await client.connect()
        try:
            for client in clients[:max_batch]:
                await client.write_event(Synthesize(text="Wait for it.").event())
                await read_until(client, "audio-chunk")  # a serving thread has it, and is held there
            await clients[max_batch].write_event(Synthesize(text="Wait for me.").event())
            await read_until(clients[max_batch], "audio-start")  # queued: no serving thread is free
            assert live.service.worker.queue_depth == 1
            await clients[-1].write_event(Synthesize(text="And me?").event())
            return Error.from_event((await read_until(clients[-1], "error"))[-1])
        finally:
            for client in clients:
                await client.disconnect()

    settings = dict(seed=1, sampling=dict(ignore_eos=True, max_new_tokens=600))
    with HeldJobs(), serve(engines["0.6B-custom"], settings, queue_size=1, max_batch=max_batch) as live:
        error = asyncio.run(crowd(live))
    assert error.code == "queue_full" and "busy" in error.text


def test_one_stream_too_many_for_the_measured_pace_is_refused(engines):
    """The admission of `kazeia serve` holds here too: with the server's streams measured at a third
    of real time alone, a second utterance while one speaks is refused (at_capacity)."""

    async def second(live) -> Error:
        first, other = live.client(), live.client()
        await first.connect()
        await other.connect()
        try:
            await first.write_event(Synthesize(text="Wait for it.").event())
            await read_until(first, "audio-chunk")  # speaking, held at the gate
            # a third of real time, with evidence enough to outlast any slow step of this test (minutes)
            live.service.worker.capacity.observe(1, 100.0, 300.0, time.perf_counter())
            await other.write_event(Synthesize(text="And me?").event())
            return Error.from_event((await read_until(other, "error"))[-1])
        finally:
            await first.disconnect()
            await other.disconnect()

    settings = dict(seed=1, sampling=dict(ignore_eos=True, max_new_tokens=600))
    with HeldJobs(), serve(engines["0.6B-custom"], settings, max_batch=2) as live:
        error = asyncio.run(second(live))
    assert error.code == "at_capacity" and "fall behind real time" in error.text


@pytest.mark.parametrize("warm", [True, False])
def test_the_wyoming_server_warms_its_engine_up_before_it_listens(tiny_checkpoints, warm):
    """kazeia/warmup.py: every preset speaker's prompt positions are cached before the first
    connection is accepted (`--no-warm-up`: none)."""
    from kazeia import Engine

    engine = Engine.load(tiny_checkpoints["0.6B-custom"])
    with serve(engine, warm_up=warm):
        assert len(engine.runtime.step.voiced) == (len(engine.voices) if warm else 0)


def test_kazeia_wyoming_command(tiny_checkpoints, engines, tmp_path):
    port = free_port()
    command = [sys.executable, "-m", "kazeia", "wyoming", "--model", str(tiny_checkpoints["0.6B-custom"])]
    command += ["--uri", f"tcp://127.0.0.1:{port}", "--voice", "sohee", "--language", "ko", "--seed", "9"]
    command += ["--ignore-eos", "--max-new-tokens", "12", "--log-level", "warning"]
    log = tmp_path / "wyoming.log"
    process = subprocess.Popen(command, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not _accepts(port):
            assert process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)

        async def speak() -> list[Event]:
            async with AsyncTcpClient("127.0.0.1", port) as client:
                await client.write_event(Synthesize(text="Annyeong.").event())
                return await read_until(client, "audio-stop", "error")

        events = asyncio.run(speak())
    finally:
        stop_process(process)
    options = dict(voice="sohee", language="korean", seed=9, ignore_eos=True, max_new_tokens=12)
    expected = whole_text_pcm(engines["0.6B-custom"], "Annyeong.", **options)
    pcm = audio_of(events)
    assert len(pcm) == 11 * FRAME_BYTES and pcm == expected


def test_kazeia_wyoming_refuses_bad_settings_before_serving(tiny_checkpoints):
    model = str(tiny_checkpoints["0.6B-custom"])
    for flags, words in (
        (["--voice", "nobody"], "unknown voice 'nobody'"),
        (["--language", "klingon"], "unknown language 'klingon'"),
        (["--uri", "stdio://"], "use tcp://HOST:PORT or unix://PATH"),
        *[(["--zeroconf"], "needs the zeroconf package")] * (importlib.util.find_spec("zeroconf") is None),
    ):
        run = subprocess.run(
            [sys.executable, "-m", "kazeia", "wyoming", "--model", model, *flags], capture_output=True, timeout=120
        )
        assert run.returncode == 2 and words in run.stderr.decode(), (flags, run.stderr.decode())


def test_a_voice_design_checkpoint_speaks_the_voice_its_instruct_describes(engines):
    engine = engines["1.7B-design"]
    with pytest.raises(ValueError, match="VoiceDesign checkpoints need instruct"):
        WyomingService(engine, ServerConfig("tiny-design"), WyomingSettings())
    description = "A warm, slow voice."
    settings = dict(instruct=description, seed=4, sampling=dict(ignore_eos=True, max_new_tokens=6))

    async def session(live) -> tuple[Info, list[Event], list[Event]]:
        async with live.client() as client:
            await client.write_event(Describe().event())
            info = Info.from_event((await read_until(client, "info"))[-1])
            await client.write_event(Synthesize(text="Hello.", voice=SynthesizeVoice(name="designed")).event())
            spoken = await read_until(client, "audio-stop", "error")
            await client.write_event(Synthesize(text="Hello.", voice=SynthesizeVoice(name="serena")).event())
            return info, spoken, await read_until(client, "error")

    with serve(engine, settings) as live:
        info, spoken, refused = asyncio.run(session(live))
    (voice,) = info.tts[0].voices
    assert (voice.name, voice.description, voice.languages) == ("designed", f"Designed: {description}", CODES)
    expected = whole_text_pcm(engine, "Hello.", instruct=description, seed=4, ignore_eos=True, max_new_tokens=6)
    pcm = audio_of(spoken)
    assert len(pcm) == 5 * FRAME_BYTES and pcm == expected
    assert "unknown voice 'serena'" in Error.from_event(refused[-1]).text


def test_idle_and_surplus_connections_are_closed_with_an_error(engines):
    """max_connections 1: a second connection is refused while the first speaks (held after its
    first audio: a connection that generates is never idle); the first, silent once its utterance
    is out, is closed after idle_s."""

    async def connections(live, gate: HeldJobs) -> tuple[Error, Event | None, Error, Event | None]:
        async with live.client() as first:
            await first.write_event(Synthesize(text="Hold on.").event())
            await read_until(first, "audio-chunk")
            async with live.client() as second:
                surplus = Error.from_event((await read_until(second, "error"))[-1])
                after_surplus = await asyncio.wait_for(second.read_event(), 10)
            started = time.perf_counter()  # before its utterance can end: the idle time runs after
            gate.release()
            await read_until(first, "audio-stop")
            idle = Error.from_event((await read_until(first, "error"))[-1])
            assert time.perf_counter() - started >= IDLE_S
            return surplus, after_surplus, idle, await asyncio.wait_for(first.read_event(), 10)

    settings = dict(seed=1, idle_s=IDLE_S, sampling=dict(max_new_tokens=4))
    with HeldJobs() as gate, serve(engines["0.6B-custom"], settings, max_connections=1) as live:
        surplus, after_surplus, idle, after_idle = asyncio.run(connections(live, gate))
    assert surplus.code == "too_many_connections" and "at most 1 connections" in surplus.text
    assert idle.code == "idle_timeout" and f"{IDLE_S:g} s" in idle.text
    assert after_surplus is None and after_idle is None  # both closed by the server


def test_a_long_text_is_spoken_whole_in_segments(engines):
    """A text over the segment budget is spoken as one utterance of several segments: every
    segment's audio, then audio-stop (the segments themselves have no Wyoming event)."""
    engine = engines["0.6B-custom"]
    text = " ".join(f"Sentence number {i} makes this reply a little longer." for i in range(16))
    request = engine.request(text, voice="ryan", **OPTIONS)
    assert len(request.parts) >= 2  # more than one segment
    with serve(engine, limits=Limits(max_input_chars=2000, max_new_tokens=600)) as live:

        async def speak() -> list[Event]:
            async with live.client() as client:
                await client.write_event(Event("synthesize", {"text": text, "voice": {"name": "Ryan"}}))
                return await read_until(client, "audio-stop", "error")

        events = asyncio.run(speak())
    assert events[-1].type == "audio-stop"
    assert audio_of(events) == whole_text_pcm(engine, text, voice="ryan", **OPTIONS)


def test_a_long_reply_streamed_is_the_same_utterance_as_sent_whole(engines):
    """Home Assistant streams an LLM's reply, or sends it whole: the same audio either way, for a
    reply of several segments, each ending at the token cap (a random model rarely ends itself)."""
    engine = engines["0.6B-custom"]
    text = " ".join(f"Sentence number {i} makes this reply a little longer." for i in range(12))
    capped = dict(seed=7, sampling=dict(max_new_tokens=100))
    assert len(engine.request(text, voice="ryan", seed=7, max_new_tokens=100).parts) >= 2
    with serve(engine, capped, limits=Limits(max_input_chars=2000, max_new_tokens=600)) as live:

        async def speak(streamed: bool) -> list[Event]:
            async with live.client() as client:
                voice = SynthesizeVoice(name="ryan")
                if not streamed:
                    await client.write_event(Synthesize(text=text, voice=voice).event())
                    return await read_until(client, "audio-stop", "error")
                await client.write_event(SynthesizeStart(voice=voice).event())
                for token in llm_tokens(text):
                    await client.write_event(SynthesizeChunk(text=token).event())
                await client.write_event(Synthesize(text=text, voice=voice).event())  # ignored in a stream
                await client.write_event(SynthesizeStop().event())
                return await read_until(client, "synthesize-stopped", "error")

        whole, streamed = asyncio.run(speak(False)), asyncio.run(speak(True))
    assert whole[-1].type == "audio-stop" and streamed[-1].type == "synthesize-stopped"
    assert audio_of(streamed) == audio_of(whole) == whole_text_pcm(engine, text, voice="ryan", seed=7,
                                                                   max_new_tokens=100)  # fmt: skip
