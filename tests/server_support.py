"""Helpers for the server tests: live servers on 127.0.0.1, and readers of what they send."""

from __future__ import annotations

import base64
import json
import os
import queue
import re
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np

from kazeia.audio import pcm16
from kazeia.live import TextFeed
from kazeia.server.job import Job

FRAME_BYTES = 1920 * 2  # one 80 ms frame of 16-bit PCM
HEADER_BYTES = 44
HOLD_LIMIT_S = 300.0  # a hold a test forgot to lift ends here (the test then fails on what follows)


class HeldJobs:
    """A gate around the server's worker, from outside the server: while it is installed (a `with`
    block), each utterance hands its first `free` pieces of audio to its client, then the worker
    waits before the next one (in `Job.put`, where it also waits for a client that reads slowly)
    until `release()`, or until that job is cancelled (its client left, a `cancel` message, the
    server stopping), whereupon it ends at once. An utterance therefore cannot end before the test
    lets it, however fast the machine, and a test of admission or cancellation never races the
    work. Meanwhile generation runs at most its stream's look-ahead past what the worker took
    (kazeia/streaming.py): a few frames with the scheduler, 64 without.

    A job at the gate is a client holding enough audio: never behind real time meanwhile, so a
    held stream's wall time can never make the admission refuse (server/worker.py), however slow
    the machine. `as_client=False` leaves its pace to the worker's clock (tests of being behind).

    Non-goal: holding anything but the server's own jobs (the engine's streams are untouched)."""

    def __init__(self, free: int = 1, as_client: bool = True):
        self.free, self.as_client = free, as_client
        self._cond = threading.Condition()
        self._open = False
        self._given: dict[int, int] = {}  # job id -> pieces of audio let through
        self.held: set[int] = set()  # ids of the jobs waiting at the gate now

    def __enter__(self) -> HeldJobs:
        put, cancel = Job.put, Job.cancel

        def held_put(job: Job, item) -> None:
            if isinstance(item, bytes):
                self._turn(job)
            put(job, item)

        def noticed_cancel(job: Job) -> None:
            cancel(job)
            with self._cond:
                self._cond.notify_all()

        self._originals = put, cancel
        Job.put, Job.cancel = held_put, noticed_cancel  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc) -> None:
        self.release()
        Job.put, Job.cancel = self._originals  # type: ignore[method-assign]

    def _turn(self, job: Job) -> None:
        with self._cond:
            given = self._given.get(job.id, 0)
            if given >= self.free:
                self.held.add(job.id)
                job._full = self.as_client  # as when its client holds enough audio (Job.late_s)
                self._cond.notify_all()
                self._cond.wait_for(lambda: self._open or job.cancelled, HOLD_LIMIT_S)
                job._full = False
                self.held.discard(job.id)
            self._given[job.id] = given + 1

    def wait_held(self, count: int = 1, timeout: float = 60.0) -> None:
        """Block until `count` jobs wait at the gate (each has sent its first pieces)."""
        with self._cond:
            assert self._cond.wait_for(lambda: len(self.held) >= count, timeout), f"{len(self.held)} held"

    def release(self) -> None:
        """Open the gate for good: every job goes on to its end."""
        with self._cond:
            self._open = True
            self._cond.notify_all()


class TextStarved:
    """Tells when a live text's reader (the engine) finds no text waiting: while installed, every
    `TextFeed.get` that times out sets `event`. Clear it, then wait on it, to know that the engine
    has caught up with the text sent so far and waits for more."""

    def __enter__(self) -> threading.Event:
        get = TextFeed.get
        self.event = threading.Event()

        def watched(feed: TextFeed, timeout: float):
            try:
                return get(feed, timeout)
            except queue.Empty:
                self.event.set()
                raise

        self._original = get
        TextFeed.get = watched  # type: ignore[method-assign]
        return self.event

    def __exit__(self, *exc) -> None:
        TextFeed.get = self._original  # type: ignore[method-assign]


class LiveServer:
    """A real uvicorn serving `app` from a thread, on a socket bound to a free 127.0.0.1 port."""

    def __init__(self, app):
        import uvicorn

        self.app = app
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind(("127.0.0.1", 0))
        self.port = self.socket.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.socket.close()
        assert not self.thread.is_alive(), "uvicorn did not stop"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_cli_server(checkpoint: Path, *args: str, log: Path) -> tuple[subprocess.Popen, str]:
    """`kazeia serve` in a child process; returns it once /health answers."""
    port = free_port()
    command = [sys.executable, "-m", "kazeia", "serve", "--model", str(checkpoint), "--port", str(port), *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(command, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"kazeia serve exited with {process.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return process, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    process.kill()
    raise RuntimeError(f"kazeia serve did not answer within 120 s:\n{log.read_text()}")


def stop_process(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(20)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(10)


def proc_status(pid: int, field: str) -> int:
    """A number from /proc/PID/status, e.g. VmRSS (kB) or Threads."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def streamed_wav_pcm(data: bytes) -> bytes:
    """Check a streamed WAV's 44-byte header (16-bit mono 24 kHz, sizes unknown) and return its PCM."""
    assert data[:4] == b"RIFF" and data[8:16] == b"WAVEfmt " and data[36:40] == b"data"
    riff, fmt_size = struct.unpack("<I", data[4:8])[0], struct.unpack("<I", data[16:20])[0]
    tag, channels, rate, byte_rate, align, bits = struct.unpack("<HHIIHH", data[20:36])
    assert (fmt_size, tag, channels, rate, byte_rate, align, bits) == (16, 1, 1, 24000, 48000, 2, 16)
    assert riff == 0xFFFFFFFF and struct.unpack("<I", data[40:44])[0] == 0xFFFFFFFF
    return data[HEADER_BYTES:]


def sse_events(body: str) -> list[dict]:
    """The JSON payloads of a `text/event-stream` body made of `data:` lines."""
    events = []
    for block in body.split("\n\n"):
        lines = [line for line in block.split("\n") if line]
        if lines:
            assert all(line.startswith("data: ") for line in lines), lines
            events.append(json.loads("".join(line[len("data: ") :] for line in lines)))
    return events


def sse_audio(events: list[dict]) -> bytes:
    assert events[-1]["type"] == "speech.audio.done"
    assert all(e["type"] == "speech.audio.delta" for e in events[:-1])
    return b"".join(base64.b64decode(e["audio"]) for e in events[:-1])


def assert_pcm_equal(got: bytes, expected: bytes) -> None:
    """The same samples, bit for bit (streamed, batched and offline audio are one byte stream);
    on a difference, where the first one is."""
    assert len(got) == len(expected), (len(got), len(expected))
    a, b = np.frombuffer(got, "<i2"), np.frombuffer(expected, "<i2")
    differ = np.flatnonzero(a != b)
    assert not len(differ), f"{len(differ)} samples differ, the first at {differ[0]}: {a[differ[0]]} != {b[differ[0]]}"


def offline_pcm(engine, text: str, **options) -> bytes:
    """What the server should send for this text: the engine's own synthesis as 16-bit PCM."""
    return pcm16(engine.synthesize(text, **options).audio)


def ws_receive(ws) -> dict | bytes:
    """The next message of a test WebSocket: a dict for JSON events, bytes for audio."""
    message = ws.receive()
    if message.get("bytes") is not None:
        return message["bytes"]
    return json.loads(message["text"])


def llm_tokens(text: str) -> list[str]:
    """Pieces like an LLM's tokens: words with their leading space, long words cut in two."""
    tokens = []
    for word in re.findall(r"\s*\S+", text):
        tokens += [word[:4], word[4:]] if len(word) > 6 else [word]
    return tokens


def whole_text_pcm(engine, text: str, **options) -> bytes:
    """What the server must send: the engine's stream of the whole text, streaming text layout."""
    with engine.stream(text, non_streaming_mode=False, first_chunk_frames=1, chunk_frames=4, **options) as stream:
        return b"".join(pcm16(chunk.audio) for chunk in stream)
