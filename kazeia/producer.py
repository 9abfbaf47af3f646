"""A stream's producer: the worker thread that drains its frame source into its queue
(kazeia/streaming.py's SpeechStream takes the frames from there and decodes them)."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

import torch

DONE = object()  # put after the last frame


class FrameProgress:
    """What the worker reports back (plain attributes, written by the worker only)."""

    frames = 0  # frames generated so far
    first_frame_at: float | None = None  # perf_counter() of the first frame
    ended_at: float | None = None  # perf_counter() when the last item was generated


class FirstChunk(NamedTuple):
    """A stream's first chunk as its worker sees it (placement.first_chunk_team)."""

    frames: int  # frames it holds
    team: Callable[[], int | None] | None  # threads its decode may take now (None from it: none more)
    decoded: threading.Event  # set once it is decoded

    def waits(self, made: int) -> bool:
        """Whether generation, `made` frames in, waits for the chunk's decode: its last frame is
        made and the decode may take the team."""
        return made == self.frames and self.team is not None and bool(self.team())


def generate(
    make_frames,
    frames_out: queue.Queue,
    stop: threading.Event,
    progress: FrameProgress,
    first: FirstChunk,
) -> None:
    """Worker: put each generated frame, then DONE (or the exception), on the queue; after the
    first chunk's frames, wait for its decode where `first` says so.

    Holds no reference to the SpeechStream, so dropping the stream (e.g. leaving a `for` loop over
    a temporary) collects it, and its finaliser stops this worker.
    """
    try:
        for frame in make_frames(stop.is_set):  # frames, each segment followed by its Segment
            if isinstance(frame, torch.Tensor):
                if progress.first_frame_at is None:
                    progress.first_frame_at = time.perf_counter()
                progress.frames += 1
            if not put(frames_out, frame, stop):
                return
            if isinstance(frame, torch.Tensor) and first.waits(progress.frames):
                while not first.decoded.wait(0.05):  # as put: a closed stream ends the wait
                    if stop.is_set():
                        return
        progress.ended_at = time.perf_counter()
        put(frames_out, DONE, stop)
    except BaseException as error:
        put(frames_out, error, stop)


def put(frames_out: queue.Queue, item, stop: threading.Event) -> bool:
    """Block while the queue is full; give up (False) once the stream is closed."""
    while not stop.is_set():
        try:
            frames_out.put(item, timeout=0.05)
            return True
        except queue.Full:
            continue
    return False
