"""What the process's C heap (glibc malloc) keeps of the memory Kazeia frees: handed back after
loading (`release_freed_memory`) and, while streams run, now and then (`trim_now_and_then`).

glibc maps a block of 128 KiB or more on its own and unmaps it when it is freed, but that
threshold rises to the size of any such block freed (up to 32 MiB), so the vocoder's and prompts'
large buffers soon come from the heap. Their sizes vary with chunks and prompts (a stream that fell
behind decodes longer chunks), and freed blocks of sizes not asked for again stay in the process:
a 40,000-character `kazeia say` on a loaded machine grew by 30-100 MB of such memory, one run in
three (quiet, its chunks all alike: flat). Keeping the threshold fixed cured it but cost the
vocoder 7-15 % (a page fault per page of every large buffer); trimming the heap every few seconds
costs a few milliseconds each time. Best effort: a no-op without glibc's malloc_trim. Non-goals:
the weights' memory (kazeia/hugepages.py).
"""

from __future__ import annotations

import ctypes
import functools
import threading
import time

TRIM_EVERY_S = 2.0  # at most one trim in this many seconds, whichever thread asks


@functools.cache
def _malloc_trim():
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def release_freed_memory() -> None:
    """Hand the heap's free pages back to the OS (glibc's malloc_trim: the top of each arena and
    every whole free page inside it). glibc keeps freed blocks for reuse, so without this a process
    stays as large as its peak, e.g. the load's conversion buffers."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


_lock = threading.Lock()
_last = -TRIM_EVERY_S


def trim_now_and_then() -> bool:
    """`release_freed_memory` unless one ran in the last TRIM_EVERY_S seconds; True when it ran."""
    global _last
    with _lock:
        now = time.monotonic()
        if now - _last < TRIM_EVERY_S:
            return False
        _last = now
    release_freed_memory()
    return True
