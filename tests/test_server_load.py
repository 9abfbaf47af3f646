"""Load: 32 concurrent streaming clients against `kazeia serve`, about a third of them leaving early.

Every response read to the end must be valid audio of exactly the requested length; no client
may hang; afterwards the server must be idle (no stream, no queue, no extra thread) with its memory
back at the baseline measured after an identical warm-up wave, and it must still serve.
"""

import asyncio
import random
import re
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")
import httpx
from server_support import (
    FRAME_BYTES,
    HEADER_BYTES,
    proc_status,
    sse_audio,
    sse_events,
    start_cli_server,
    stop_process,
    streamed_wav_pcm,
)

CLIENTS = 32
MAX_FRAMES = 12
MEMORY_SLACK_KB = 48 * 1024  # allocator noise; a leak of per-request audio or threads is far larger


@pytest.fixture(scope="module")
def server(tiny_checkpoints, tmp_path_factory):
    log = tmp_path_factory.mktemp("load") / "serve.log"
    args = ("--queue-size", str(CLIENTS), "--max-new-tokens", str(MAX_FRAMES + 1), "--log-level", "warning")
    args += ("--allow-ignore-eos",)  # exact lengths: ignore_eos
    args += ("--admission", "all")  # every client is served, however slow the machine (not a test of admission)
    process, url = start_cli_server(tiny_checkpoints["0.6B-custom"], *args, log=log)
    yield process, url
    stop_process(process)


async def _client(url: str, rng: random.Random, index: int) -> tuple[str, float | None]:
    """One streaming client; returns what happened and its seconds to the first audio byte."""
    kind = rng.choice(["pcm", "wav", "sse"])
    frames = rng.randint(2, MAX_FRAMES)
    body = {"input": f"Client {index} says hello.", "voice": rng.choice(["serena", "ryan", "vivian"])}
    body.update(response_format="wav" if kind == "wav" else "pcm", seed=index)
    body.update(max_new_tokens=frames + 1, ignore_eos=True)  # exactly `frames` frames
    if kind == "sse":
        body["stream_format"] = "sse"
    leave_after = rng.randrange(0, frames * FRAME_BYTES) if rng.random() < 0.35 else None
    started, ttfb = time.perf_counter(), None
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(60)) as client:
        async with client.stream("POST", "/v1/audio/speech", json=body) as response:
            if response.status_code != 200:
                raise AssertionError(f"refused: {response.status_code} {await response.aread()!r}")
            data = b""
            async for piece in response.aiter_bytes():
                data += piece
                if ttfb is None and len(data) > (HEADER_BYTES if kind == "wav" else 0):
                    ttfb = time.perf_counter() - started
                if leave_after is not None and len(data) > leave_after:
                    return "left", ttfb
            if leave_after == 0:
                return "left", ttfb
    _check(kind, data, frames)
    return "completed", ttfb


def _check(kind: str, data: bytes, frames: int) -> None:
    if kind == "wav":
        pcm = streamed_wav_pcm(data)
    elif kind == "sse":
        events = sse_events(data.decode())
        pcm = sse_audio(events)
        assert events[-1]["usage"]["output_tokens"] == frames
    else:
        pcm = data
    assert len(pcm) == frames * FRAME_BYTES, (kind, len(pcm), frames)


async def _wave(url: str, seed: int) -> list[tuple[str, float | None]]:
    rng = random.Random(seed)
    clients = [_client(url, random.Random(rng.random()), i) for i in range(CLIENTS)]
    return await asyncio.wait_for(asyncio.gather(*clients), timeout=240)


def _metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(\S+) (\S+)$", text, re.M)}


def _wait_idle(url: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        health = httpx.get(url + "/health", timeout=10).json()
        if health["active"] == 0 and health["queue_depth"] == 0:
            return
        time.sleep(0.1)
    raise AssertionError(f"the server is still busy 30 s after the clients ended: {health}")


def _settled(pid: int, field: str, target: int) -> int:
    """proc_status(pid, field), waiting up to 30 s (a busy machine) for it to come down to `target`."""
    deadline = time.monotonic() + 30
    while (value := proc_status(pid, field)) > target and time.monotonic() < deadline:
        time.sleep(0.1)
    return value


def test_32_streaming_clients_with_disconnects(server, capsys):
    process, url = server
    warmup = asyncio.run(_wave(url, seed=1))
    assert {outcome for outcome, _ in warmup} <= {"completed", "left"}
    _wait_idle(url)
    rss, threads = proc_status(process.pid, "VmRSS"), proc_status(process.pid, "Threads")
    before = _metrics(url)

    started = time.monotonic()
    results = asyncio.run(_wave(url, seed=2))
    elapsed = time.monotonic() - started
    _wait_idle(url)

    outcomes = [outcome for outcome, _ in results]
    assert outcomes.count("completed") >= CLIENTS // 3 and outcomes.count("left") >= 3
    after = _metrics(url)
    ended = lambda m, outcome: m.get(f'kazeia_utterances_total{{outcome="{outcome}"}}', 0)  # noqa: E731
    assert ended(after, "completed") - ended(before, "completed") >= outcomes.count("completed")
    assert sum(ended(after, o) - ended(before, o) for o in ("completed", "cancelled")) == CLIENTS
    assert ended(after, "failed") == 0
    assert _settled(process.pid, "Threads", threads) == threads
    rss_after = _settled(process.pid, "VmRSS", rss + MEMORY_SLACK_KB)
    assert rss_after <= rss + MEMORY_SLACK_KB, (rss, rss_after)

    check = httpx.post(url + "/v1/audio/speech", json={"input": "Still here.", "voice": "serena",
                       "response_format": "pcm", "max_new_tokens": 3, "ignore_eos": True}, timeout=30)  # fmt: skip
    assert check.status_code == 200 and len(check.content) == 2 * FRAME_BYTES
    ttfbs = sorted(t for outcome, t in results if outcome == "completed")
    with capsys.disabled():
        print(
            f"\nload: {CLIENTS} clients in {elapsed:.1f} s, {outcomes.count('completed')} completed, "
            f"{outcomes.count('left')} left early; first audio p50 {ttfbs[len(ttfbs) // 2]:.2f} s, "
            f"max {ttfbs[-1]:.2f} s (FIFO queue); RSS {rss / 1024:.0f} -> {rss_after / 1024:.0f} MiB; "
            f"threads {threads} -> {threads}"
        )
