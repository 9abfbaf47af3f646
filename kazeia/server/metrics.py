"""Prometheus metrics in the text exposition format (version 0.0.4), written out by hand.

Three kinds are enough here: counters with labels, gauges read from a function at scrape time, and
histograms with fixed buckets. Writing the format directly keeps the server extra to FastAPI and
uvicorn; the format is a few lines per metric (https://prometheus.io/docs/instrumenting/exposition_formats/).
Updates come from the event loop and from the worker thread, so every change takes one lock.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _labels(pairs: tuple[tuple[str, str], ...]) -> str:
    if not pairs:
        return ""
    escaped = (v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") for _, v in pairs)
    return "{" + ",".join(f'{k}="{v}"' for (k, _), v in zip(pairs, escaped, strict=True)) + "}"


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


class Counter:
    def __init__(self, name: str, help: str, labels: tuple[str, ...] = ()):
        self.name, self.help, self.label_names = name, help, labels
        self._values: dict[tuple[tuple[str, str], ...], float] = {}
        self._lock = threading.Lock()

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        if sorted(labels) != sorted(self.label_names):
            raise ValueError(f"{self.name} takes labels {self.label_names}, got {tuple(labels)}")
        key = tuple((n, str(labels[n])) for n in self.label_names)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def value(self, **labels: str) -> float:
        key = tuple((n, str(labels[n])) for n in self.label_names)
        with self._lock:
            return self._values.get(key, 0.0)

    def render(self) -> list[str]:
        with self._lock:
            values = sorted(self._values.items())
        if not self.label_names and not values:
            values = [((), 0.0)]
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter"]
        return lines + [f"{self.name}{_labels(k)} {_number(v)}" for k, v in values]


class Gauge:
    def __init__(self, name: str, help: str, read: Callable[[], float]):
        self.name, self.help, self.read = name, help, read

    def render(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} gauge", f"{self.name} {_number(self.read())}"]


class Histogram:
    def __init__(self, name: str, help: str, buckets: tuple[float, ...]):
        self.name, self.help = name, help
        self.bounds = tuple(sorted(buckets)) + (math.inf,)
        self._counts = [0] * len(self.bounds)  # observations <= each bound (cumulative at render)
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        with self._lock:
            self._sum += value
            for i, bound in enumerate(self.bounds):
                if value <= bound:
                    self._counts[i] += 1
                    break

    @property
    def count(self) -> int:
        with self._lock:
            return sum(self._counts)

    def render(self) -> list[str]:
        with self._lock:
            counts, total = list(self._counts), self._sum
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        running = 0
        for bound, n in zip(self.bounds, counts, strict=True):
            running += n
            lines.append(f'{self.name}_bucket{{le="{_number(bound)}"}} {running}')
        return lines + [f"{self.name}_sum {_number(total)}", f"{self.name}_count {running}"]


class ServerMetrics:
    """Everything `GET /metrics` reports; the gauges' functions are read at scrape time."""

    def __init__(
        self,
        queue_depth: Callable[[], int],
        active: Callable[[], int],
        behind: Callable[[], int],
        admits: Callable[[], int],
    ):
        self.requests = Counter("kazeia_requests_total", "Speech requests received (WebSocket: texts).", ("route",))
        self.errors = Counter(
            "kazeia_request_errors_total", "Requests refused or failed, by HTTP status.", ("route", "status")
        )
        self.utterances = Counter(
            "kazeia_utterances_total", "Utterances that ended, by outcome.", ("outcome",)
        )  # completed | cancelled | failed
        self.audio_seconds = Counter("kazeia_audio_seconds_total", "Seconds of audio generated.")
        self.fell_behind = Counter(
            "kazeia_streams_fell_behind_total",
            "Utterances whose audio came later than a listener behind a 250 ms buffer plays it (once each).",
        )
        self.ttfb = Histogram(
            "kazeia_ttfb_seconds",
            "Request arrival to first audio, queue wait included.",
            (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 3, 5, 10, 30),
        )
        self.rtf = Histogram(
            "kazeia_rtf",
            "Real-time factor of completed utterances (generation wall time / audio time).",
            (0.1, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 3, 5),
        )
        self.queue_wait = Histogram(
            "kazeia_queue_wait_seconds",
            "Request arrival until generation starts.",
            (0.01, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30, 60),
        )
        self.batch_size = Histogram(
            "kazeia_batch_size", "Utterances in each batched frame step (--max-batch > 1).", (1, 2, 3, 4, 6, 8, 12, 16)
        )
        self._gauges = (
            Gauge("kazeia_streams_active", "Utterances admitted and not finished (waiting or generating).", active),
            Gauge("kazeia_queue_depth", "Utterances waiting for the worker.", queue_depth),
            Gauge("kazeia_streams_behind", "Utterances behind real time now (a 250 ms buffer would be dry).", behind),
            Gauge(
                "kazeia_streams_admitted_at_most",
                "Utterances at once the admission lets in now (measured: what the server's pace holds).",
                admits,
            ),
        )

    def render(self) -> str:
        parts = (self.requests, self.errors, self.utterances, self.audio_seconds, self.fell_behind,
                 *self._gauges, self.ttfb, self.rtf, self.queue_wait, self.batch_size)  # fmt: skip
        return "\n".join(line for part in parts for line in part.render()) + "\n"
