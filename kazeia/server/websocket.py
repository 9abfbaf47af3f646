"""`WS /v1/audio/speech/stream`: a session of options, then texts, answered with live PCM.

Client messages are JSON text frames with a `type`:

* `session.update` `{"session": {voice, instructions, language, seed, sampling options...}}` sets
  the options of the utterances that follow (answered by `session.updated`);
* `input_text` `{"text": ...}` is one complete utterance;
* `input_text.append` `{"text": delta}` adds text to the *open* utterance, opening one if there is
  none: an utterance whose text is still being written (an LLM's reply), spoken as it arrives;
* `input_text.end` closes the open utterance: its text is complete;
* `cancel` stops the utterance being spoken (before its next frame) and drops the queued ones.

Utterances, whole or live, queue up in the order they were accepted and are spoken one after the
other. The server answers each with `audio.start`, binary frames of 16-bit little-endian PCM (24 kHz
mono) as the audio is produced, `audio.segment` (text, start/end seconds and samples, finish reason)
after the audio of each segment of a text long enough to be spoken in several, then `audio.done`
(status, finish_reason, all segments, metrics) — or with one `error` that carries its number. Errors
that concern no utterance (bad JSON, unknown type, bad session, `input_text.end` with nothing open)
leave the session as it was and the socket open.

A live utterance stays open until `input_text.end`, even once its audio has ended (cancelled,
failed, or finished early): the rest of its text is then dropped without an answer, so the deltas
of one reply can never start another utterance behind the client's back.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from dataclasses import dataclass

import anyio
from fastapi import APIRouter
from starlette.websockets import WebSocket, WebSocketDisconnect

from ..audio import SAMPLE_RATE
from ..errors import check_text
from ..live import TextFeed
from ..request import Request
from .bodies import json_object, refuse_unknown
from .errors import ApiError
from .formats import AudioEncoder
from .job import Busy, Job, Outcome, segment_fields
from .params import check_length, prepare, session_options
from .state import ServerState, server_state
from .wire import dumps

ROUTE = "/v1/audio/speech/stream"
router = APIRouter()
log = logging.getLogger("kazeia.server")
FIELDS = {  # message type -> its fields besides `type`
    "session.update": ("session",),
    "input_text": ("text",),
    "input_text.append": ("text",),
    "input_text.end": (),
    "cancel": (),
}
MESSAGE_TYPES = tuple(FIELDS)


@dataclass(eq=False)
class Utterance:
    number: int  # 1, 2, ... in the order the texts were accepted on this socket
    request: Request
    accepted: float  # perf_counter() when its text (live: its first delta) was accepted; TTFB counts from here
    feed: TextFeed | None = None  # live text: where its deltas go
    chars: int = 0  # live text: characters received so far
    over: bool = False  # its audio has ended or is ending (done, cancelled, failed): its text is dropped
    reported: bool = False  # its closing event (audio.done or error) has been sent
    job: Job | None = None  # once submitted to the worker


class _Session:
    """One socket: its options, its queued utterances, the one being spoken, the one taking text."""

    def __init__(self, socket: WebSocket, state: ServerState):
        self.socket, self.engine, self.config = socket, state.engine, state.config
        self.worker, self.metrics, self.voices = state.worker, state.metrics, state.voices
        self.options = session_options({}, self.engine, self.config.limits, self.voices, check=False)
        self.pending: deque[Utterance] = deque()  # accepted, not yet submitted to the worker
        self._wake = asyncio.Event()  # set when `pending` gains an utterance
        self.current: Utterance | None = None  # being spoken (submitted to the worker)
        self.open: Utterance | None = None  # the live utterance taking `input_text.append`
        self.accepted = 0
        self._send_lock = asyncio.Lock()
        self.idle: anyio.CancelScope | None = None  # the receive under way, cancelled once idle too long

    def busy(self) -> bool:
        """Something is queued, being spoken or taking text (an open utterance whose audio has
        ended only drops its deltas: it does not keep the socket from being idle)."""
        taking_text = self.open is not None and not self.open.over
        return bool(self.pending) or self.current is not None or taking_text

    def rearm(self) -> None:
        """Restart the idle clock of the receive under way: none while busy, ws_idle_s from now otherwise."""
        if self.idle is not None:
            self.idle.deadline = math.inf if self.busy() else anyio.current_time() + self.config.ws_idle_s

    async def send(self, message: dict | bytes) -> None:
        async with self._send_lock:
            if isinstance(message, bytes):
                await self.socket.send_bytes(message)
            else:
                await self.socket.send_text(dumps(message))

    async def error(self, error: ApiError, utterance: int | None = None) -> None:
        self.metrics.errors.inc(route=ROUTE, status=str(error.status))
        await self.send({"type": "error", "utterance": utterance, **error.body()})

    # -- client messages -------------------------------------------------------------------------
    async def receive(self, message: dict) -> None:
        raw = message.get("text")
        if raw is None:
            raise ApiError(400, "send JSON text messages; binary messages are not accepted", code="invalid_message")
        limit = self.config.limits.max_body_bytes
        if len(raw) > limit or len(raw.encode("utf-8", "surrogatepass")) > limit:
            raise ApiError(413, f"the message is over the limit of {limit} bytes", code="body_too_large")
        body = json_object(raw, "message", self.config.limits.max_field_chars)
        kind = body.get("type")
        if kind not in MESSAGE_TYPES:
            raise ApiError(
                400,
                f"unknown message type {kind!r}; valid types: {', '.join(MESSAGE_TYPES)}",
                param="type",
                code="unknown_message_type",
            )
        refuse_unknown(body, FIELDS[kind], repr(kind), ignore=("type",))
        if kind == "session.update":
            await self.update(body.get("session"))
        elif kind == "input_text":
            await self.accept_text(body.get("text"))
        elif kind == "input_text.append":
            await self.append(body.get("text"))
        elif kind == "input_text.end":
            self.end()
        else:
            await self.cancel()

    async def update(self, session) -> None:
        if not isinstance(session, dict):
            raise ApiError(400, "session must be a JSON object of options", param="session")
        # (a saved voice is loaded to check it: off the event loop)
        self.options = await asyncio.to_thread(session_options, session, self.engine, self.config.limits, self.voices)
        shown = {("instructions" if k == "instruct" else k): v for k, v in self.options.items() if v is not None}
        await self.send({"type": "session.updated", "session": shown})

    async def accept_text(self, text) -> None:
        """`input_text`: one whole utterance (tokenized and planned off the event loop)."""
        self._check_text(text, len(text) if isinstance(text, str) else 0)
        self._admit()
        self._enqueue(await self._prepare(text))

    async def append(self, text) -> None:
        """`input_text.append`: more text for the open utterance, or the first text of a new one."""
        self._check_text(text, 0)
        try:
            check_text("text", text)  # not valid Unicode: this delta is refused, the utterance goes on
        except ValueError as error:
            raise ApiError(400, str(error), param="text") from None
        utterance = self.open
        if utterance is None:
            self._check_text(text, len(text))
            self._admit()
            feed = TextFeed()
            utterance = self._enqueue(await self._prepare(feed), feed)
            self.open = utterance
        if utterance.over:
            return  # its audio has ended: the rest of its text is dropped (see the module docstring)
        try:
            total, subject = utterance.chars + len(text), f"the text of utterance {utterance.number}"
            check_length("text", total, self.config.limits.max_input_chars, subject)
        except ApiError as error:
            await self.fail(utterance, error)
            return
        utterance.chars += len(text)
        utterance.feed.append(text)

    def end(self) -> None:
        """`input_text.end`: the open utterance's text is complete."""
        utterance = self.open
        if utterance is None:
            raise ApiError(
                400,
                "input_text.end without an open utterance: send input_text.append first",
                param="type",
                code="no_open_utterance",
            )
        self.open = None
        utterance.feed.end()

    async def cancel(self) -> None:
        while self.pending:
            utterance = self.pending.popleft()
            utterance.over = utterance.reported = True
            await self.send(_done(utterance.number, "cancelled", None))
        current = self.current
        if current is not None and current.job is not None:
            current.over = True
            current.job.cancel()  # its audio.done (cancelled) comes from speak()

    async def fail(self, utterance: Utterance, error: ApiError) -> None:
        """End an accepted utterance with `error` (its one closing event), wherever it is."""
        if utterance.reported:
            return
        utterance.over = utterance.reported = True
        if utterance in self.pending:
            self.pending.remove(utterance)
        elif utterance.job is not None:
            utterance.job.cancel()  # speak() drops the rest of its audio and its outcome
        await self.error(error, utterance.number)

    async def _prepare(self, text: str | TextFeed) -> Request:
        return await asyncio.to_thread(prepare, self.engine, text, self.options, self.voices, self.config)

    def _check_text(self, text, length: int) -> None:
        if not isinstance(text, str):
            raise ApiError(400, "text must be a string", param="text")
        check_length("text", length, self.config.limits.max_input_chars)

    def _admit(self) -> None:
        self.metrics.requests.inc(route=ROUTE)
        if len(self.pending) >= self.config.limits.max_pending_utterances:
            raise ApiError(
                429,
                f"{len(self.pending)} texts are already waiting on this socket; wait for audio.done",
                code="too_many_pending",
            )

    def _enqueue(self, request: Request, feed: TextFeed | None = None) -> Utterance:
        self.accepted += 1
        utterance = Utterance(self.accepted, request, time.perf_counter(), feed)
        self.pending.append(utterance)
        self._wake.set()
        return utterance

    # -- speaking ------------------------------------------------------------------------------
    async def speak(self) -> None:
        """Speak the queued utterances one after the other until the socket closes."""
        while True:
            while not self.pending:
                self._wake.clear()
                await self._wake.wait()
            utterance = self.pending.popleft()
            limits = self.config.limits
            job = Job(utterance.request, AudioEncoder(), asyncio.get_running_loop(), utterance.accepted,
                      limits.max_buffered_bytes, limits.client_stall_s)  # fmt: skip
            try:
                self.worker.submit(job)
            except Busy as busy:
                await self.fail(utterance, ApiError(503, str(busy), code=busy.code))
                self.rearm()
                continue
            utterance.job, self.current = job, utterance
            number = utterance.number
            start = {"type": "audio.start", "utterance": number, "sample_rate": SAMPLE_RATE}
            await self.send({**start, "channels": 1, "format": "pcm_s16le", "seed": utterance.request.seed})
            async for item in job.outcomes():
                if utterance.reported:  # failed by the session (fail()): its error is out
                    continue
                if isinstance(item, bytes):
                    await self.send(item)
                    continue
                if not isinstance(item, Outcome):
                    await self.send({"type": "audio.segment", "utterance": number, **segment_fields(item)})
                    continue
                utterance.over = utterance.reported = True
                if item.status == "failed":
                    await self.error(_failure(item), number)
                else:
                    await self.send(_done(number, item.status, item))
            self.current = None
            self.rearm()


def _failure(outcome: Outcome) -> ApiError:
    if outcome.error_code == "text_timeout":
        return ApiError(408, outcome.error, param="text", code="text_timeout")
    if outcome.error_code == "invalid_text":
        message = "input " + outcome.error[len("text ") :] if outcome.error.startswith("text ") else outcome.error
        return ApiError(400, message, param="text")
    return ApiError(500, f"generation failed: {outcome.error}", code="internal_error")


def _done(number: int, status: str, outcome: Outcome | None) -> dict:
    metrics = {"samples": 0, "audio_s": 0.0}
    if outcome is not None:
        metrics = {"samples": outcome.samples, "audio_s": outcome.samples / SAMPLE_RATE, "queue_s": outcome.queue_s}
        metrics["ttfb_s"] = outcome.ttfb_s
        if outcome.metrics is not None:
            m = outcome.metrics
            metrics.update(frames=m.frames, wall_s=m.wall_s, rtf=m.rtf, prefill_s=m.prefill_s, seed=m.seed)
            if m.first_text_to_audio_s is not None:  # live text
                metrics.update(text_wait_frames=m.text_wait_frames, first_text_to_audio_s=m.first_text_to_audio_s)
    reason = outcome.finish_reason if outcome is not None else "cancelled"
    segments = [segment_fields(segment) for segment in outcome.segments] if outcome is not None else []
    done = {"type": "audio.done", "utterance": number, "status": status, "finish_reason": reason}
    return {**done, "segments": segments, "metrics": metrics}


@router.websocket(ROUTE)
async def speech_socket(socket: WebSocket) -> None:
    await socket.accept()
    session = _Session(socket, server_state(socket))
    speaker = asyncio.create_task(session.speak())
    idle_s = session.config.ws_idle_s
    try:
        while not speaker.done():
            # A socket with nothing to say or to hear is closed after ws_idle_s; the speaker restarts
            # the clock when an utterance ends. An anyio scope, not asyncio.wait_for, which on
            # Python 3.11 can swallow the cancellation of the session itself.
            message = None
            with anyio.CancelScope() as idle:
                session.idle = idle
                session.rearm()
                message = await socket.receive()
            session.idle = None
            if message is None:  # the idle deadline passed (`cancelled_caught` needs anyio 4)
                await socket.close(code=1000, reason=f"idle for {idle_s:g} s")
                break
            if message["type"] == "websocket.disconnect":
                break
            try:
                await session.receive(message)
            except ApiError as error:
                await session.error(error)
            except WebSocketDisconnect:
                raise
            except Exception:  # a bug must not drop the socket: the client hears of it, the log has it
                log.exception("a WebSocket message could not be handled")
                failure = ApiError(500, "the message could not be handled (see the server log)", code="internal_error")
                await session.error(failure)
    except WebSocketDisconnect:
        pass
    finally:
        current = session.current
        if current is not None and current.job is not None:
            current.job.cancel()
        speaker.cancel()
        await asyncio.gather(speaker, return_exceptions=True)  # a send to a closed socket may have failed
