"""kazeia/heap.py: freed heap memory goes back to the OS, and trimming while streams run is held to
one trim every few seconds.

The first test runs in a process of its own: it allocates through glibc's malloc directly, frees
all but the block at the top of the heap (so glibc's automatic trim of the top cannot return
anything), and reads the process's RssAnon before and after `release_freed_memory`.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from kazeia import heap

pytestmark = pytest.mark.skipif(heap._malloc_trim() is None, reason="glibc's malloc_trim")

HELD_IN_THE_HEAP = """
import ctypes
from kazeia.heap import release_freed_memory

def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("RssAnon:"))

libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
blocks = [libc.malloc(64 << 10) for _ in range(1024)]  # 64 MiB below glibc's mmap threshold
for b in blocks:
    ctypes.memset(b, 1, 64 << 10)
before = rss()
for b in blocks[:-1]:  # the last one stays: the heap's top is in use
    libc.free(b)
freed = rss()
release_freed_memory()
print(before, freed, rss())
"""


def test_freed_memory_inside_the_heap_goes_back_to_the_os():
    out = subprocess.run([sys.executable, "-c", HELD_IN_THE_HEAP], capture_output=True, text=True, check=True)
    before, freed, released = map(int, out.stdout.split())
    assert freed > before - (16 << 20)  # free() alone kept it: the top block holds the heap up
    assert released < freed - (48 << 20)  # the trim handed back most of the 64 MiB


def test_trims_come_at_most_every_few_seconds(monkeypatch):
    now = [1000.0]
    trims = []
    monkeypatch.setattr(heap.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(heap, "release_freed_memory", lambda: trims.append(now[0]))
    monkeypatch.setattr(heap, "_last", -heap.TRIM_EVERY_S)
    assert heap.trim_now_and_then()
    now[0] += heap.TRIM_EVERY_S / 2
    assert not heap.trim_now_and_then()
    now[0] += heap.TRIM_EVERY_S / 2
    assert heap.trim_now_and_then()
    assert trims == [1000.0, 1000.0 + heap.TRIM_EVERY_S]
