"""How much of this process's CPUs other work takes: a frame step borrows the vocoder's idle core
only while nothing else wants it (`Placement.decode_team`).

A step split over two threads waits for both halves; where another process holds the second core,
its half waits for the scheduler's next turn, and a borrowed step became ~2.5x slower than one
thread's (a busy neighbour on a 2-vCPU Zen 3: an int8 stream 0.47 -> 0.17 audio seconds a second).
So before borrowing, Kazeia looks: on Linux, the busy time of the CPUs this process may run on
(/proc/stat: user, nice, system, irq, softirq and steal, the last being time the hypervisor gave to
other guests) less this process's own CPU time (`time.process_time`, every thread) over the last
window is what others took. At most one look a window (`WINDOW_S`), the verdict kept in between;
busy from `BUSY_CORES` of others' use. Where nothing can be read (another OS), or before the first
window, the caller says what to assume: a step borrows nothing, a prompt keeps its team (a look
when the model loads starts the first window: `Placement.for_model`).

Prompts and a stream's first chunk split over both cores ask too: beside a busy neighbour, a split
prompt and its first frame waited at every product for the half the scheduler had not run yet (a
2-vCPU Zen 4, int4: prompt and first frame 0.44-0.71 s against 0.23-0.26 s on one thread; first
audio 0.58-0.86 s against 0.31-0.35 s).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

WINDOW_S = 0.2  # seconds between two looks (/proc/stat counts in ticks of 10 ms)
BUSY_CORES = 0.5  # others' use, in cores, from which the CPUs count as busy


def busy_seconds(stat: str, cpus: set[int], tick: float) -> float:
    """The busy time of `cpus` in /proc/stat's text `stat`, in seconds (`tick` seconds a tick)."""
    total = 0
    for line in stat.splitlines():
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or not name[3:].isdigit() or int(name[3:]) not in cpus:
            continue
        fields = [int(v) for v in rest.split()]
        user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
        total += user + nice + system + irq + softirq + steal
    return total * tick


def _read_busy() -> float | None:
    """This process's CPUs' busy seconds so far, or None where /proc/stat cannot be read."""
    try:
        with open("/proc/stat") as f:
            stat = f.read()
        return busy_seconds(stat, os.sched_getaffinity(0), 1.0 / os.sysconf("SC_CLK_TCK"))
    except (OSError, AttributeError, ValueError):
        return None


class Neighbours:
    """Whether other work takes this process's CPUs now (module docstring). Thread-safe."""

    def __init__(
        self,
        read_busy: Callable[[], float | None] = _read_busy,
        own: Callable[[], float] = time.process_time,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._read_busy, self._own, self._clock = read_busy, own, clock
        self._lock = threading.Lock()
        self._last: tuple[float, float, float] | None = None  # (clock, busy, own) at the last look
        self._busy: bool | None = None  # the last verdict; None: none yet

    def busy(self, unknown: bool = True) -> bool:
        """Whether others took more than `BUSY_CORES` over the last window; `unknown` where that
        cannot be told (nothing readable, or no window measured yet)."""
        with self._lock:
            now = self._clock()
            if self._last is None or now - self._last[0] >= WINDOW_S:
                self._look(now)
            return unknown if self._busy is None else self._busy

    def _look(self, now: float) -> None:
        busy, own = self._read_busy(), self._own()
        if busy is None:
            self._last, self._busy = None, None
            return
        if self._last is not None:
            then, busy_then, own_then = self._last
            others = (busy - busy_then) - (own - own_then)
            self._busy = others > BUSY_CORES * (now - then)
        self._last = (now, busy, own)


NEIGHBOURS = Neighbours()  # the process's one look, shared by its streams
