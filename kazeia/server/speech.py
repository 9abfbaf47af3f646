"""`POST /v1/audio/speech`: OpenAI's speech endpoint, streamed as the audio is generated.

The body is validated before the job is queued (params.py). The response starts at once: the
encoded audio as it comes (`stream_format: "audio"`), or OpenAI's server-sent events
`speech.audio.delta` (base64 of the same bytes) and a final `speech.audio.done` with usage
(`stream_format: "sse"`; each event is one `data:` line holding JSON with its `type`). However the
response ends, its job is cancelled if it is still running, so a client that leaves frees the worker.

A long input is spoken in segments (kazeia/segment.py); SSE sends a `speech.segment` event for each
as soon as its audio is out (text, start/end seconds and samples, finish reason), and the done event
carries the utterance's `finish_reason` and all its `segments` (a short text's one included). A
streamed audio body has sent its headers before the end is known, so the finish reason travels in a
header (`X-Kazeia-Finish-Reason`) only for `stream: false`, which answers with the whole audio once
it is made (at most `max_response_bytes`)."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from .bodies import json_object, read_body, require_json
from .errors import ApiError
from .job import Busy, Job, Outcome, segment_fields
from .metrics import ServerMetrics
from .params import speech_body
from .state import server_state
from .wire import dumps
from .worker import Worker

ROUTE = "/v1/audio/speech"
router = APIRouter()


@router.post(ROUTE)
async def speech(request: Request) -> Response:
    s = server_state(request)
    s.metrics.requests.inc(route=ROUTE)
    require_json(request)
    limits = s.config.limits
    raw = await read_body(request, limits.max_body_bytes, limits.max_body_s)
    body = json_object(raw, max_chars=limits.max_field_chars)
    _refuse_if_full(s.worker)  # before the work of preparing it
    # Tokenizing and planning a long text, loading a saved voice: off the event loop.
    parsed = await asyncio.to_thread(speech_body, body, s.engine, s.config, s.formats, s.voices)
    encoder = parsed.audio_format.make()
    # What an encoder keeps back (FLAC's whole file) is bounded as the whole answer is.
    loop, held = asyncio.get_running_loop(), limits.max_response_bytes
    job = Job(parsed.request, encoder, loop, None, limits.max_buffered_bytes, limits.client_stall_s, held)
    try:
        s.worker.submit(job)
    except Busy as busy:
        raise _queue_full(busy) from None
    headers = {"Cache-Control": "no-store", "X-Kazeia-Seed": str(parsed.request.seed)}
    if not parsed.stream:
        watch = asyncio.create_task(_cancel_when_gone(request, job))
        try:
            body_bytes, outcome = await _whole(job, encoder.header(), limits.max_response_bytes, s.metrics)
        finally:
            watch.cancel()
            job.cancel()  # a no-op once the job has finished
        headers["X-Kazeia-Finish-Reason"] = outcome.finish_reason or ""
        return Response(body_bytes, media_type=parsed.audio_format.media_type, headers=headers)
    if parsed.stream_format == "sse":
        events = _sse(job, encoder.header(), len(parsed.request.text_ids), s.metrics)
        return _JobResponse(job, events, media_type="text/event-stream", headers=headers)
    audio = _audio(job, encoder.header(), s.metrics)
    return _JobResponse(job, audio, media_type=parsed.audio_format.media_type, headers=headers)


def _refuse_if_full(worker: Worker) -> None:
    try:
        worker.check_room()
    except Busy as busy:
        raise _queue_full(busy) from None


def _queue_full(busy: Busy) -> ApiError:
    return ApiError(503, str(busy), code=busy.code, headers={"Retry-After": str(busy.retry_after)})


async def _cancel_when_gone(request: Request, job: Job) -> None:
    """A whole (`stream: false`) response is made before anything is sent, so nothing notices a
    client that leaves: poll for it, and cancel its job then (freeing the worker)."""
    while not await request.is_disconnected():
        await asyncio.sleep(0.1)
    job.cancel()


class _Cut(Exception):
    """Raised by a body's iterator: the answer ends here, without the terminator of a complete one."""


class _JobResponse(StreamingResponse):
    """A streamed body that cancels its job however the response ends (done, error, client gone).
    A body cut short (its generation failed or was cancelled after the status line went out) ends
    without the chunked terminator: the client sees an incomplete body, never a complete answer."""

    def __init__(self, job: Job, content: AsyncIterator, **kwargs):
        super().__init__(self._until_cut(content), **kwargs)
        self.job, self.cut = job, False

    async def _until_cut(self, content: AsyncIterator) -> AsyncIterator:
        try:
            async for chunk in content:
                yield chunk
        except _Cut:
            self.cut = True

    async def __call__(self, scope, receive, send) -> None:
        async def send_unless_cut(message) -> None:
            if self.cut and message["type"] == "http.response.body" and not message.get("more_body", False):
                return  # uvicorn closes a response left incomplete: the body is cut
            await send(message)

        try:
            await super().__call__(scope, receive, send_unless_cut)
        finally:
            self.job.cancel()  # a no-op once the job has finished


async def _whole(job: Job, header: bytes, limit: int, metrics: ServerMetrics) -> tuple[bytes, Outcome]:
    """All of a job's audio and its Outcome (`stream: false`); over `limit` bytes is a 413."""
    pieces, size = [header], len(header)
    async for item in job.outcomes():
        if isinstance(item, bytes):
            size += len(item)
            if size > limit:
                raise ApiError(
                    413,
                    f"the audio is over this server's limit of {limit} bytes for stream false; stream it instead",
                    param="stream",
                    code="response_too_large",
                )
            pieces.append(item)
        elif isinstance(item, Outcome):
            if item.status != "completed":
                error = _unfinished(job, item)
                metrics.errors.inc(route=ROUTE, status=str(error.status))
                raise error
            return b"".join(pieces), item
    raise ApiError(500, "generation ended without an outcome", code="internal_error")


async def _audio(job: Job, header: bytes, metrics: ServerMetrics) -> AsyncIterator[bytes]:
    if header:
        yield header
    async for item in job.outcomes():
        if isinstance(item, Outcome):
            if item.status != "completed":  # the status line is out: cutting the body is the only signal left
                metrics.errors.inc(route=ROUTE, status=str(_unfinished(job, item).status))
                raise _Cut
            return
        if isinstance(item, bytes):
            yield item


async def _sse(job: Job, header: bytes, input_tokens: int, metrics: ServerMetrics) -> AsyncIterator[str]:
    pending = header  # a WAV header travels in the first delta
    async for item in job.outcomes():
        if isinstance(item, bytes):
            yield _event({"type": "speech.audio.delta", "audio": base64.b64encode(pending + item).decode()})
            pending = b""
        elif not isinstance(item, Outcome):  # a segment whose audio is out
            yield _event({"type": "speech.segment", **segment_fields(item)})
        elif item.status != "completed":
            error = _unfinished(job, item)
            metrics.errors.inc(route=ROUTE, status=str(error.status))
            yield _event({"type": "error", **error.body()})
        else:
            if pending:
                yield _event({"type": "speech.audio.delta", "audio": base64.b64encode(pending).decode()})
            frames = item.metrics.frames if item.metrics else 0
            usage = {"input_tokens": input_tokens, "output_tokens": frames, "total_tokens": input_tokens + frames}
            segments = [segment_fields(segment) for segment in item.segments]
            done = {"type": "speech.audio.done", "usage": usage, "finish_reason": item.finish_reason}
            yield _event({**done, "segments": segments})


def _unfinished(job: Job, outcome: Outcome) -> ApiError:
    """Why an utterance ended before its audio did: it failed, its client took none of its audio
    for client_stall_s, or it was cancelled (the server is shutting down)."""
    if outcome.error_code == "response_too_large":
        message = f"{outcome.error}; stream it in another format instead"
        return ApiError(413, message, param="response_format", code="response_too_large")
    if outcome.status == "failed":
        return ApiError(500, f"generation failed: {outcome.error}", code="internal_error")
    if job.stalled:
        message = f"the client took none of its audio for {job.stall_s:g} s; the utterance was cut"
        return ApiError(408, message, code="client_stalled")
    return ApiError(503, "the utterance was cancelled before its end (the server is stopping)", code="cancelled")


def _event(data: dict) -> str:
    return f"data: {dumps(data)}\n\n"
