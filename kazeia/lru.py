"""A least-recently-used map with a bound on its total size: the one kind of cache the engine keeps
of what voices make (the talker's keys and values over a voice's prompt positions, kazeia/frame.py;
an ICL voice's primed vocoder state, kazeia/voices.py). Thread-safe; values are kept as given."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class LRU(Generic[K, V]):
    """At most `limit` in total, each entry counting `size(key, value)` (1 by default: `limit` is
    then a number of entries); the least recently used go first. An entry larger than `limit` is
    not kept."""

    def __init__(self, limit: int, size: Callable[[K, V], int] | None = None):
        self.limit = limit
        self.total = 0  # what the entries count for now
        self._size = size or (lambda key, value: 1)
        self._entries: OrderedDict[K, tuple[V, int]] = OrderedDict()  # key -> (value, its size)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: K) -> V | None:
        """The value kept for `key` (now the most recently used), or None."""
        with self._lock:
            found = self._entries.get(key)
            if found is None:
                return None
            self._entries.move_to_end(key)
            return found[0]

    def put(self, key: K, value: V) -> None:
        """Keep `value` for `key` (a key kept already keeps its first value), dropping the least
        recently used entries beyond `limit`."""
        size = self._size(key, value)
        with self._lock:
            if size > self.limit or key in self._entries:
                return
            self._entries[key] = value, size
            self.total += size
            while self.total > self.limit:
                self.total -= self._entries.popitem(last=False)[1][1]

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.total = 0
