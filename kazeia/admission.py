"""Admission to a scheduler: first come, first served, at most `max_batch` at once and `max_queue`
more waiting.

A stream takes a `Ticket` when it is made (`Admission.enqueue`: SchedulerBusy when every place and
every queue slot is taken), waits in its own thread until it is first in line and a place is free
(`admit`), and gives its place back when its frames end or it could not start (`release`). A ticket
whose stream stops while queued leaves the queue at once; closing the admission ends every wait.
Threads and a lock only: what an admitted stream does is the scheduler's (kazeia/scheduler.py).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

RECENT = 1024  # queue waits kept for the statistics
POLL_S = 0.05  # how often a queued stream looks at its stop flag


class SchedulerBusy(Exception):
    """The scheduler's queue is full."""


class SchedulerClosed(RuntimeError):
    """The scheduler was closed; it takes no more streams and ends those it runs."""


class Ticket:
    """A stream's place: queued, then admitted, then released."""

    def __init__(self) -> None:
        self.should_stop: Callable[[], bool] = lambda: False  # set when its stream starts
        # whether its stream's vocoder is short of frames (SpeechStream.needs_frames), once it is made
        self.needs_frames: Callable[[], bool] = lambda: True
        # whether its stream's next chunk still needs a frame (SpeechStream.chunk_far)
        self.chunk_far: Callable[[], bool] = lambda: True
        self.queued_at = time.perf_counter()
        self.admitted = False


class Admission:
    """The places of one scheduler (module docstring)."""

    def __init__(self, max_batch: int, max_queue: int, most: int):
        """`most`: the largest `max_batch` a frame step takes."""
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or not 1 <= max_batch <= most:
            raise ValueError(f"max_batch must be an integer from 1 to {most}, got {max_batch!r}")
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 0:
            raise ValueError(f"max_queue must be an integer >= 0, got {max_queue!r}")
        self.max_batch, self.max_queue = max_batch, max_queue
        self.waits: deque[float] = deque(maxlen=RECENT)  # seconds from `enqueue` to `admit`, the latest
        self._queue: deque[Ticket] = deque()  # waiting for admission, first come first
        self._active = 0
        self._closed = False
        self._lock = threading.Condition()

    @property
    def active(self) -> int:
        """Streams admitted now."""
        return self._active

    @property
    def waiting(self) -> int:
        """Streams queued now."""
        return len(self._queue)

    def enqueue(self) -> Ticket:
        with self._lock:
            if self._closed:
                raise SchedulerClosed("the scheduler is closed")
            if self._active + len(self._queue) >= self.max_batch + self.max_queue:
                raise SchedulerBusy(f"{len(self._queue)} streams are already waiting (max_queue={self.max_queue})")
            ticket = Ticket()
            self._queue.append(ticket)
            return ticket

    def admit(self, ticket: Ticket) -> bool:
        """Wait until `ticket` is first in the queue and a place is free; False if it was stopped
        (or the admission closed) meanwhile."""
        with self._lock:
            while True:
                if self._closed or ticket.should_stop():
                    return False
                if self._queue[0] is ticket and self._active < self.max_batch:
                    self._queue.popleft()
                    self._active += 1
                    ticket.admitted = True
                    self.waits.append(time.perf_counter() - ticket.queued_at)
                    self._lock.notify_all()  # the next in line may be admitted too
                    return True
                self._lock.wait(POLL_S)  # polls the stop flag

    def release(self, ticket: Ticket) -> None:
        with self._lock:
            if ticket.admitted:
                self._active -= 1
                ticket.admitted = False
            elif ticket in self._queue:
                self._queue.remove(ticket)
            self._lock.notify_all()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify_all()
