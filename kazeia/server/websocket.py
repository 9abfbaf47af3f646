"""`WS /v1/audio/speech/stream`: a session of options, then texts, answered with live PCM.

Client messages are JSON text frames with a `type`:

* `session.update` `{"session": {voice, instructions, language, seed, sampling options...}}` sets
  the options of the texts that follow (answered by `session.updated`);
* `input_text` `{"text": ...}` is one complete utterance; texts queue up and are spoken in order;
* `cancel` stops the utterance being spoken (before its next frame) and drops the queued ones.

The server answers each `input_text` with `audio.start`, binary frames of 16-bit little-endian PCM
(24 kHz mono) as the audio is produced, then `audio.done` (status, metrics) — or with one `error`.
Errors that concern no utterance (bad JSON, unknown type, bad session) leave the session as it was
and the socket open. The names `input_text.append` / `input_text.end` are reserved for text that
arrives piece by piece (an utterance spoken while its text is still being written).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from fastapi import APIRouter
from starlette.websockets import WebSocket, WebSocketDisconnect

from ..audio import SAMPLE_RATE
from ..engine import Request
from .errors import ApiError
from .formats import Encoder
from .params import engine_request, json_object, session_options
from .state import ServerState, server_state
from .worker import Busy, Job, Outcome

ROUTE = "/v1/audio/speech/stream"
router = APIRouter()
MESSAGE_TYPES = ("session.update", "input_text", "cancel")
RESERVED_TYPES = ("input_text.append", "input_text.end")


@dataclass(frozen=True)
class Utterance:
    number: int  # 1, 2, ... in the order the texts were accepted on this socket
    request: Request
    accepted: float  # perf_counter() when its text was accepted (TTFB counts from here)


class _Session:
    """One socket: its options, its queued utterances and the one being spoken."""

    def __init__(self, socket: WebSocket, state: ServerState):
        self.socket, self.engine, self.config = socket, state.engine, state.config
        self.worker, self.metrics = state.worker, state.metrics
        self.options = session_options({}, self.engine, self.config.limits, check=False)
        self.pending: asyncio.Queue[Utterance] = asyncio.Queue()
        self.current: Job | None = None
        self.accepted = 0
        self._send_lock = asyncio.Lock()

    async def send(self, message: dict | bytes) -> None:
        async with self._send_lock:
            if isinstance(message, bytes):
                await self.socket.send_bytes(message)
            else:
                await self.socket.send_json(message)

    async def error(self, error: ApiError, utterance: int | None = None) -> None:
        self.metrics.errors.inc(route=ROUTE, status=str(error.status))
        await self.send({"type": "error", "utterance": utterance, **error.body()})

    # -- client messages -------------------------------------------------------------------------
    async def receive(self, message: dict) -> None:
        raw = message.get("text")
        if raw is None:
            raise ApiError(400, "send JSON text messages; binary messages are not accepted", code="invalid_message")
        limit = self.config.limits.max_body_bytes
        if len(raw) > limit:
            raise ApiError(413, f"the message is over the limit of {limit} bytes", code="body_too_large")
        body = json_object(raw.encode(), "message")
        kind = body.get("type")
        if kind in RESERVED_TYPES:
            raise ApiError(400, f"{kind!r} is not supported yet; send whole texts with 'input_text'", param="type")
        if kind not in MESSAGE_TYPES:
            raise ApiError(
                400,
                f"unknown message type {kind!r}; valid types: {', '.join(MESSAGE_TYPES)}",
                param="type",
                code="unknown_message_type",
            )
        _check_fields(body, {"session.update": ("session",), "input_text": ("text",), "cancel": ()}[kind])
        if kind == "session.update":
            await self.update(body.get("session"))
        elif kind == "input_text":
            await self.accept_text(body.get("text"))
        else:
            await self.cancel()

    async def update(self, session) -> None:
        if not isinstance(session, dict):
            raise ApiError(400, "session must be a JSON object of options", param="session")
        self.options = session_options(session, self.engine, self.config.limits)
        shown = {("instructions" if k == "instruct" else k): v for k, v in self.options.items() if v is not None}
        await self.send({"type": "session.updated", "session": shown})

    async def accept_text(self, text) -> None:
        self.metrics.requests.inc(route=ROUTE)
        limit = self.config.limits.max_input_chars
        if not isinstance(text, str):
            raise ApiError(400, "text must be a string", param="text")
        if len(text) > limit:
            raise ApiError(
                400,
                f"text is {len(text)} characters long; this server accepts at most {limit}",
                param="text",
                code="string_above_max_length",
            )
        if self.pending.qsize() >= self.config.limits.max_pending_utterances:
            raise ApiError(
                429,
                f"{self.pending.qsize()} texts are already waiting on this socket; wait for audio.done",
                code="too_many_pending",
            )
        request = engine_request(self.engine, text, self.options)
        self.accepted += 1
        self.pending.put_nowait(Utterance(self.accepted, request, time.perf_counter()))

    async def cancel(self) -> None:
        while not self.pending.empty():
            utterance = self.pending.get_nowait()
            await self.send(_done(utterance.number, "cancelled", None))
        if self.current is not None:
            self.current.cancel()

    # -- speaking ------------------------------------------------------------------------------
    async def speak(self) -> None:
        """Speak the queued utterances one after the other until the socket closes."""
        while True:
            utterance = await self.pending.get()
            job = Job(utterance.request, Encoder(), asyncio.get_running_loop(), utterance.accepted)
            try:
                self.worker.submit(job)
            except Busy as busy:
                error = ApiError(503, str(busy), code="queue_full")
                await self.error(error, utterance.number)
                continue
            self.current = job
            start = {"type": "audio.start", "utterance": utterance.number, "sample_rate": SAMPLE_RATE}
            await self.send({**start, "channels": 1, "format": "pcm_s16le", "seed": utterance.request.seed})
            async for item in job.outcomes():
                if isinstance(item, bytes):
                    await self.send(item)
                elif item.status == "failed":
                    error = ApiError(500, f"generation failed: {item.error}", code="internal_error")
                    await self.error(error, utterance.number)
                else:
                    await self.send(_done(utterance.number, item.status, item))
            self.current = None


def _check_fields(body: dict, allowed: tuple[str, ...]) -> None:
    for name in body:
        if name != "type" and name not in allowed:
            valid = ", ".join(("type", *allowed))
            raise ApiError(400, f"unknown field {name!r} in {body['type']!r}; valid: {valid}", param=name)


def _done(number: int, status: str, outcome: Outcome | None) -> dict:
    metrics = {"samples": 0, "audio_s": 0.0}
    if outcome is not None:
        metrics = {"samples": outcome.samples, "audio_s": outcome.samples / SAMPLE_RATE, "queue_s": outcome.queue_s}
        metrics["ttfb_s"] = outcome.ttfb_s
        if outcome.metrics is not None:
            m = outcome.metrics
            metrics.update(frames=m.frames, wall_s=m.wall_s, rtf=m.rtf, prefill_s=m.prefill_s, seed=m.seed)
    return {"type": "audio.done", "utterance": number, "status": status, "metrics": metrics}


@router.websocket(ROUTE)
async def speech_socket(socket: WebSocket) -> None:
    await socket.accept()
    session = _Session(socket, server_state(socket))
    speaker = asyncio.create_task(session.speak())
    try:
        while not speaker.done():
            message = await socket.receive()
            if message["type"] == "websocket.disconnect":
                break
            try:
                await session.receive(message)
            except ApiError as error:
                await session.error(error)
    except WebSocketDisconnect:
        pass
    finally:
        if session.current is not None:
            session.current.cancel()
        speaker.cancel()
        await asyncio.gather(speaker, return_exceptions=True)  # a send to a closed socket may have failed
