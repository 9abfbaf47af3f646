"""Wyoming, the protocol Home Assistant speaks to local speech engines (the `wyoming` extra).

One TCP connection carries events: a JSON header line, then optional JSON data and a binary
payload (wyoming.event). This server answers

* `describe` with `info`: one `TtsProgram` that supports synthesize streaming, its voices (preset
  speakers, saved clone voices, or the described voice of a VoiceDesign checkpoint) and languages;
* `synthesize` (one whole text) with `audio-start` (24 kHz, 16-bit, mono), an `audio-chunk` per
  streamed chunk as the frames are generated, and `audio-stop`;
* a stream, `synthesize-start`, `synthesize-chunk`..., `synthesize-stop`, with one live utterance:
  each chunk is appended to its text while it is being spoken (kazeia.live), so the first audio
  comes after the first words; the `synthesize` that Home Assistant sends inside a stream for older
  servers is ignored; after `audio-stop` comes `synthesize-stopped`;
* `ping` with `pong`.

Utterances go to the same `Worker` as the HTTP server's (one engine thread, a bounded queue, cancel
within a frame), one at a time per connection. A refused event (malformed, over a limit, unknown
voice, out of order, queue full) is answered with one `error` event and the connection goes on; a
stream that fails still ends with `synthesize-stopped` once its `synthesize-stop` arrives, since
that is what Home Assistant reads up to. A client that leaves cancels its utterance. Non-goals:
speech recognition, wake words, the `stdio://` transport.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import anyio
from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.error import Error
from wyoming.event import Event, async_write_event
from wyoming.info import Describe
from wyoming.ping import Ping, Pong
from wyoming.server import AsyncEventHandler, AsyncServer
from wyoming.tts import Synthesize, SynthesizeChunk, SynthesizeStart, SynthesizeStop, SynthesizeStopped

from ..audio import SAMPLE_RATE
from ..engine import Engine
from ..live import TextFeed
from ..options import SynthesisOptions
from ..request import Request
from ..warmup import warm_up
from .bodies import check_length
from .config import ServerConfig
from .errors import ApiError, from_engine
from .formats import AudioEncoder
from .job import Busy, Job, Outcome
from .params import prepare
from .state import build_state
from .wire import clean
from .wyoming_info import Catalog, WyomingSettings, announce, read_event

log = logging.getLogger("kazeia.wyoming")
WIDTH, CHANNELS = 2, 1  # bytes per sample, channels: the one audio format of every utterance


@dataclass(eq=False)
class _Utterance:
    request: Request
    feed: TextFeed | None = None  # a stream: where its synthesize-chunk text goes (None: one whole text)
    arrived: float = field(default_factory=time.perf_counter)  # streams: reset at the first words
    chars: int = 0  # a stream: characters received so far
    job: Job | None = None  # once submitted to the worker (a stream: at its first words)
    stopped: bool = False  # a stream: synthesize-stop has arrived
    failed: bool = False  # an error has been sent for it: its remaining audio and text are dropped
    audio_done: bool = False  # audio-stop has been sent


class WyomingService:
    """One engine behind the Wyoming protocol: its worker, its voices, and the connections' count."""

    def __init__(self, engine: Engine, config: ServerConfig, settings: WyomingSettings | None = None):
        self.state = build_state(engine, config)
        self.engine, self.config, self.worker = engine, config, self.state.worker
        self.settings = settings or WyomingSettings()
        self.catalog = Catalog(engine, config, self.settings, self.state.voices)
        self.connections = 0

    def handler(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> Connection:
        return Connection(reader, writer, self)

    async def run(self, uri: str, zeroconf: str | None = None) -> None:
        """Serve `uri` (tcp://HOST:PORT or unix://PATH) until cancelled; `zeroconf`: announce the TCP
        service on the LAN under this name ("" for the machine's), which needs the zeroconf package."""
        server = AsyncServer.from_uri(check_uri(uri))
        if self.config.warm_up:  # before the first request is taken (kazeia/warmup.py)
            await asyncio.to_thread(warm_up, self.engine, SynthesisOptions(**self.catalog.defaults))
        self.worker.start()
        try:
            if zeroconf is not None:
                await announce(uri, zeroconf)
            log.info("Wyoming server on %s (%s)", uri, self.config.model_name)
            await server.run(self.handler)
        finally:
            await server.stop()
            await asyncio.to_thread(self.worker.stop)


class Connection(AsyncEventHandler):
    """One client: its events in order, at most one utterance at a time."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, service: WyomingService):
        super().__init__(reader, writer)
        self.service, self.config, self.catalog = service, service.config, service.catalog
        self.utterance: _Utterance | None = None  # accepted and not finished (its last event not sent)
        self._relay: asyncio.Task | None = None
        self._send_lock = asyncio.Lock()
        self._idle: anyio.CancelScope | None = None  # the read under way, cancelled once idle too long
        self._handlers = (
            (Describe, self._describe),
            (Synthesize, self._synthesize),
            (SynthesizeStart, self._synthesize_start),
            (SynthesizeChunk, self._synthesize_chunk),
            (SynthesizeStop, self._synthesize_stop),
            (Ping, self._ping),
        )

    # -- the connection ------------------------------------------------------------------------
    async def run(self) -> None:
        """Read events until the client leaves or stays idle too long (the base class's loop,
        with every event bounded in size and a refusal that leaves the connection open)."""
        service, settings = self.service, self.service.settings
        if service.connections >= self.config.max_connections:
            message = f"this server takes at most {self.config.max_connections} connections at once; try again later"
            await self._close_with(Error(message, "too_many_connections"))
            return
        service.connections += 1
        try:
            while True:
                event: Event | ApiError | None = None
                with anyio.CancelScope() as scope:
                    self._idle = scope
                    self._rearm()
                    try:
                        limits = self.config.limits
                        event = await read_event(self.reader, limits.max_body_bytes, limits.max_field_chars)
                    except ApiError as error:
                        event = error
                    except asyncio.IncompleteReadError:  # the client left halfway through an event
                        event = None
                self._idle = None
                if scope.cancel_called:
                    await self._close_with(Error(f"idle for {settings.idle_s:g} s; closing", "idle_timeout"))
                    break
                if event is None:
                    break
                if isinstance(event, ApiError):
                    await self._error(event)
                else:
                    await self.handle_event(event)
        except (ConnectionError, TimeoutError):  # the client is gone, or stopped reading its audio
            pass
        finally:
            service.connections -= 1
            await self.disconnect()
            self._release()

    async def handle_event(self, event: Event) -> bool:
        try:
            for kind, handle in self._handlers:
                if kind.is_type(event.type):
                    await handle(event.data)
                    return True
            raise ApiError(400, f"unknown event type {event.type!r}; {_TAKES}", code="unknown_event")
        except ApiError as error:
            await self._error(error)
        except (ConnectionError, TimeoutError):
            raise
        except Exception:  # a bug must not drop the connection: the client hears of it, the log has it
            log.exception("a Wyoming %r event could not be handled", event.type)
            failure = ApiError(500, "the event could not be handled (see the server log)", code="internal_error")
            await self._error(failure)
        return True

    async def disconnect(self) -> None:
        """The client left (or the connection is closing): its utterance stops before its next frame."""
        utterance = self.utterance
        if utterance is not None and utterance.job is not None:
            utterance.job.cancel()
        if self._relay is not None:
            self._relay.cancel()
            await asyncio.gather(self._relay, return_exceptions=True)

    async def _send(self, event: Event) -> None:
        """Write one event; a client that takes none of it for client_stall_s is treated as gone:
        its connection is dropped at once (TimeoutError), unsent bytes and all."""
        event = Event(event.type, clean(event.data), event.payload)  # client text escaped (wire.py)
        async with self._send_lock:
            try:
                with anyio.fail_after(self.config.limits.client_stall_s):
                    await async_write_event(event, self.writer)
            except TimeoutError:
                self.writer.transport.abort()  # close() would wait for the client to read them
                raise

    def _release(self) -> None:
        """Close the connection once what was written is sent, within client_stall_s: a client that
        stops reading cannot hold its socket (and the bytes written for it) any longer."""
        self.writer.close()
        loop = asyncio.get_running_loop()
        loop.call_later(self.config.limits.client_stall_s, self.writer.transport.abort)

    async def _error(self, error: ApiError) -> None:
        await self._send(Error(_wyoming_text(error.message), error.code).event())

    async def _close_with(self, error: Error) -> None:
        try:
            await self._send(error.event())
        except (ConnectionError, TimeoutError):
            pass
        self._release()

    def _rearm(self) -> None:
        """Restart the idle clock of the read under way: none while an utterance is generating."""
        if self._idle is not None:
            generating = self.utterance is not None and self.utterance.job is not None and not self.utterance.audio_done
            self._idle.deadline = float("inf") if generating else anyio.current_time() + self.service.settings.idle_s

    # -- events --------------------------------------------------------------------------------
    async def _describe(self, data: dict) -> None:
        info = await asyncio.to_thread(self.catalog.info)  # reads the saved voices' files
        await self._send(info.event())

    async def _ping(self, data: dict) -> None:
        await self._send(Pong(text=data.get("text") if isinstance(data.get("text"), str) else None).event())

    async def _synthesize(self, data: dict) -> None:
        current = self.utterance
        if current is not None and current.feed is not None and not current.stopped:
            return  # the whole text of the stream under way, sent for servers without streaming
        self._refuse_if_busy("synthesize")
        text = data.get("text")
        if not isinstance(text, str):
            raise ApiError(400, "synthesize needs text, a string", param="text", code="missing_parameter")
        check_length("text", len(text), self.config.limits.max_input_chars)
        request = await self._prepare(text, data)
        utterance = _Utterance(request)
        self.utterance = utterance  # from now on a client that leaves cancels it (disconnect)
        try:
            await self._begin(utterance)
        except ApiError:
            self.utterance = None
            raise

    async def _synthesize_start(self, data: dict) -> None:
        self._refuse_if_busy("synthesize-start")
        feed = TextFeed()
        request = await self._prepare(feed, data)
        self.utterance = _Utterance(request, feed)

    async def _synthesize_chunk(self, data: dict) -> None:
        utterance = self._open_stream("synthesize-chunk")
        if utterance.failed:
            return  # its error is out: the rest of its text is dropped
        text = data.get("text")
        if not isinstance(text, str):
            raise ApiError(400, "synthesize-chunk needs text, a string", param="text", code="missing_parameter")
        try:
            subject = "the text of this stream"
            check_length("text", utterance.chars + len(text), self.config.limits.max_input_chars, subject)
        except ApiError as error:
            await self._fail(utterance, error)
            return
        try:
            utterance.feed.append(text)  # type: ignore[union-attr]  (a stream has its feed)
        except ValueError as error:  # not valid Unicode: this chunk is refused, the stream goes on
            raise from_engine(error) from None
        utterance.chars += len(text)
        if utterance.job is None and text.strip():  # its first words: now it needs the worker
            utterance.arrived = time.perf_counter()
            try:
                await self._begin(utterance)
            except ApiError as error:
                await self._fail(utterance, error)

    async def _synthesize_stop(self, data: dict) -> None:
        utterance = self._open_stream("synthesize-stop")
        utterance.stopped = True
        utterance.feed.end()  # type: ignore[union-attr]
        if utterance.job is None and not utterance.failed:  # only blank text: no worker was taken
            await self._fail(utterance, ApiError(400, "text is empty", param="text"))
        await self._finish(utterance)

    async def _prepare(self, text: str | TextFeed, data: dict) -> Request:
        """The request of a synthesize or synthesize-start event, made off the event loop (it
        tokenizes and plans a text, and may read a saved voice)."""
        service = self.service

        def prepared() -> Request:
            return prepare(service.engine, text, self.catalog.options(data), service.state.voices, self.config)

        return await asyncio.to_thread(prepared)

    def _refuse_if_busy(self, kind: str) -> None:
        current = self.utterance
        if current is None:
            return
        streaming = current.feed is not None and not current.stopped
        what = "a stream is open (end it with synthesize-stop)" if streaming else "the last utterance is still speaking"
        raise ApiError(409, f"{kind} while {what}: one utterance at a time per connection", code="out_of_order")

    def _open_stream(self, kind: str) -> _Utterance:
        current = self.utterance
        if current is None or current.feed is None or current.stopped:
            raise ApiError(409, f"{kind} without synthesize-start: open a stream first", code="no_open_stream")
        return current

    # -- speaking ------------------------------------------------------------------------------
    async def _begin(self, utterance: _Utterance) -> None:
        """Queue the utterance for the worker (503 when the queue is full) and relay its audio."""
        limits = self.config.limits
        job = Job(utterance.request, AudioEncoder(), asyncio.get_running_loop(), utterance.arrived,
                  limits.max_buffered_bytes, limits.client_stall_s)  # fmt: skip
        try:
            self.service.worker.submit(job)
        except Busy as busy:
            raise ApiError(503, str(busy), code=busy.code) from None
        utterance.job = job
        try:
            await self._send(AudioStart(SAMPLE_RATE, WIDTH, CHANNELS, timestamp=0).event())
        except BaseException:  # the client is gone or not reading: the job must not run on for nobody
            job.cancel()
            raise
        self._relay = asyncio.create_task(self._speak(utterance, job))

    async def _speak(self, utterance: _Utterance, job: Job) -> None:
        """The utterance's audio as it comes, then audio-stop (and a stream's synthesize-stopped)."""
        samples = 0
        try:
            async for item in job.outcomes():
                if isinstance(item, bytes):
                    if not utterance.failed:
                        chunk = AudioChunk(SAMPLE_RATE, WIDTH, CHANNELS, item, timestamp=samples * 1000 // SAMPLE_RATE)
                        await self._send(chunk.event())
                    samples += len(item) // WIDTH
                elif not isinstance(item, Outcome):  # a long text's Segment: Wyoming has no event for it
                    continue
                elif item.status == "failed" and not utterance.failed:
                    utterance.failed = True
                    await self._send(_failure(item).event())
            await self._send(AudioStop(timestamp=samples * 1000 // SAMPLE_RATE).event())
            utterance.audio_done = True
            await self._finish(utterance)
        except (ConnectionError, TimeoutError):  # the client is gone, or stopped reading (dropped by _send)
            job.cancel()
            self.writer.transport.abort()
        except Exception:  # a bug: the client sees its connection end rather than wait for ever
            log.exception("the audio of a Wyoming utterance could not be sent")
            job.cancel()
            self.writer.transport.abort()

    async def _fail(self, utterance: _Utterance, error: ApiError) -> None:
        """End an accepted stream with `error`: its audio stops (audio-stop follows), its text is dropped."""
        if utterance.failed:
            return
        utterance.failed = True
        if utterance.job is not None:
            utterance.job.cancel()
        await self._error(error)

    async def _finish(self, utterance: _Utterance) -> None:
        """Forget the utterance once its last event is out: audio-stop for a whole text; for a
        stream, synthesize-stopped once its text has ended and its audio (if any) is out."""
        if self.utterance is not utterance:
            return
        if utterance.feed is None:
            if utterance.audio_done:
                self.utterance = None
        elif utterance.stopped and (utterance.job is None or utterance.audio_done):
            self.utterance = None
            await self._send(SynthesizeStopped().event())
        self._rearm()


def check_uri(uri: str) -> str:
    """A URI this server can listen on (the handler reads the connection itself, so no stdio://)."""
    if not uri.startswith(("tcp://", "unix://")):
        raise ValueError(f"--uri {uri!r}: use tcp://HOST:PORT or unix://PATH")
    return uri


_TAKES = "this server takes describe, synthesize, synthesize-start, synthesize-chunk, synthesize-stop and ping"


def _failure(outcome: Outcome) -> Error:
    """A failed utterance: its live text stopped arriving or was refused, or an internal error."""
    return Error(_wyoming_text(outcome.error or "generation failed"), outcome.error_code or "internal_error")


def _wyoming_text(message: str) -> str:
    """The shared refusals speak of HTTP's `input`; Wyoming's field is `text`."""
    return "text" + message[len("input") :] if message.startswith("input ") else message
