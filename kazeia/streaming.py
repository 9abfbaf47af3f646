"""Streaming synthesis: generation in a worker thread, the vocoder in the caller's, chunk by chunk.

The worker drains the frame generator (talker + code predictor) into a bounded queue; iterating
the `SpeechStream` takes frames from it, decodes each chunk with the stateful vocoder and yields
`AudioChunk`s. Vocoder work therefore overlaps generation, the first chunk is decoded as soon as
its frames exist, and no frame is ever decoded twice. Closing the stream (or leaving a `for` loop
over it, or a `with` block) stops generation before the next frame and joins the worker; an
exception in the worker is raised to the caller. `open_stream` makes a stream for a request: its
frames from a `FrameSource` (utterance.Unscheduled, or a scheduler's), its vocoder state (an ICL
voice's primed one), its count in `runtime.running`.

A long text's segments (kazeia/segment.py) all go through the one stream and its one vocoder state,
so their joins are as seamless as any chunk boundary. The frame generator follows each segment's
last frame with its `Segment` (exact first and last sample, finish reason); the chunk that carries
that last sample, or a later one, lists it in `AudioChunk.segments`.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from . import cpu
from .heap import trim_now_and_then
from .lanes import LaneStopped, VocoderLanes
from .options import ChunkSchedule
from .placement import Running
from .producer import DONE, FirstChunk, FrameProgress, generate
from .request import Request
from .runaway import CANCELLED, overall
from .runtime import Runtime
from .segment import Segment
from .speed import TimeStretch
from .vocoder import Vocoder, VocoderState, no_pause

QUEUE_FRAMES = 64  # frames the worker may run ahead of the consumer (about 5 s of audio)
PACE_CHUNKS = 2  # a scheduled stream is stepped while fewer than this many of its chunks are ready


@dataclass(frozen=True)
class AudioChunk:
    """One piece of a stream."""

    audio: np.ndarray  # float32 mono, 24 kHz: frames * 1920 samples at speed 1 (else stretched)
    start_sample: int  # offset of audio[0] in the whole utterance (output samples)
    frames: int  # code frames in this chunk (0 only for an empty closing chunk)
    is_last: bool  # no chunk follows
    segments: tuple[Segment, ...] = ()  # segments that ended (their last sample is out) by this chunk's end


@dataclass(frozen=True)
class Metrics:
    """Timing of one synthesis, streamed or not (a stream's is complete once it is exhausted)."""

    frames: int  # code frames generated (80 ms each)
    audio_s: float  # seconds of audio produced (at the requested speed)
    wall_s: float  # seconds from the call to the last sample
    rtf: float  # real-time factor: wall_s / audio_s (below 1 is faster than real time)
    prefill_s: float  # seconds from the call to the first generated frame
    ttfb_s: float  # seconds from the call to the first audio (offline: all audio comes at the end)
    chunks: int  # audio chunks delivered (offline: 1)
    seed: int  # the seed that drove sampling (replays the same result)
    text_wait_frames: int = 0  # live text: decode steps that had to wait for more text
    first_text_to_audio_s: float | None = None  # live text: first text delta -> first audio chunk
    # seconds from the call to the end of generation (its last frame, EOS or limit known); the
    # rest of wall_s is the vocoder catching up (a stream's worker runs up to 64 frames ahead, a
    # scheduled one two chunks: SpeechStream.needs_frames)
    generation_s: float | None = None


def _weakly(method: Callable[[], bool]) -> Callable[[], bool]:
    """`method` (a stream's bound method) called through a weak reference: False once the stream is
    collected."""
    ref = weakref.WeakMethod(method)

    def call() -> bool:
        bound = ref()
        return bound is not None and bound()

    return call


class FrameSource(Protocol):
    """Where a stream's frames come from: generated alone (kazeia/utterance.py) or in a scheduler's
    batched steps (kazeia/scheduler.py)."""

    @property
    def lanes(self) -> VocoderLanes | None:
        """The turns the stream's vocoder takes (None: it decodes at once)."""
        ...

    def frames(self, stop: Callable[[], bool]) -> Iterator[torch.Tensor | Segment]:
        """The frames, each segment's last followed by its Segment; `stop()` ends them early."""
        ...

    def pace(self, needs_frames: Callable[[], bool], chunk_far: Callable[[], bool]) -> None:
        """Generation may wait while `needs_frames()` is False (the stream's vocoder has enough), and
        take the vocoder's core while `chunk_far()` is True (placement.decode_team)."""
        ...

    def release(self) -> None:
        """The stream could not start: give back what was taken for it (its frames are never asked for)."""
        ...


class SpeechStream:
    """Iterator of `AudioChunk`s; `metrics` and `codes` are set once the last chunk is out (None
    before, and for a stream closed early); `segments` grows as segments end."""

    def __init__(
        self,
        source: FrameSource,
        vocoder: Vocoder,
        schedule: ChunkSchedule,
        seed: int,
        started: float,
        state: VocoderState | None = None,
        live=None,
        speed: float = 1.0,
        on_close: Callable[[], None] | None = None,
        first_team: Callable[[], int | None] | None = None,
        decoding: Running | None = None,
    ):
        """`state`: where the vocoder starts (ICL voices: after the reference's frames); fresh by default.
        `live`: the stream's `LiveText` when its text is still arriving (for the metrics).
        `speed`: the pace of the audio; other than 1.0 each chunk goes through a `TimeStretch`.
        `on_close`: called once, when the stream is closed (at its end, by `close`, or collected);
        not when this constructor fails (its caller undoes what it did for the stream then).
        `first_team`: the threads of the first chunk's decode, asked at each of its products (None
        from it: the vocoder's own); generation waits for that chunk while it says a number.
        `decoding`: counts each chunk's decode while it runs (the engine's, placement.decode_team)."""
        self._live = live
        self._speed = speed
        self._stretch = None if speed == 1.0 else TimeStretch(speed, vocoder.cfg.sample_rate)
        self.metrics: Metrics | None = None  # set once the last chunk is out
        self.codes: np.ndarray | None = None  # (frames, 16) int64, set once the last chunk is out
        self.segments: list[Segment] = []  # the segments that have ended, in order
        self._ended: list[Segment] = []  # segments that ended since the last chunk went out
        self._vocoder, self._schedule, self._seed, self._started = vocoder, schedule, seed, started
        self._state: VocoderState = vocoder.new_state() if state is None else state
        self._queue: queue.Queue = queue.Queue(maxsize=QUEUE_FRAMES)
        self._stop = threading.Event()
        self._progress = FrameProgress()
        self._pending: list[torch.Tensor] = []  # frames waiting for their chunk
        # The frames already decoded, one (n, 16) tensor a chunk (128 bytes a frame, not an object each).
        self._codes: list[torch.Tensor] = []
        self._frames = 0  # frames given to the vocoder so far (counted as each chunk's decode starts)
        self._lookahead = None  # an item taken from the queue early, to mark the last chunk
        self._chunks = self._samples = 0
        self._ttfb: float | None = None
        self._done = False
        self._lanes = source.lanes
        # a source (a scheduler's ticket) must not keep the stream alive
        source.pace(_weakly(self.needs_frames), _weakly(self.chunk_far))
        self._first_team, self._first_out = first_team, threading.Event()
        self._decoding = decoding or Running()
        first = FirstChunk(schedule.first, first_team, self._first_out)
        args = (source.frames, self._queue, self._stop, self._progress, first)
        self._worker = threading.Thread(target=generate, args=args, name="kazeia-generate", daemon=True)
        self._worker.start()
        self._on_close = on_close  # last: a stream that failed to start is never closed

    @property
    def finish_reason(self) -> str | None:
        """Why the utterance ended (the most serious of its segments' reasons, runaway.overall):
        None while it runs, "cancelled" for a stream closed before its end."""
        if self.metrics is None:
            return CANCELLED if self._done else None
        return overall([s.finish_reason for s in self.segments])

    @property
    def frames_generated(self) -> int:
        """Frames the worker has produced so far (it may run ahead of the chunks yielded)."""
        return self._progress.frames

    @property
    def generated_s(self) -> float:
        """Seconds of audio (at the stream's speed) the frames generated so far make."""
        cfg = self._vocoder.cfg
        return self._progress.frames * cfg.samples_per_frame / cfg.sample_rate / self._speed

    def needs_frames(self) -> bool:
        """Is the vocoder short of frames: fewer made and not yet decoding than its next two
        chunks may take (`ChunkSchedule.limit`: with `max_chunk_frames`, as many as it lets a chunk
        catch up with)? A scheduler steps a stream's generation while it is (kazeia/scheduler.py):
        more would only wait in the queue, and leave the batched steps early."""
        return self._progress.frames - self._frames < PACE_CHUNKS * self._schedule.limit(self._chunks)

    def chunk_far(self) -> bool:
        """Does the vocoder's next chunk still need a frame? A decode starts only once a step has put
        its chunk's last frame, so until then a step may take the vocoder's core (placement.
        decode_team) without a decode starting beside it. Asked from generation's thread between
        its steps, when every frame made is counted."""
        return self._progress.frames - self._frames < self._schedule.size(self._chunks)

    def __iter__(self) -> SpeechStream:
        return self

    def __next__(self) -> AudioChunk:
        if self._done:
            raise StopIteration
        try:
            while True:
                item = self._lookahead if self._lookahead is not None else self._take(block=True)
                self._lookahead = None
                if item is DONE:
                    return self._emit(is_last=True)
                if isinstance(item, Segment):
                    self._ended.append(item)
                    continue
                self._pending.append(item)
                if len(self._pending) >= self._schedule.size(self._chunks):
                    limit = self._schedule.limit(self._chunks)
                    self._lookahead = self._take(block=False)
                    while isinstance(self._lookahead, Segment) or (  # a segment that ends with this chunk,
                        isinstance(self._lookahead, torch.Tensor) and len(self._pending) < limit  # or catching up
                    ):
                        if isinstance(self._lookahead, Segment):
                            self._ended.append(self._lookahead)
                        else:
                            self._pending.append(self._lookahead)
                        self._lookahead = self._take(block=False)
                    return self._emit(is_last=self._lookahead is DONE)
        except BaseException:
            self.close()
            raise

    def _take(self, block: bool):
        """The next queued item (a frame or DONE); None when not blocking and nothing is there.

        A blocking take polls the stop flag, so `close()` from another thread (a server whose client
        left) also ends an iteration that is waiting for the next frame."""
        while True:
            try:
                item = self._queue.get(timeout=0.05) if block else self._queue.get_nowait()
                break
            except queue.Empty:
                if not block:
                    return None
                if self._stop.is_set():
                    raise StopIteration from None
        if isinstance(item, BaseException):
            raise item
        return item

    def _emit(self, is_last: bool) -> AudioChunk:
        frames, self._pending = self._pending, []
        with self._decoding.counting():  # counted before the frames leave what `chunk_far` reads
            self._frames += len(frames)  # before the decode: `needs_frames` is asked from another thread
            # no frames: the end became known only after the previous chunk went out
            samples = self._decode(frames) if frames else np.zeros(0, dtype=np.float32)
        if self._stretch is not None:  # what the stretch can give so far; all the rest at the end
            samples = self._stretch.push(samples)
            if is_last:
                samples = np.concatenate([samples, self._stretch.flush()])
        # At a speed other than 1 the stretch holds back the last ~35-140 ms: a segment is listed
        # with the chunk that completes its audio (the last one lists any left).
        held = [segment.at_speed(self._speed) for segment in self._ended]
        out = self._samples + len(samples)
        complete = [is_last or segment.end_sample <= out for segment in held]
        ended = tuple(segment for segment, done in zip(held, complete, strict=True) if done)
        chunk = AudioChunk(samples, self._samples, len(frames), is_last, ended)
        self.segments += ended
        if ended:  # their buffers are free now (kazeia/heap.py)
            trim_now_and_then()
        self._ended = [segment for segment, done in zip(self._ended, complete, strict=True) if not done]
        self._chunks += 1
        self._samples += len(samples)
        if self._ttfb is None:
            self._first_audio_at = time.perf_counter()
            self._ttfb = self._first_audio_at - self._started
        if is_last:
            self._finish()
        return chunk

    def _decode(self, frames: list[torch.Tensor]) -> np.ndarray:
        """The next chunk's audio from its frames (float32, n * 1920 samples)."""
        codes = torch.stack(frames)  # (n, 16)
        team = self._first_team if self._chunks == 0 else None
        try:
            with self._turn() as pause, torch.inference_mode(), cpu.team(team, openmp=False):
                if pause is None:  # closed while waiting for the vocoder
                    raise StopIteration
                audio = self._vocoder.decode_chunk(codes, self._state, pause)  # (n * 1920,)
        except LaneStopped:  # closed while a paused decode waited (its state is abandoned)
            raise StopIteration from None
        finally:
            self._first_out.set()  # generation goes on (after the first chunk; at once later)
        self._codes.append(codes)
        return audio.float().cpu().numpy().astype(np.float32, copy=False)

    def _turn(self) -> AbstractContextManager[Callable[[], None] | None]:
        """The vocoder's turn for the next chunk, as its `pause`: at once (no pauses), or a lane of
        the scheduler's when its listener would run out of audio (played from the first chunk)
        soonest (VocoderLanes.turn)."""
        if self._lanes is None:
            return nullcontext(no_pause)
        first = self._ttfb is None
        deadline = self._started if first else self._first_audio_at + self._samples / self._vocoder.cfg.sample_rate
        return self._lanes.turn(first, deadline, self._stop.is_set)

    def _finish(self) -> None:
        wall = time.perf_counter() - self._started
        audio_s = self._samples / self._vocoder.cfg.sample_rate
        prefill = (self._progress.first_frame_at or self._started) - self._started
        none = np.zeros((0, self._vocoder.cfg.num_quantizers), np.int64)
        self.codes = torch.cat(self._codes).cpu().numpy() if self._codes else none
        rtf = wall / audio_s if audio_s else float("inf")
        live = {}
        if self._live is not None:
            first_text = self._live.first_text_at
            delay = None if first_text is None else self._first_audio_at - first_text
            live = {"text_wait_frames": self._live.waits, "first_text_to_audio_s": delay}
        ttfb = wall if self._ttfb is None else self._ttfb
        generation = (self._progress.ended_at or self._started + wall) - self._started
        self.metrics = Metrics(
            self._frames, audio_s, wall, rtf, prefill, ttfb, self._chunks, self._seed, **live, generation_s=generation
        )
        self.close()

    def close(self) -> None:
        """Stop generation (before its next frame) and wait for the worker to end. Safe from any
        thread: an iteration blocked on the next chunk then ends (StopIteration)."""
        self._done = True
        self._stop.set()
        if self._worker is not threading.current_thread():
            self._worker.join()
        self._closed()

    def _closed(self) -> None:
        on_close = self.__dict__.pop("_on_close", None)  # atomic: called once whoever comes first
        if on_close is not None:
            on_close()

    def __enter__(self) -> SpeechStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        stop = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()
        self._closed()


def open_stream(
    runtime: Runtime,
    request: Request,
    source: FrameSource,
    schedule: ChunkSchedule | None = None,
    started: float | None = None,
) -> SpeechStream:
    """A `SpeechStream` speaking `request`, its frames from `source`; counted in `runtime.running`
    until it closes (its vocoder works until then)."""
    ref = request.cond.reference_codes
    schedule = schedule or ChunkSchedule()
    runtime.running.enter()
    try:
        state = None if ref is None else runtime.priming.state(ref)
        return SpeechStream(
            source,
            runtime.vocoder,
            schedule,
            request.seed,
            time.perf_counter() if started is None else started,
            state,
            request.live,
            request.speed,
            on_close=runtime.running.leave,
            first_team=runtime.placement.first_chunk_team(runtime.running, schedule.first),
            decoding=runtime.decoding,
        )
    except BaseException:  # no thread could be started, no memory to prime the vocoder: what was taken is given back
        runtime.running.leave()
        source.release()
        raise
