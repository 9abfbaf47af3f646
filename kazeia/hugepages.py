"""The model's weights on transparent huge pages (`move_to_huge_pages`).

Generation reads about a gigabyte of weights a frame, one row after the other. On 4 KB pages that
is a TLB miss every 4 KB, and the CPU's stream prefetchers stop at every page boundary; on 2 MB
pages neither happens. Linux gives an anonymous mapping huge pages when it asks for them
(`madvise(MADV_HUGEPAGE)`; the kernel's default, `enabled=madvise`, gives them to nothing else), so
the loaded weights are copied into such a mapping once, before the decoding steps take their
addresses. Measured on a 2-vCPU Zen 4 VM, one thread: a frame's int4 products 48.6-52.7 -> 46.1-46.3
ms, int8 69.8 -> 64.9 (BENCHMARKS.md).

The values and the kernels are the same, so every result is the same bits (only the addresses
change). Tensors that share a storage (views, tied weights) keep sharing one copy. Where huge pages
are not offered (THP `never`, another OS, a GPU) or `KAZEIA_HUGEPAGES=0`, nothing moves.
Non-goals: the vocoder (compute-bound, its weights are small), activations and caches.
"""

from __future__ import annotations

import mmap
import os

import torch
from torch import nn

from .heap import release_freed_memory

HUGE_PAGE = 2 << 20
MIN_BYTES = 1 << 20  # storages smaller than this stay where they are (norms, biases, small tables)
ALIGN = 64  # each storage starts on a cache line
RELEASE_EVERY = 64 << 20  # hand the freed originals back to the OS after this many bytes moved


def enabled() -> bool:
    """Huge pages can be asked for here, and `KAZEIA_HUGEPAGES` does not turn them off."""
    return os.environ.get("KAZEIA_HUGEPAGES", "1") != "0" and hasattr(mmap, "MADV_HUGEPAGE")


class Arena:
    """One anonymous mapping with MADV_HUGEPAGE, its usable part starting on a huge-page boundary;
    tensors made from it keep it alive."""

    def __init__(self, size: int):
        self.map = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.map.madvise(mmap.MADV_HUGEPAGE)
        self.bytes = torch.frombuffer(self.map, dtype=torch.uint8)  # holds a reference to the map
        self.start = -self.bytes.data_ptr() % HUGE_PAGE
        self.size = size

    def contains(self, address: int) -> bool:
        base = self.bytes.data_ptr() + self.start
        return base <= address < base + self.size


def _tensors(module: nn.Module):
    """(owner, attribute name, is a parameter, tensor) for every parameter and buffer."""
    for owner in module.modules():
        for name, t in owner._parameters.items():
            if t is not None:
                yield owner, name, True, t
        for name, t in owner._buffers.items():
            if t is not None:
                yield owner, name, False, t


def _movable(t: torch.Tensor, min_bytes: int) -> bool:
    return (
        t.device.type == "cpu"
        and t.layout == torch.strided
        and not t.is_mkldnn
        and not t.is_quantized
        and t.untyped_storage().nbytes() >= min_bytes
    )


def move_to_huge_pages(module: nn.Module, min_bytes: int | None = None) -> Arena | None:
    """Copy every CPU parameter and buffer of `module` whose storage has `min_bytes` or more
    (default MIN_BYTES) into one huge-page arena and point the module at the copies; returns the
    arena (None when nothing moved or huge pages are off). Call it before anything takes the
    tensors' addresses (the native decoding steps)."""
    if not enabled():
        return None
    limit = MIN_BYTES if min_bytes is None else min_bytes
    groups: dict[int, list] = {}  # storage address -> its tensors (views and tied weights share one)
    for entry in _tensors(module):
        if _movable(entry[3], limit):
            groups.setdefault(entry[3].untyped_storage().data_ptr(), []).append(entry)
    if not groups:
        return None
    sizes = [-(-group[0][3].untyped_storage().nbytes() // ALIGN) * ALIGN for group in groups.values()]
    arena = Arena(sum(sizes))
    target, start, since_release = arena.bytes.untyped_storage(), arena.start, 0
    with torch.no_grad():
        for size, key in zip(sizes, list(groups), strict=True):
            group = groups.pop(key)
            storage = group[0][3].untyped_storage()
            arena.bytes[start : start + storage.nbytes()].copy_(torch.tensor([], dtype=torch.uint8).set_(storage))
            for owner, name, is_parameter, t in group:
                copy = torch.empty(0, dtype=t.dtype).set_(
                    target, start // t.element_size() + t.storage_offset(), t.shape, t.stride()
                )
                if is_parameter:
                    owner._parameters[name].data = copy
                else:
                    owner._buffers[name] = copy
            del group, storage, t
            start += size
            since_release += size
            if since_release >= RELEASE_EVERY:  # the originals are free once nothing else holds them
                release_freed_memory()
                since_release = 0
    release_freed_memory()
    return arena
