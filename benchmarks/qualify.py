"""How many listeners a `kazeia serve` holds: closed-loop clients, each playing its answers as they arrive.

    python benchmarks/qualify.py [--size 0.6B] [--dtype int4] [--vocoder-dtype float32] [--levels 1,2,3,4]
                                 [--requests 3] [--frames 150] [--max-batch 4] [--admission A] [--busy]
                                 [--json F] [--png F]

At each level C, C clients each send `--requests` requests one after the other to a real
`kazeia serve` over HTTP (streaming `pcm`, answers of `--frames` frames: EOS suppressed), and play
each answer as it arrives: playback starts once a buffer of B seconds of audio has arrived (or the
answer is whole), then runs in real time; it stalls when the next audio has not arrived when due.
Per level: the share of answers that stall at each buffer (100, 250, 500, 1000 ms), the safe play-start
(the smallest buffer with which the worst answer never stalls), time to first audio (p50, p95) and to
the response's headers, seconds of audio per wall second over all clients, and errors, refusals
(503: the server's `--admission`, or its full queue) counted among them and apart; a refused client
waits the answer's Retry-After (at most RETRY_CAP_S) before its next request, as a client that
honours it would. A level *holds*
with no stall at a 250 ms buffer and first audio within 0.5 s at p95; C_max is the largest that holds.
`--busy` adds a neighbour process that keeps one core busy. A table on stdout, `--json` the figures,
`--png` a chart of first audio and stalls against C (matplotlib). Exits 1 when a level had errors
other than refusals.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Checkpoints, add_checkpoint_options, machine

RATE, WIDTH = 24000, 2  # the server's pcm: 16-bit mono at 24 kHz
BUFFERS = (0.1, 0.25, 0.5, 1.0)  # seconds of audio a player holds before it starts
HOLDS_BUFFER, HOLDS_TTFA = 0.25, 0.5  # a level holds: no stall at this buffer, first audio p95 within
RETRY_CAP_S = 30.0  # the longest Retry-After a refused client waits before its next request
TEXT = "The quick brown fox jumps over the lazy dog, and then it rests in the warm evening sun."


@dataclass
class Answer:
    """One request as its client saw it: when its audio came (seconds after it was sent)."""

    headers_s: float = 0.0
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (seconds, bytes so far), per piece
    error: str | None = None
    retry_after_s: float = 0.0  # a refusal's Retry-After, what its client waits before asking again

    @property
    def audio_s(self) -> float:
        return self.arrivals[-1][1] / (RATE * WIDTH) if self.arrivals else 0.0

    def stalls(self, buffer_s: float) -> bool:
        """Whether playback with `buffer_s` of audio held before it starts ever runs dry."""
        if not self.arrivals:
            return False
        need = min(buffer_s, self.audio_s) * RATE * WIDTH
        start = next(at for at, got in self.arrivals if got >= need)  # playback begins
        before = 0  # bytes of audio that came before this piece
        for at, got in self.arrivals:
            if at > start + before / (RATE * WIDTH) + 1e-9:
                return True
            before = got
        return False

    def safe_buffer(self) -> float:
        """The smallest buffer (seconds of audio) with which this answer never stalls."""
        sizes = sorted({got / (RATE * WIDTH) for _, got in self.arrivals})
        return next((s for s in sizes if not self.stalls(s)), self.audio_s)


@dataclass
class Level:
    clients: int
    answers: int
    errors: int  # refusals included
    refused: int  # 503: the server's admission or its full queue (Retry-After)
    ttfa_p50_s: float
    ttfa_p95_s: float
    headers_p50_s: float
    audio_per_wall_s: float
    safe_buffer_s: float  # the worst answer's
    stall_share: dict[str, float]  # buffer (ms) -> share of answers that ran dry

    @property
    def holds(self) -> bool:
        return not self.errors and self.stall_share[f"{HOLDS_BUFFER * 1000:g}"] == 0 and self.ttfa_p95_s <= HOLDS_TTFA


async def _ask(http: httpx.AsyncClient, body: dict) -> Answer:
    answer, sent = Answer(), time.perf_counter()
    try:
        async with http.stream("POST", "/v1/audio/speech", json=body) as response:
            answer.headers_s = time.perf_counter() - sent
            if response.status_code != 200:
                answer.error = f"HTTP {response.status_code}"
                answer.retry_after_s = retry_after(response.headers.get("retry-after"))
                return answer
            got = 0
            async for piece in response.aiter_raw():
                got += len(piece)
                answer.arrivals.append((time.perf_counter() - sent, got))
    except httpx.HTTPError as e:
        answer.error = f"{type(e).__name__}: {e}"
    return answer


def retry_after(value: str | None) -> float:
    """Seconds a Retry-After header asks for (its delay form), within 0..RETRY_CAP_S; 0 without one
    or for one that is not a number (an HTTP date: this server sends seconds)."""
    try:
        seconds = float(value) if value is not None else 0.0
    except ValueError:
        return 0.0
    return min(max(seconds, 0.0), RETRY_CAP_S) if seconds == seconds else 0.0


async def _level(
    url: str,
    clients: int,
    requests: int,
    body: dict,
    transport: httpx.AsyncBaseTransport | None = None,
    wait: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> tuple[list[Answer], float]:
    """`clients` closed-loop clients of `requests` requests each -> every answer, and the wall time.
    `transport` and `wait` (how a refused client waits): the network's and the clock's, for tests."""
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600), transport=transport) as http:

        async def client(k: int) -> list[Answer]:
            answers = []
            for n in range(requests):
                answers.append(await _ask(http, {**body, "seed": 1000 * k + n}))
                if answers[-1].retry_after_s and n + 1 < requests:
                    await wait(answers[-1].retry_after_s)  # refused: asked to come back later
            return answers

        started = time.perf_counter()
        answers = await asyncio.gather(*(client(k) for k in range(clients)))
        return [a for each in answers for a in each], time.perf_counter() - started


def _percentile(values: list[float], share: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(share * (len(ordered) - 1))))]


def measure(url: str, clients: int, requests: int, body: dict) -> Level:
    answers, wall = asyncio.run(_level(url, clients, requests, body))
    good = [a for a in answers if a.error is None and a.arrivals]
    ttfa = [a.arrivals[0][0] for a in good]
    stalls = {f"{b * 1000:g}": sum(a.stalls(b) for a in good) / max(1, len(good)) for b in BUFFERS}
    return Level(
        clients,
        len(answers),
        len(answers) - len(good),
        sum(a.error == "HTTP 503" for a in answers),
        statistics.median(ttfa) if ttfa else float("nan"),
        _percentile(ttfa, 0.95),
        statistics.median(a.headers_s for a in good) if good else float("nan"),
        sum(a.audio_s for a in good) / wall,
        max((a.safe_buffer() for a in good), default=float("nan")),
        stalls,
    )


def _serve(model: Path, args, port: int, log: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "kazeia", "serve", "--model", str(model), "--port", str(port)]
    command += ["--dtype", args.dtype, "--vocoder-dtype", args.vocoder_dtype, "--max-batch", str(args.max_batch)]
    command += ["--queue-size", "64", "--max-new-tokens", str(args.frames + 1), "--log-level", "warning"]
    command += ["--allow-ignore-eos"]  # the answers are of --frames frames: EOS suppressed
    if args.admission is not None:
        command += ["--admission", args.admission]
    process = subprocess.Popen(command, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"kazeia serve exited with {process.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return process
        except httpx.TransportError:
            time.sleep(0.5)
    process.kill()
    raise RuntimeError(f"kazeia serve did not answer within 600 s:\n{log.read_text()}")


def _chart(levels: list[Level], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--png needs matplotlib: pip install 'kazeia[benchmarks]'") from None
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    c = [level.clients for level in levels]
    left.plot(c, [level.ttfa_p50_s for level in levels], "o-", label="p50")
    left.plot(c, [level.ttfa_p95_s for level in levels], "s-", label="p95")
    left.axhline(HOLDS_TTFA, color="grey", linestyle=":")
    left.set(xlabel="clients", ylabel="first audio (s)")
    left.legend()
    for buffer in BUFFERS:
        key = f"{buffer * 1000:g}"
        right.plot(c, [100 * level.stall_share[key] for level in levels], "o-", label=f"{key} ms buffer")
    right.set(xlabel="clients", ylabel="answers that stall (%)")
    right.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_checkpoint_options(parser)
    parser.add_argument("--dtype", default="int4")
    parser.add_argument("--vocoder-dtype", default="float32")
    parser.add_argument("--levels", default="1,2,3,4", help="numbers of clients, comma-separated")
    parser.add_argument("--requests", type=int, default=3, help="requests each client sends at a level")
    parser.add_argument("--frames", type=int, default=150, help="frames (80 ms) of every answer")
    parser.add_argument("--max-batch", type=int, default=4)
    parser.add_argument("--admission", choices=("measured", "behind", "all"), help="the server's (default: its own)")
    parser.add_argument("--busy", action="store_true", help="a neighbour process keeps one core busy")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--png", help="draw first audio and stalls against clients here")
    parser.add_argument("--port", type=int, default=8765)
    args = parser.parse_args()
    log = Path(os.environ.get("TMPDIR", "/tmp")) / "kazeia-qualify-server.log"
    url = f"http://127.0.0.1:{args.port}"
    body = {"input": TEXT, "voice": "serena", "response_format": "pcm", "ignore_eos": True}
    body["max_new_tokens"] = args.frames + 1
    with Checkpoints(args) as checkpoints:
        server = _serve(checkpoints.prepared(args.dtype), args, args.port, log)
        busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.busy else None
        try:
            measure(url, 1, 1, body)  # warm-up: the first request's one-off costs are not a level's
            levels = [measure(url, int(c), args.requests, body) for c in args.levels.split(",")]
        finally:
            for process in (busy, server):
                if process is not None:
                    process.terminate()
                    process.wait(30)
    print(f"# {machine()['cpu']}; {checkpoints.label}; {args.dtype}, vocoder {args.vocoder_dtype}, max-batch "
          f"{args.max_batch}, {args.frames}-frame answers{', one busy neighbour' if args.busy else ''}")  # fmt: skip
    head = "C  answers errors refused  ttfa_p50  ttfa_p95  headers  audio/s  safe_buffer  " + "  ".join(
        f"stall@{b * 1000:g}ms" for b in BUFFERS
    )
    print(head)
    for level in levels:
        stalls = "  ".join(f"{100 * level.stall_share[f'{b * 1000:g}']:10.0f}%" for b in BUFFERS)
        print(f"{level.clients:<2} {level.answers:7} {level.errors:6} {level.refused:7}  {level.ttfa_p50_s:8.3f}  "
              f"{level.ttfa_p95_s:8.3f}  {level.headers_p50_s:7.3f}  {level.audio_per_wall_s:7.2f}  "
              f"{level.safe_buffer_s:11.3f}  {stalls}{'  holds' if level.holds else ''}")  # fmt: skip
    held = [level.clients for level in levels if level.holds]
    print(f"C_max = {max(held) if held else 0}")
    if args.json:
        data = {"machine": machine(), "args": vars(args), "levels": [asdict(level) for level in levels]}
        Path(args.json).write_text(json.dumps(data, indent=2))
    if args.png:
        _chart(levels, args.png)
    return 1 if any(level.errors > level.refused for level in levels) else 0


if __name__ == "__main__":
    raise SystemExit(main())
