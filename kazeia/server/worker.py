"""The worker: it owns the engine and speaks the queued utterances, FIFO, `max_batch` at a time.

Validated engine requests become `Job`s on a bounded queue; a full queue is refused at once (`Busy`, a 503 with
Retry-After) rather than letting waits grow without bound. The worker runs `Engine.stream_request` for
each job (a whole text, or a `TextFeed` whose text is still arriving), encodes each chunk and hands the
bytes to the job's asyncio queue with `loop.call_soon_threadsafe`, so the event loop never waits on
the engine. A job ends with exactly one `Outcome` on that queue.

Cancelling a job (client gone, WebSocket `cancel`, shutdown) sets an event that the stream polls
through its `should_stop` before each frame and while it waits for live text, so generation stops
within one frame, from any thread, without blocking the caller; a job cancelled while still queued
is skipped.

With `max_batch` N > 1, N serving threads take jobs from the one queue, first come first served,
and their streams' frame steps run batched in one `Scheduler` (kazeia/scheduler.py): each
utterance's codes and audio are those it would have alone. N = 1 is one thread and no scheduler,
the engine's own streams.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass

from ..audio import SAMPLE_RATE
from ..engine import Engine
from ..live import TextTimeout
from ..request import Request
from ..runaway import CANCELLED
from ..scheduler import Scheduler
from ..segment import Segment
from ..streaming import ChunkSchedule, Metrics, SpeechStream
from .formats import AudioEncoder
from .metrics import ServerMetrics

log = logging.getLogger("kazeia.server")
_ids = itertools.count(1)


@dataclass(frozen=True)
class Outcome:
    """The last item of a job's queue."""

    status: str  # "completed" | "cancelled" | "failed"
    samples: int  # audio samples encoded (24 kHz)
    queue_s: float  # seconds from arrival until the worker took the job
    ttfb_s: float | None  # seconds from arrival to the first audio, queue wait included
    metrics: Metrics | None  # the engine's figures (completed utterances only)
    error: str | None = None  # why it failed
    # what kind of failure: "text_timeout" (live text stopped arriving), "invalid_text" (live text
    # the engine refused, e.g. empty), None (an internal error)
    error_code: str | None = None
    # why generation ended (kazeia/runaway.py): "eos", "length", "guard" or "cancelled"; None if it failed
    finish_reason: str | None = None
    segments: tuple[Segment, ...] = ()  # the text's segments that were spoken, with their samples


def segment_fields(segment: Segment) -> dict:
    """A segment as the JSON of an SSE / WebSocket event."""
    return {
        "index": segment.index,
        "text": segment.text,
        "start_s": segment.start_s,
        "end_s": segment.end_s,
        "start_sample": segment.start_sample,
        "end_sample": segment.end_sample,
        "finish_reason": segment.finish_reason,
    }


@dataclass(frozen=True)
class JobRecord:
    """What the worker remembers of a finished job (logs, tests)."""

    id: int
    status: str
    frames: int  # frames the generator produced
    frames_at_cancel: int | None  # frames produced when the job was cancelled (None: not cancelled)


class ResponseTooLarge(Exception):
    """The encoded audio an encoder keeps back has grown over the job's `max_held` bytes."""

    def __init__(self, held: int, limit: int):
        super().__init__(f"the encoded audio is over this server's limit of {limit} bytes held for one answer")


class Busy(Exception):
    """The queue is full; `retry_after` is a whole number of seconds to wait."""

    def __init__(self, retry_after: int):
        super().__init__(f"the server is busy; retry after {retry_after} s")
        self.retry_after = retry_after


class Job:
    """One utterance: what to say, its encoder, and the queue its bytes go to.

    The queue holds at most `max_buffered` bytes the client has not taken: the worker waits for
    room. A client that takes nothing for `stall_s` seconds is cancelled as if it had left, and so
    is one that keeps the worker waiting for room longer in all than `stall_s` plus the duration
    of the audio generated so far: a player taking audio in real time never does, a client that
    takes a chunk now and then would otherwise hold the worker for hours."""

    def __init__(
        self,
        request: Request,
        encoder: AudioEncoder,
        loop: asyncio.AbstractEventLoop,
        arrived: float | None = None,
        max_buffered: int = 8 << 20,
        stall_s: float = 30.0,
        max_held: int | None = None,
    ):
        self.id = next(_ids)
        self.request, self.encoder, self.loop = request, encoder, loop
        self.events: asyncio.Queue = asyncio.Queue()  # bytes ..., then one Outcome
        self.arrived = time.perf_counter() if arrived is None else arrived  # perf_counter() of the request
        self.frames_at_cancel: int | None = None
        self.finished = False  # set on the event loop once the Outcome has been taken
        self.stream: SpeechStream | None = None  # set by the worker when generation starts
        self.stalled = False  # cancelled because the client stopped taking its audio
        self.max_buffered, self.stall_s = max_buffered, stall_s
        # Encoded bytes its encoder may keep back (FLAC holds its whole file until the end; None:
        # max_buffered): over it the job fails with `response_too_large` as soon as it is.
        self.max_held = max_buffered if max_held is None else max_held
        self._buffered = 0  # bytes handed to the event loop and not yet taken by the client
        self._waited = 0.0  # seconds the worker has spent waiting for room, in all
        self._room = threading.Condition()
        self._cancelled = threading.Event()
        # Held only to set the cancel flag and read the frame count, or to name the stream (never
        # while one is made: that may decode an ICL voice's reference, and cancel runs on the loop).
        self._naming = threading.Lock()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def cancel(self) -> None:
        """Stop this job: before its next frame if it is generating, at once if it is waiting.
        Never waits for the worker (it is called on the event loop)."""
        if self.finished or self._cancelled.is_set():
            return
        with self._naming:
            self._cancelled.set()  # first, so at most one frame can follow the count read below
            stream = self.stream
            self.frames_at_cancel = stream.frames_generated if stream is not None else 0

    def started(self, stream: SpeechStream) -> None:
        """From the worker: the job's stream, once made. Cancelled while it was being made, its
        frame count is read now: the frames its thread made before it was named are counted."""
        with self._naming:
            self.stream = stream
            if self._cancelled.is_set():
                self.frames_at_cancel = stream.frames_generated

    async def outcomes(self) -> AsyncIterator[bytes | Segment | Outcome]:
        """On the event loop: the job's bytes and ended segments as they come, then its Outcome;
        leaving early cancels it."""
        try:
            while True:
                item = await self.events.get()
                if isinstance(item, Outcome):
                    self.finished = True
                elif isinstance(item, bytes):
                    with self._room:
                        self._buffered -= len(item)
                        self._room.notify()
                yield item
                if self.finished:
                    return
        finally:
            self.cancel()

    def put(self, item) -> None:
        """From the worker thread: hand bytes, a Segment or the Outcome to the event loop. Bytes wait for room
        under `max_buffered`; past the stall bounds (the class docstring) the job is cancelled instead."""
        if isinstance(item, bytes):
            with self._room:
                began = time.monotonic()
                # the audio made so far, at its pace (none before the stream starts)
                audio_s = 0.0 if self.stream is None else self.stream.generated_s
                whole_job = self.stall_s + audio_s - self._waited  # what the job may still wait
                until = began + min(self.stall_s, whole_job)
                while self._buffered > 0 and self._buffered + len(item) > self.max_buffered:
                    left = until - time.monotonic()
                    if self.cancelled:
                        break
                    if left <= 0:
                        self.stalled = True
                        self.cancel()
                        break
                    self._room.wait(min(left, 0.1))
                self._waited += time.monotonic() - began
                if self.cancelled:
                    return
                self._buffered += len(item)
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


class Worker:
    """The thread that owns the engine; `submit` is called on the event loop."""

    def __init__(
        self,
        engine: Engine,
        queue_size: int,
        schedule: ChunkSchedule,
        metrics: ServerMetrics,
        max_batch: int = 1,
    ):
        self.engine, self.schedule, self.metrics = engine, schedule, metrics
        self.max_batch = max_batch
        self.records: deque[JobRecord] = deque(maxlen=256)
        self._jobs: queue.Queue[Job] = queue.Queue(maxsize=queue_size)
        self._current: set[Job] = set()
        self._active = 0  # jobs submitted and not yet ended
        self._lock = threading.Lock()
        self._mean_s: float | None = None  # running mean of seconds per job (Retry-After estimate)
        self._stop = threading.Event()
        # More than one at a time: the jobs' steps batched (every serving thread is admitted at once).
        self.scheduler: Scheduler | None = None
        if max_batch > 1:
            self.scheduler = engine.scheduler(max_batch, max_queue=0, on_step=metrics.batch_size.observe)
        self._threads = [
            threading.Thread(target=self._run, name=f"kazeia-server-worker-{i}", daemon=True) for i in range(max_batch)
        ]

    # -- event-loop side -----------------------------------------------------------------------
    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def check_room(self) -> None:
        """Busy if a job submitted now would be refused (nothing is reserved: submit may still be)."""
        if self._jobs.full():
            raise Busy(self.retry_after())

    def submit(self, job: Job) -> None:
        with self._lock:
            try:
                self._jobs.put_nowait(job)
            except queue.Full:
                raise Busy(self.retry_after()) from None
            self._active += 1

    @property
    def running(self) -> bool:
        """Every worker thread started and none ended (a replica's health check on Ray)."""
        return all(thread.is_alive() for thread in self._threads)

    @property
    def queue_depth(self) -> int:
        return self._jobs.qsize()

    @property
    def active(self) -> int:
        """Jobs admitted and not finished: waiting plus those being generated."""
        return self._active

    def retry_after(self) -> int:
        mean = self._mean_s if self._mean_s is not None else 1.0
        return max(1, min(300, math.ceil(mean * (self.queue_depth // self.max_batch + 1))))

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel everything and end the thread (server shutdown)."""
        self._stop.set()
        for current in list(self._current):
            current.cancel()
        ends = time.monotonic() + timeout
        for thread in self._threads:
            if thread.is_alive():
                thread.join(max(0.0, ends - time.monotonic()))
        if self.scheduler is not None:
            self.scheduler.close()
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            job.cancel()
            waited = time.perf_counter() - job.arrived
            self._end(job, Outcome("cancelled", 0, waited, None, None, finish_reason=CANCELLED), frames=0)

    # -- worker thread -------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                job = self._jobs.get(timeout=0.1)
            except queue.Empty:
                continue
            if self._stop.is_set():
                job.cancel()
            with self._lock:
                self._current.add(job)
            try:
                self._serve(job)
            finally:
                with self._lock:
                    self._current.discard(job)

    def _serve(self, job: Job) -> None:
        started = time.perf_counter()
        queue_s = started - job.arrived
        self.metrics.queue_wait.observe(queue_s)
        if job.cancelled:
            self._end(job, Outcome("cancelled", 0, queue_s, None, None, finish_reason=CANCELLED), frames=0)
            return
        stream: SpeechStream | None = None
        samples, ttfb = 0, None
        try:
            stop = lambda: job.cancelled  # noqa: E731
            stream = self.engine.stream_request(job.request, self.schedule, stop, scheduler=self.scheduler)
            job.started(stream)
            with stream:
                for chunk in stream:
                    if job.cancelled:
                        break
                    data = job.encoder.encode(chunk.audio)
                    if job.encoder.held > job.max_held:
                        raise ResponseTooLarge(job.encoder.held, job.max_held)
                    samples += len(chunk.audio)
                    if ttfb is None and chunk.frames:
                        ttfb = time.perf_counter() - job.arrived
                        self.metrics.ttfb.observe(ttfb)
                    if data:
                        job.put(data)
                    if len(job.request.parts) > 1:  # a long text: each segment as soon as its audio is out
                        for segment in chunk.segments:
                            job.put(segment)
            segments = tuple(stream.segments)
            if job.cancelled:
                outcome = Outcome("cancelled", samples, queue_s, ttfb, None, finish_reason=CANCELLED, segments=segments)
            else:
                tail = job.encoder.finish()
                if tail:
                    job.put(tail)
                reason = stream.finish_reason
                outcome = Outcome("completed", samples, queue_s, ttfb, stream.metrics, None, None, reason, segments)
        except Exception as error:  # reported to this client; the server keeps serving
            code = _error_code(error, live=job.request.live is not None)
            if code is None:
                log.exception("utterance %d failed", job.id)
            else:
                log.info("utterance %d refused: %s", job.id, error)
            # An internal failure's details go to the log only; the client learns where to look.
            message = str(error) if code is not None else f"generation failed (utterance {job.id}; see the server log)"
            outcome = Outcome("failed", samples, queue_s, ttfb, None, message, code)
        self._end(job, outcome, frames=0 if stream is None else stream.frames_generated)

    def _end(self, job: Job, outcome: Outcome, frames: int) -> None:
        with self._lock:
            self._active -= 1
        wall = time.perf_counter() - job.arrived - outcome.queue_s
        if outcome.status == "completed":
            self._mean_s = wall if self._mean_s is None else 0.8 * self._mean_s + 0.2 * wall
        self.metrics.utterances.inc(outcome=outcome.status)
        self.metrics.audio_seconds.inc(outcome.samples / SAMPLE_RATE)
        if outcome.metrics is not None and outcome.metrics.audio_s > 0:
            self.metrics.rtf.observe(outcome.metrics.rtf)
        self.records.append(JobRecord(job.id, outcome.status, frames, job.frames_at_cancel))
        log.info(
            "utterance %d %s%s%s: %d frames, %.2f s audio, queued %.2f s, %.2f s work",
            job.id,
            outcome.status,
            f" ({outcome.finish_reason})" if outcome.finish_reason else "",
            f" (its client took no audio for {job.stall_s:g} s)" if job.stalled else "",
            frames,
            outcome.samples / SAMPLE_RATE,
            outcome.queue_s,
            wall,
        )
        job.put(outcome)


def _error_code(error: Exception, live: bool) -> str | None:
    """Live text can fail on the client's account: it stopped arriving, or the engine refused it
    (e.g. only whitespace); so can an answer that grows over its bound. Everything else is an
    internal error."""
    if isinstance(error, TextTimeout):
        return "text_timeout"
    if isinstance(error, ResponseTooLarge):
        return "response_too_large"
    if live and isinstance(error, ValueError):
        return "invalid_text"
    return None
