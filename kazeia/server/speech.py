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
import json
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from .bodies import json_object, read_body, require_json
from .errors import ApiError
from .metrics import ServerMetrics
from .params import speech_body
from .state import server_state
from .worker import Busy, Job, Outcome, segment_fields

ROUTE = "/v1/audio/speech"
router = APIRouter()


@router.post(ROUTE)
async def speech(request: Request) -> Response:
    s = server_state(request)
    s.metrics.requests.inc(route=ROUTE)
    require_json(request)
    body = json_object(
        await read_body(request, s.config.limits.max_body_bytes), max_chars=s.config.limits.max_field_chars
    )
    parsed = speech_body(body, s.engine, s.config, s.formats, s.voices)
    encoder = parsed.audio_format.make()
    limits = s.config.limits
    job = Job(
        parsed.request, encoder, asyncio.get_running_loop(), None, limits.max_buffered_bytes, limits.client_stall_s
    )
    try:
        s.worker.submit(job)
    except Busy as busy:
        raise ApiError(503, str(busy), code="queue_full", headers={"Retry-After": str(busy.retry_after)}) from None
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


async def _cancel_when_gone(request: Request, job: Job) -> None:
    """A whole (`stream: false`) response is made before anything is sent, so nothing notices a
    client that leaves: poll for it, and cancel its job then (freeing the worker)."""
    while not await request.is_disconnected():
        await asyncio.sleep(0.1)
    job.cancel()


class _JobResponse(StreamingResponse):
    """A streamed body that cancels its job however the response ends (done, error, client gone)."""

    def __init__(self, job: Job, content: AsyncIterator, **kwargs):
        super().__init__(content, **kwargs)
        self.job = job

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
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
                metrics.errors.inc(route=ROUTE, status="500")
                raise ApiError(500, f"generation {item.status}: {item.error}", code="internal_error")
            return b"".join(pieces), item
    raise ApiError(500, "generation ended without an outcome", code="internal_error")


async def _audio(job: Job, header: bytes, metrics: ServerMetrics) -> AsyncIterator[bytes]:
    if header:
        yield header
    async for item in job.outcomes():
        if isinstance(item, Outcome):
            if item.status == "failed":  # the status line is out: cutting the body is the only signal left
                metrics.errors.inc(route=ROUTE, status="500")
                raise RuntimeError(f"utterance {job.id} failed: {item.error}")
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
        elif item.status == "failed":
            metrics.errors.inc(route=ROUTE, status="500")
            error = ApiError(500, f"generation failed: {item.error}", code="internal_error")
            yield _event({"type": "error", **error.body()})
        else:
            if pending:
                yield _event({"type": "speech.audio.delta", "audio": base64.b64encode(pending).decode()})
            frames = item.metrics.frames if item.metrics else 0
            usage = {"input_tokens": input_tokens, "output_tokens": frames, "total_tokens": input_tokens + frames}
            segments = [segment_fields(segment) for segment in item.segments]
            done = {"type": "speech.audio.done", "usage": usage, "finish_reason": item.finish_reason}
            yield _event({**done, "segments": segments})


def _event(data: dict) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"
