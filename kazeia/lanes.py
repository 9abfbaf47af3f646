"""The vocoders' turns: at most `lanes` decodes of a scheduler's streams at once, the most urgent first.

On few cores every stream decoding at once would take the CPU from the scheduler's thread, the one
all of them wait for (kazeia/scheduler.py's docstring). `VocoderLanes` orders the waiting decodes
(a first chunk, a paused decode, the rest by the deadline of their listener), hands a lane from a
decode at its pause points to a first chunk, and lends generation's own cores (the spare lanes)
while generation waits. Threads and locks only: no tensors.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class LaneStopped(Exception):
    """A stream stopped while its paused decode waited for its lane back (VocoderLanes.turn)."""


# Who goes first for a lane: a first chunk, a decode that paused (its chunk half done), the others.
FIRST, RESUMED, LATER = 0, 1, 2
LANE, SPARE = "lane", "spare"  # what a decode holds: one of the lanes, or a spare one (generation's cores)
POLL_S = 0.05  # how often a wait for a lane looks at its stream's stop flag


class VocoderLanes:
    """At most `lanes` vocoder decodes at once; the others wait in order of (first chunk or not,
    deadline), the deadline being when the stream's listener runs out of audio (kazeia/scheduler.py).
    A decode that is not a first chunk gives its lane up at its next pause point (`Vocoder.
    decode_chunk`'s `pause`, between its stages) to a first chunk that waits for one, and gets it
    back before the decodes that have not started."""

    def __init__(self, lanes: int, spare: int = 0):
        for name, value, least in (("vocoder_lanes", lanes, 1), ("spare_lanes", spare, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
        self.lanes, self.spare = lanes, spare
        self._free, self._spare_free = lanes, spare
        self._generating = True  # generation holds the spare lanes' cores (`generating`)
        self._waiting: list[tuple[int, float, int]] = []  # a heap of (FIRST, RESUMED or LATER, deadline, ticket)
        self._tickets = itertools.count()
        self._cond = threading.Condition()

    def decoding(self) -> bool:
        """A decode holds a lane now (a spare one does not count: it waits while a prompt runs)."""
        return self._free < self.lanes

    def generating(self, busy: bool) -> None:
        """Generation (the scheduler's thread) has work now (True) or waits for some (False). The
        spare lanes decode only while it waits: a decode on one (other than a first chunk's) stops
        at its next pause point while generation runs, until it waits again or a lane frees (the
        decode moves there)."""
        with self._cond:
            if self._generating != busy:
                self._generating = busy
                self._cond.notify_all()

    @contextmanager
    def turn(self, first: bool, deadline: float, stopped: Callable[[], bool]) -> Iterator[Callable[[], None] | None]:
        """Wait for a lane and hold it in the block. Yields the decode's `pause` (hand the lane over
        if someone more urgent waits, and wait for it back; raises LaneStopped when `stopped()`
        becomes true meanwhile), or None (holding none) when `stopped()` becomes true while
        waiting (polled), so a closed stream's consumer does not wait its turn."""
        entry = (FIRST if first else LATER, deadline, next(self._tickets))
        with self._cond:
            held = self._take(entry, stopped)
        if held is None:
            yield None
            return

        def pause() -> None:
            nonlocal held
            with self._cond:
                if held == SPARE:  # generation has this core back: wait for it, or for a lane
                    if entry[0] == FIRST:  # except a first chunk (short; its listener hears nothing yet)
                        return
                    while self._generating and not self._lane_for_resumed():
                        if stopped():
                            self._give_back(held)
                            held = None
                            raise LaneStopped
                        self._cond.wait(POLL_S)
                    if self._generating:
                        self._spare_free += 1
                        self._free -= 1
                        held = LANE
                    return
                # a first chunk waits for a lane and none is free: it gets this one
                if entry[0] == FIRST or self._free or not self._waiting or self._waiting[0][0] != FIRST:
                    return
                self._give_back(held)
                held = self._take((RESUMED, *entry[1:]), stopped)
                if held is None:
                    raise LaneStopped

        try:
            yield pause
        finally:
            if held is not None:
                with self._cond:
                    self._give_back(held)

    def _take(self, entry: tuple[int, float, int], stopped: Callable[[], bool]) -> str | None:
        """Queue `entry` and wait (holding the condition) for a lane, or a spare one while generation
        waits; LANE or SPARE, or None if stopped meanwhile."""
        heapq.heappush(self._waiting, entry)
        try:
            while True:
                if self._waiting[0] is entry and (self._free or (self._spare_free and not self._generating)):
                    heapq.heappop(self._waiting)
                    if self._free:
                        self._free -= 1
                        return LANE
                    self._spare_free -= 1
                    return SPARE
                if stopped():
                    self._waiting.remove(entry)
                    heapq.heapify(self._waiting)
                    return None
                self._cond.wait(POLL_S)
        finally:
            self._cond.notify_all()  # the next in line may go now (a second free lane, or this one's place)

    def _lane_for_resumed(self) -> bool:
        """Is a lane free that no first chunk waits for (a decode under way may take it)?"""
        return self._free > 0 and not (self._waiting and self._waiting[0][0] == FIRST)

    def _give_back(self, held: str) -> None:
        if held == LANE:
            self._free += 1
        else:
            self._spare_free += 1
        self._cond.notify_all()
