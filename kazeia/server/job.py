"""One utterance the server speaks (`Job`) and what it ends with (`Outcome`).

A job is made on the event loop and spoken by a worker thread (server/worker.py): the thread hands
its bytes, ended segments and one `Outcome` to the job's asyncio queue with
`loop.call_soon_threadsafe`, waiting for room under the job's byte bound, and the event loop reads
them with `outcomes()`. Cancelling sets a flag the stream polls before each frame, from any thread,
without waiting.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from ..audio import SAMPLE_RATE
from ..request import Request
from ..segment import Segment
from ..streaming import Metrics, SpeechStream
from .formats import AudioEncoder

_ids = itertools.count(1)
# The playout buffer a listener is assumed to keep (seconds): a stream whose audio comes later than
# it would have made such a listener wait is behind real time (production servers qualify at 250 ms).
PLAYOUT_S = 0.25


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
    """No room for another utterance; `retry_after` is a whole number of seconds to wait. `code`:
    "queue_full", or "at_capacity" (one more stream would not keep real time: server/capacity.py)."""

    def __init__(self, retry_after: int, code: str = "queue_full"):
        why = "its queue is full" if code == "queue_full" else "one more stream would fall behind real time"
        super().__init__(f"the server is busy ({why}); retry after {retry_after} s")
        self.retry_after, self.code = retry_after, code


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
        self._full = False  # the worker is waiting for room now (the client holds enough audio)
        # Pace, from the worker: when its first audio came out and how much has come out since.
        self.first_audio: float | None = None  # perf_counter() (None: no audio yet)
        self.audio_s = 0.0
        self.fell_behind = False  # a listener behind a PLAYOUT_S buffer would have run dry
        self.made_all = False  # its audio is all out (its Outcome follows): never behind again
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

    def late_s(self, now: float) -> float:
        """Seconds a listener who began playing at the first audio would now be waiting for more
        (<= 0: none). 0 for live text, whose audio waits for its client's text, and while the
        client holds more audio than it takes (the worker waits for room)."""
        if self.first_audio is None or self.made_all or self.request.live is not None or self._full:
            return 0.0
        return now - self.first_audio - self.audio_s

    def made(self, samples: int, now: float) -> bool:
        """From the worker: `samples` more audio came out at `now`. True the first time a listener
        behind a PLAYOUT_S buffer would have run dry before it (the stall the qualification counts)."""
        if self.first_audio is None:
            self.first_audio = now
        newly = not self.fell_behind and self.late_s(now) > PLAYOUT_S
        self.fell_behind |= newly
        self.audio_s += samples / SAMPLE_RATE
        return newly

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
                    self._full = True
                    left = until - time.monotonic()
                    if self.cancelled:
                        break
                    if left <= 0:
                        self.stalled = True
                        self.cancel()
                        break
                    self._room.wait(min(left, 0.1))
                self._full = False
                self._waited += time.monotonic() - began
                if self.cancelled:
                    return
                self._buffered += len(item)
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass
