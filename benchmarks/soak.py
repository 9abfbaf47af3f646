"""Soak: the servers under a crowd of careful, careless and hostile clients for minutes, then checked.

    python benchmarks/soak.py [--seconds 180] [--clients 32] [--model DIR]

Starts `kazeia serve` and `kazeia wyoming` (--max-batch 4 each; a tiny random checkpoint unless
`--model`) and, after a warm-up, runs `--clients` clients at once for `--seconds`, spread over HTTP
(pcm, wav, SSE, `stream: false`), WebSocket (whole texts, live texts sent in deltas, live texts that
go idle until `--text-timeout` ends them) and Wyoming (whole texts and streams). A quarter of the
requests are left at a random point; 4 clients never read a byte (2 HTTP, 2 Wyoming); and once per
class the triggers of the hostile-client issue are sent (lone surrogates, NaN, a megabyte name, a
control token split between deltas, empty deltas by the thousand, a live text over its tokens,
ignore_eos amplification, FLAC over `max_response_bytes`, a WebSocket message over its limit,
`?api%5Fkey=`, a numeric model, Wyoming pings with surrogates or of a megabyte never read, and a
Wyoming client that resets at once).

The warm-up is one request of each kind, then the crowd for a third of `--seconds` (at most a
minute), so that the level it leaves holds what a busy server holds. Then, with every client gone:
stuck jobs (`/health` active and queued), held slots (each server's open sockets against their
number after the warm-up; the clients that never read must have been dropped by the server), each
server's RSS against its level after the warm-up (+50 MB at most),
and every completed answer replayed alone, one after the other, which must give the same bytes.
Prints one line per figure and exits 1 if a check fails. Not a test: it runs for minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from common import machine
from websockets.asyncio.client import connect

KEY = "soak-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
TEXTS = [
    "Hello there, this is a soak test.",
    "The kitchen lights are on now.",
    "Numbers like 3.14 and 42 are read aloud.",
    "A longer sentence, with a comma, goes on for a while before it ends.",
]
STALL_S = 5.0
KINDS = ("http", "http", "ws", "ws-live", "wyoming", "wyoming-stream")  # HTTP twice: its formats
RSS_SLACK_KB = 50 * 1024


# -- the servers ---------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(command: list[str], log: Path, ready) -> subprocess.Popen:
    process = subprocess.Popen(command, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 180
    while not ready():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise SystemExit(f"{command[3]} did not start:\n{log.read_text()}")
        time.sleep(0.2)
    return process


def accepts(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def proc_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def sockets(pid: int) -> int:
    count = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            count += fd.readlink().name.startswith("socket:")
        except OSError:
            pass
    return count


# -- one request of each kind: (kind, request) -> bytes of a completed answer, or None if left -------
class NotCompleted(Exception):
    """The server answered without the whole audio; the reason (a status or an error code)."""


async def http_answer(url: str, body: dict, leave: float | None) -> bytes | None:
    """A speech request's audio (SSE: the decoded deltas); None if it was left."""
    async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=600) as client:
        async with client.stream("POST", "/v1/audio/speech", json=body) as r:
            if r.status_code != 200:
                raise NotCompleted(f"HTTP {r.status_code}")
            data = b""
            async for piece in r.aiter_bytes():
                data += piece
                if leave is not None and len(data) >= leave:
                    return None
    if body.get("stream_format") == "sse":
        events = [json.loads(line[6:]) for line in data.decode().split("\n") if line.startswith("data: ")]
        if not events or events[-1]["type"] != "speech.audio.done":
            raise NotCompleted(f"SSE {events[-1].get('error', {}).get('code') if events else 'nothing'}")
        return b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")
    return data


async def ws_answer(url: str, session: dict, messages: list[dict], leave: float | None, idle: bool = False):
    """The audio of the utterance `messages` make (whole or live); None if left."""
    ws_url = url.replace("http", "ws") + "/v1/audio/speech/stream?api_key=" + KEY
    async with connect(ws_url, max_size=None) as ws:
        await ws.send(json.dumps({"type": "session.update", "session": session}))
        for message in messages:
            await ws.send(json.dumps(message))
            if message["type"] == "input_text.append":
                await asyncio.sleep(random.uniform(0, 0.05))
        return await _ws_until(ws, None if idle else leave)  # an idle live text: text_timeout ends it


async def _ws_until(ws, leave: float | None) -> bytes | None:
    audio = b""
    async for message in ws:
        if isinstance(message, bytes):
            audio += message
            if leave is not None and len(audio) >= leave:
                return None
            continue
        event = json.loads(message)
        if event["type"] == "error" and event.get("utterance") is not None:
            raise NotCompleted(f"WebSocket {event['error']['code']}")
        if event["type"] == "audio.done":
            if event["status"] != "completed":
                raise NotCompleted(f"WebSocket {event['status']}")
            return audio
    raise NotCompleted("WebSocket closed")


def wyoming_event(kind: str, data: dict | None = None) -> bytes:
    raw = json.dumps(data).encode() if data else b""
    header = {"type": kind, **({"data_length": len(raw)} if raw else {})}
    return json.dumps(header).encode() + b"\n" + raw


async def wyoming_answer(port: int, events: list[tuple[str, dict]], leave: float | None) -> bytes | None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for kind, data in events:
            writer.write(wyoming_event(kind, data))
            await writer.drain()
        audio = b""
        while True:
            line = await asyncio.wait_for(reader.readline(), 600)
            if not line:
                raise NotCompleted("Wyoming connection closed")
            header = json.loads(line)
            data = json.loads(await reader.readexactly(header["data_length"])) if header.get("data_length") else {}
            payload = await reader.readexactly(header["payload_length"]) if header.get("payload_length") else b""
            if header["type"] == "error":
                raise NotCompleted(f"Wyoming {data.get('code')}")
            audio += payload
            if leave is not None and len(audio) >= leave:
                return None
            whole_text_done = header["type"] == "audio-stop" and events[0][0] == "synthesize"
            if whole_text_done or header["type"] == "synthesize-stopped":
                return audio
            del data  # (the events' fields are not needed, only their audio)
    finally:
        writer.close()


# -- the crowd -----------------------------------------------------------------------------------
def random_request(rng: random.Random) -> tuple[str, tuple]:
    """A request of a random kind, as what replays it: (kind, arguments)."""
    text, seed, frames = rng.choice(TEXTS), rng.randrange(1 << 30), rng.randint(6, 30)
    kind = rng.choice(KINDS)
    if kind == "http":
        body = {"input": text, "voice": rng.choice(["serena", "ryan"]), "seed": seed, "max_new_tokens": frames}
        format, stream = rng.choice([("pcm", "audio"), ("wav", "audio"), ("pcm", "sse"), ("wav", None)])
        body["response_format"] = format
        if stream is None:
            body["stream"] = False
        else:
            body["stream_format"] = stream
        return kind, (body,)
    session = {"voice": "vivian", "seed": seed, "max_new_tokens": frames, "non_streaming_mode": False}
    if kind == "ws":
        return kind, (session, [{"type": "input_text", "text": text}])
    if kind == "ws-live":
        pieces = [text[i : i + 5] for i in range(0, len(text), 5)]
        deltas = [{"type": "input_text.append", "text": p} for p in pieces]
        return kind, (session, [*deltas, {"type": "input_text.end"}])
    if kind == "wyoming":
        return kind, ([("synthesize", {"text": text})],)
    chunks = [("synthesize-chunk", {"text": w + " "}) for w in text.split()]
    return kind, ([("synthesize-start", {}), *chunks, ("synthesize-stop", {})],)


async def run(kind: str, args: tuple, urls: dict, leave: float | None) -> bytes | None:
    if kind == "http":
        return await http_answer(urls["http"], *args, leave)
    if kind.startswith("ws"):
        return await ws_answer(urls["http"], *args, leave)
    return await wyoming_answer(urls["wyoming"], *args, leave)


async def client(index: int, urls: dict, until: float, done: list, counts: dict) -> None:
    rng = random.Random(index)
    while time.monotonic() < until:
        kind, args = random_request(rng)
        leave = rng.uniform(0, 20_000) if rng.random() < 0.25 else None
        if kind == "ws-live" and rng.random() < 0.1:  # a live text that goes idle
            session, messages = args
            await _counted(counts, "idle live texts", ws_answer(urls["http"], session, messages[:2], None, idle=True))
            continue
        try:
            answer = await run(kind, args, urls, leave)
        except NotCompleted as why:
            answer, outcome = None, f"not completed: {why}"
        except (OSError, httpx.HTTPError, asyncio.TimeoutError, ValueError) as error:
            answer, outcome = None, f"client error ({type(error).__name__})"
        else:
            outcome = "left" if leave is not None else "completed"
        counts[outcome] = counts.get(outcome, 0) + 1
        if answer is not None and leave is None:
            done.append((kind, args, answer))


async def _counted(counts: dict, name: str, work) -> None:
    try:
        await work
    except NotCompleted as why:
        name = f"{name}: {why}"
    except (OSError, httpx.HTTPError, asyncio.TimeoutError, ValueError) as error:
        name = f"{name}: client error ({type(error).__name__})"
    counts[name] = counts.get(name, 0) + 1


def deaf(port: int, data: bytes) -> socket.socket:
    """A client that sends `data` and never reads (its receive buffer at the kernel's floor)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.sendall(data)
    return sock


def dropped(sock: socket.socket) -> bool:
    """Whether the server has closed or reset this connection (reading what is left of it)."""
    sock.settimeout(0.5)
    try:
        while sock.recv(1 << 20):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


# -- one of each hostile class --------------------------------------------------------------------
async def hostile(urls: dict, outcomes: dict) -> None:
    """Each trigger once; `outcomes[name]`: what it got (a status, an event type or code)."""
    http, port = urls["http"], urls["wyoming"]
    async with httpx.AsyncClient(base_url=http, headers=AUTH, timeout=120) as c:
        raw = {
            "surrogate key": '{"input": "Hi.", "voice": "serena", "\\ud800": 1}',
            "NaN": '{"input": "Hi.", "voice": -Infinity}',
            "megabyte name": json.dumps({"input": "Hi.", "voice": "v" * 1_000_000}),
            "numeric model": '{"input": "Hi.", "voice": "serena", "model": 5}',
            "ignore_eos amplification": json.dumps(
                {"input": "a.\n\n" * 1000, "voice": "serena", "ignore_eos": True, "max_new_tokens": 4096}
            ),
            "flac over max_response_bytes": json.dumps(
                {
                    "input": "Hi.",
                    "voice": "serena",
                    "ignore_eos": True,
                    "max_new_tokens": 3000,
                    "response_format": "flac",
                    "stream": False,
                }
            ),  # fmt: skip
        }
        for name, body in raw.items():
            r = await c.post("/v1/audio/speech", content=body, headers={"Content-Type": "application/json"})
            outcomes[name] = r.status_code
    ws_url = http.replace("http", "ws") + "/v1/audio/speech/stream?api%5Fkey=" + KEY
    async with connect(ws_url, max_size=None) as ws:
        await ws.send(json.dumps({"type": "session.update", "session": {"voice": "serena", "max_new_tokens": 12}}))
        for delta in ("Hello <|im_", "end|> there", *[""] * 10_000):
            await ws.send(json.dumps({"type": "input_text.append", "text": delta}))
        await ws.send(json.dumps({"type": "input_text.end"}))
        await ws.send(json.dumps({"type": "input_text", "text": "x" * (1 << 20)}))
        for _ in range(2):
            await ws.send(json.dumps({"type": "input_text.append", "text": "\U00020000" * 1500}))
        await ws.send(json.dumps({"type": "input_text.end"}))
        names = {1: "split control token, 10k empty deltas", None: "message over 1 MiB", 2: "live text over its tokens"}
        while not set(names.values()) <= set(outcomes):
            message = await asyncio.wait_for(ws.recv(), 120)
            event = json.loads(message) if isinstance(message, str) else {"type": "audio"}
            if event["type"] in ("audio.done", "error"):  # by utterance: 1, 2, or none (a refused message)
                outcomes[names[event.get("utterance")]] = event.get("status") or event["error"]["code"]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b'{"type": "ping", "data": {"text": "\\ud800"}}\n')
    await writer.drain()
    outcomes["Wyoming ping with a surrogate"] = json.loads(await reader.readline()).get("type")
    writer.close()
    rst = socket.create_connection(("127.0.0.1", port))
    rst.sendall(wyoming_event("synthesize", {"text": TEXTS[3] * 4}))
    rst.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    rst.close()
    outcomes["Wyoming reset at once"] = "sent"


async def soak(urls: dict, seconds: float, clients: int) -> tuple[list, dict, dict, list]:
    done: list = []
    counts: dict = {}
    outcomes: dict = {}
    until = time.monotonic() + seconds
    long = {"input": TEXTS[3] * 3, "voice": "serena", "max_new_tokens": 3000, "speed": 0.25, "response_format": "pcm"}
    body = json.dumps(long).encode()
    request = (
        b"POST /v1/audio/speech HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    never_read = [deaf(urls["http_port"], request) for _ in range(2)]
    never_read += [deaf(urls["wyoming"], wyoming_event("synthesize", {"text": TEXTS[3] * 3})) for _ in range(2)]
    never_read += [deaf(urls["wyoming"], wyoming_event("ping", {"text": "p" * 900_000}) * 8)]
    crowd = [client(i, urls, until, done, counts) for i in range(clients - len(never_read))]
    await asyncio.gather(hostile(urls, outcomes), *crowd)
    return done, counts, outcomes, never_read


# -- the checks -----------------------------------------------------------------------------------
async def settle(urls: dict, pids: dict, baseline: dict, seconds: float = 120) -> dict:
    """Once every client is gone: jobs still admitted, sockets above the warm-up's, RSS growth."""
    deadline, figures = time.monotonic() + seconds, {}
    while True:
        async with httpx.AsyncClient(base_url=urls["http"], headers=AUTH, timeout=30) as c:
            health = (await c.get("/health", headers={"Connection": "close"})).json()
        await asyncio.sleep(0.5)  # (the server closes that connection in its own time)
        held = {name: sockets(pid) - baseline[name]["sockets"] for name, pid in pids.items()}
        if (health["active"] == 0 and max(held.values()) <= 0) or time.monotonic() > deadline:
            break
    figures["stuck jobs (HTTP server)"] = health["active"] + health["queue_depth"]
    for name, pid in pids.items():
        figures[f"held sockets ({name})"] = max(0, held[name])
        figures[f"RSS growth after warm-up ({name}, MB)"] = (proc_kb(pid, "VmRSS") - baseline[name]["rss"]) / 1024
    return figures


async def replay(urls: dict, done: list) -> tuple[int, int]:
    """Every completed answer again, alone: (identical, different)."""
    same = 0
    for kind, args, answer in done:
        try:
            same += await run(kind, args, urls, None) == answer
        except NotCompleted:
            pass
    return same, len(done) - same


async def warm_up(urls: dict, clients: int, seconds: float) -> None:
    """One request of each kind alone, then the crowd for `seconds`: the RSS measured after it
    holds what a full server holds (its allocator's pools for every thread, a batch of four)."""
    rng = random.Random(-1)
    kinds: set = set()
    while len(kinds) < len(set(KINDS)):
        kind, args = random_request(rng)
        if kind not in kinds:
            kinds.add(kind)
            await asyncio.wait_for(run(kind, args, urls, None), 600)
    until = time.monotonic() + seconds
    await asyncio.gather(*(client(-1 - i, urls, until, [], {}) for i in range(clients)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=180.0)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--model", help="checkpoint (default: a tiny random CustomVoice one, written now)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kazeia-soak-"))
    model = args.model
    if model is None:
        from kazeia.testing import write_checkpoint

        model = str(write_checkpoint(work / "tiny", "0.6B", "custom_voice", tiny=True, seed=0))
    http_port, wyoming_port = free_port(), free_port()
    shared = ["--max-batch", "4", "--queue-size", "32", "--limit", f"client_stall_s={STALL_S:g}"]
    serve = [sys.executable, "-m", "kazeia", "serve", "--model", model, "--port", str(http_port), *shared]
    serve += ["--api-key", KEY, "--allow-ignore-eos", "--text-timeout", "5", "--log-level", "warning"]
    serve += ["--limit", "max_response_bytes=2000000"]
    wyoming = [sys.executable, "-m", "kazeia", "wyoming", "--model", model, "--uri", f"tcp://127.0.0.1:{wyoming_port}"]
    wyoming += [*shared, "--seed", "7", "--voice", "aiden", "--max-new-tokens", "3000", "--speed", "0.25"]
    wyoming += ["--log-level", "warning"]
    http = f"http://127.0.0.1:{http_port}"
    processes = {
        "kazeia serve": start(serve, work / "serve.log", lambda: accepts(http_port)),
        "kazeia wyoming": start(wyoming, work / "wyoming.log", lambda: accepts(wyoming_port)),
    }
    urls = {"http": http, "http_port": http_port, "wyoming": wyoming_port}
    pids = {name: p.pid for name, p in processes.items()}
    try:
        return asyncio.run(_measure(urls, pids, args.seconds, args.clients, model))
    finally:
        for process in processes.values():
            process.terminate()
            process.wait(30)
        print(f"logs: {work}")


async def _measure(urls: dict, pids: dict, seconds: float, clients: int, model: str) -> int:
    cpu = machine()["cpu"]
    print(f"machine: {cpu}; model: {model}; {clients} clients for {seconds:g} s; --max-batch 4", flush=True)
    await warm_up(urls, clients, min(60.0, seconds / 3))
    await settle(urls, pids, {name: {"rss": 0, "sockets": 1 << 30} for name in pids})  # its jobs ended
    baseline = {name: {"rss": proc_kb(pid, "VmRSS"), "sockets": sockets(pid)} for name, pid in pids.items()}
    levels = ", ".join(f"{name} {level['rss'] >> 10} MB" for name, level in baseline.items())
    print(f"warmed up (RSS: {levels}); the crowd comes", flush=True)
    started = time.monotonic()
    done, counts, outcomes, never_read = await soak(urls, seconds, clients)
    print(f"soak: {time.monotonic() - started:.0f} s (the last requests end after the --seconds); requests:")
    for name, count in sorted(counts.items()):
        print(f"  {name}: {count}")
    print("one of each hostile class:", flush=True)
    for name, outcome in outcomes.items():
        print(f"  {name}: {outcome}")
    was_dropped = [dropped(sock) for sock in never_read]
    for sock in never_read:
        sock.close()
    figures = await settle(urls, pids, baseline)
    figures["clients that never read, dropped by the server"] = f"{sum(was_dropped)}/{len(was_dropped)}"
    same, different = await replay(urls, done)
    figures["completed answers byte-identical to their solo replay"] = f"{same}/{same + different}"
    for name, value in figures.items():
        print(f"{name}: {value:.1f}" if isinstance(value, float) else f"{name}: {value}")
    failed = [
        different != 0,
        figures["stuck jobs (HTTP server)"] != 0,
        not all(was_dropped),
        any(v for k, v in figures.items() if k.startswith("held sockets")),
        any(v > RSS_SLACK_KB / 1024 for k, v in figures.items() if k.startswith("RSS growth")),
        any(isinstance(v, int) and v >= 500 for v in outcomes.values()),
    ]
    print("PASS" if not any(failed) else "FAIL")
    return int(any(failed))


if __name__ == "__main__":
    sys.exit(main())
