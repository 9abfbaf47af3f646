"""Clients that misbehave, for the bounds tests: `kazeia wyoming` in a child process (ended by its
PID; `kazeia serve` is server_support's), raw sockets that send what they like and read when they
like (or never), and waits bounded in time that poll a condition rather than sleep a guess."""

from __future__ import annotations

import json
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from server_support import free_port

SMALL_BUFFER = 4096  # bytes: the receive buffer of a client that never reads (the kernel's floor)


def start_wyoming(checkpoint: Path, *args: str, log: Path) -> tuple[subprocess.Popen, int]:
    """`kazeia wyoming` on tcp://127.0.0.1:PORT in a child process; returns it once it accepts."""
    port = free_port()
    uri = f"tcp://127.0.0.1:{port}"
    command = [sys.executable, "-m", "kazeia", "wyoming", "--model", str(checkpoint), "--uri", uri, *args]
    process = subprocess.Popen(command, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"kazeia wyoming exited with {process.returncode}:\n{log.read_text()}")
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return process, port
        time.sleep(0.2)
    process.kill()
    raise RuntimeError(f"kazeia wyoming did not accept within 120 s:\n{log.read_text()}")


def wait_for(check: Callable[[], object], seconds: float, what: str, every: float = 0.2):
    """Poll `check` until it returns something true (returned), failing after `seconds`."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            result = check()
        except (OSError, ValueError):
            result = None
        if result:
            return result
        assert time.monotonic() < deadline, f"{what}: not within {seconds:g} s"
        time.sleep(every)


def deaf_socket(port: int) -> socket.socket:
    """A connection with the smallest receive buffer, for a client that will never read."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SMALL_BUFFER)
    sock.connect(("127.0.0.1", port))
    return sock


def peek(sock: socket.socket, count: int) -> bytes:
    """The first `count` bytes received so far, left unread (b"" if none yet)."""
    try:
        return sock.recv(count, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return b""


def reset(sock: socket.socket) -> None:
    """Close with a TCP reset (SO_LINGER 0), as a client that crashes does."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def http_post(path: str, body: dict, headers: dict[str, str] | None = None) -> bytes:
    """The bytes of an HTTP/1.1 POST of `body` as JSON."""
    data = json.dumps(body).encode()
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json"]
    lines += [f"Content-Length: {len(data)}", *(f"{k}: {v}" for k, v in (headers or {}).items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + data


def read_all(sock: socket.socket, seconds: float) -> tuple[bytes, bool]:
    """Everything `sock` receives until the peer closes it: (bytes, whether it was reset), failing
    after `seconds`."""
    sock.settimeout(seconds)
    chunks, deadline = [], time.monotonic() + seconds
    try:
        while True:
            assert time.monotonic() < deadline, f"the server did not close the connection within {seconds:g} s"
            chunk = sock.recv(1 << 16)
            if not chunk:
                return b"".join(chunks), False
            chunks.append(chunk)
    except ConnectionResetError:
        return b"".join(chunks), True


def wyoming_event(kind: str, data: dict | None = None, payload: bytes = b"", raw_data: bytes | None = None) -> bytes:
    """The bytes of one Wyoming event (`raw_data`: data bytes as they are, JSON or not)."""
    data_bytes = raw_data if raw_data is not None else (json.dumps(data).encode() if data else b"")
    header: dict = {"type": kind, "version": "1.5.0"}
    if data_bytes:
        header["data_length"] = len(data_bytes)
    if payload:
        header["payload_length"] = len(payload)
    return json.dumps(header).encode() + b"\n" + data_bytes + payload


class WyomingClient:
    """A blocking Wyoming client on one raw socket."""

    def __init__(self, port: int):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        self.buffer = b""

    def send(self, kind: str, data: dict | None = None, **extra) -> None:
        self.sock.sendall(wyoming_event(kind, data, **extra))

    def _take(self, count: int | None, seconds: float) -> bytes | None:
        """`count` bytes (None: up to the next newline, included), or None at the end of the stream."""
        self.sock.settimeout(seconds)
        while True:
            if count is None and b"\n" in self.buffer:
                line, self.buffer = self.buffer.split(b"\n", 1)
                return line
            if count is not None and len(self.buffer) >= count:
                taken, self.buffer = self.buffer[:count], self.buffer[count:]
                return taken
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                return None
            self.buffer += chunk

    def read(self, seconds: float = 60) -> tuple[str, dict, bytes] | None:
        """The next event as (type, data, payload); None once the server has closed the connection."""
        line = self._take(None, seconds)
        if line is None:
            return None
        header = json.loads(line)
        data = header.get("data") or {}
        if header.get("data_length"):
            data = {**data, **json.loads(self._take(header["data_length"], seconds) or b"{}")}
        payload = self._take(header["payload_length"], seconds) if header.get("payload_length") else b""
        return header["type"], data, payload or b""

    def read_until(self, *kinds: str, seconds: float = 120) -> list[tuple[str, dict, bytes]]:
        """Events up to and including the first of one of `kinds`."""
        events, deadline = [], time.monotonic() + seconds
        while True:
            event = self.read(max(0.1, deadline - time.monotonic()))
            assert event is not None, f"the connection ended before {kinds}: {[e[0] for e in events]}"
            events.append(event)
            if event[0] in kinds:
                return events

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> WyomingClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
