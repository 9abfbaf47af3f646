"""The worker: it owns the engine and speaks the queued utterances, FIFO, `max_batch` at a time.

Validated engine requests become `Job`s (server/job.py) on a bounded queue; a full queue is refused
at once (`Busy`, a 503 with Retry-After) rather than letting waits grow without bound. The worker
runs `Engine.stream_request` for each job (a whole text, or a `TextFeed` whose text is still
arriving), encodes each chunk and hands the bytes to the job, so the event loop never waits on the
engine. A job ends with exactly one `Outcome`. A cancelled job stops before its next frame; one
cancelled while still queued is skipped.

With `max_batch` N > 1, N serving threads take jobs from the one queue, first come first served,
and their streams' frame steps run batched in one `Scheduler` (kazeia/scheduler.py): each
utterance's codes and audio are those it would have alone. N = 1 is one thread and no scheduler,
the engine's own streams.

Admission (`admission`): "all" takes every job the queue has room for; "behind" also refuses
(`Busy`, code at_capacity) while a stream is behind real time; "measured", the default, also
refuses one that the pace measured of this server's own streams says would not keep real time
(server/capacity.py: every chunk a serving thread waits for after a stream's first audio is
evidence; the first waits for the prompt, which the first-audio bound judges apart).
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections import deque

from ..audio import SAMPLE_RATE
from ..engine import Engine
from ..live import TextTimeout
from ..runaway import CANCELLED
from ..scheduler import Scheduler
from ..streaming import ChunkSchedule, SpeechStream
from .capacity import Capacity
from .job import PLAYOUT_S, Busy, Job, JobRecord, Outcome, ResponseTooLarge
from .metrics import ServerMetrics

log = logging.getLogger("kazeia.server")


class Worker:
    """The thread that owns the engine; `submit` is called on the event loop."""

    def __init__(
        self,
        engine: Engine,
        queue_size: int,
        schedule: ChunkSchedule,
        metrics: ServerMetrics,
        max_batch: int = 1,
        admission: str = "all",
    ):
        self.engine, self.schedule, self.metrics = engine, schedule, metrics
        self.max_batch, self.admission = max_batch, admission
        self.capacity = Capacity(max_batch)
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
        """Busy if a job submitted now would be refused (nothing is reserved: submit may still be):
        the queue is full, or the admission refuses one more stream."""
        if self._jobs.full():
            raise Busy(self.retry_after())
        self._admit()

    def _admit(self) -> None:
        """Busy (at_capacity) where `admission` refuses one more stream (module docstring): one
        behind real time now would only be held back further; one too many for the measured pace
        would put them all behind."""
        if self.admission == "all":
            return
        more = min(self.active + 1, self.max_batch)  # past max_batch it waits in the queue
        if self.behind or (self.admission == "measured" and not self.capacity.holds(more, time.perf_counter())):
            raise Busy(self.retry_after(), "at_capacity")

    @property
    def admits(self) -> int:
        """Utterances at once that the admission lets in now, at most max_batch (the live C)."""
        if self.admission == "all":
            return self.max_batch
        if self.behind:
            return max(1, self.active)
        if self.admission == "behind":
            return self.max_batch
        return self.capacity.most_held(time.perf_counter())

    def paces(self) -> dict[int, float]:
        """The measured pace of each number of utterances at once (server/capacity.py)."""
        return self.capacity.paces(time.perf_counter())

    def submit(self, job: Job) -> None:
        self._admit()
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

    @property
    def behind(self) -> int:
        """Streams behind real time now: a listener behind a `PLAYOUT_S` buffer would be waiting."""
        now = time.perf_counter()
        with self._lock:
            return sum(job.late_s(now) > PLAYOUT_S for job in self._current)

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
        started = waited_from = time.perf_counter()
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
                    if samples:  # a stream's first audio waits for its prompt: not its pace
                        self._evidence(job, len(chunk.audio), waited_from)
                    data = job.encoder.encode(chunk.audio)
                    if job.encoder.held > job.max_held:
                        raise ResponseTooLarge(job.encoder.held, job.max_held)
                    samples += len(chunk.audio)
                    now = time.perf_counter()
                    if ttfb is None and chunk.frames:
                        ttfb = now - job.arrived
                        self.metrics.ttfb.observe(ttfb)
                    if ttfb is not None and job.made(len(chunk.audio), now):
                        self.metrics.fell_behind.inc()
                    if data:
                        job.put(data)
                    if len(job.request.parts) > 1:  # a long text: each segment as soon as its audio is out
                        for segment in chunk.segments:
                            job.put(segment)
                    waited_from = time.perf_counter()  # the next chunk's wait starts (not the client's)
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

    def _evidence(self, job: Job, samples: int, waited_from: float) -> None:
        """A chunk of `samples` came out of `job`'s stream after waiting since `waited_from`: the
        pace of the utterances being spoken now (live text waits for its client: no evidence)."""
        if job.request.live is None and samples:
            with self._lock:
                level = len(self._current)
            now = time.perf_counter()
            self.capacity.observe(level, samples / SAMPLE_RATE, now - waited_from, now)

    def _end(self, job: Job, outcome: Outcome, frames: int) -> None:
        job.made_all = True
        wall = time.perf_counter() - job.arrived - outcome.queue_s
        try:  # counted out once its metrics and record are in: an idle worker has them all
            if outcome.status == "completed":
                self._mean_s = wall if self._mean_s is None else 0.8 * self._mean_s + 0.2 * wall
            self.metrics.utterances.inc(outcome=outcome.status)
            self.metrics.audio_seconds.inc(outcome.samples / SAMPLE_RATE)
            if outcome.metrics is not None and outcome.metrics.audio_s > 0:
                self.metrics.rtf.observe(outcome.metrics.rtf)
            self.records.append(JobRecord(job.id, outcome.status, frames, job.frames_at_cancel))
        finally:
            with self._lock:
                self._active -= 1
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
