"""Scale-out on one machine: plain `kazeia serve` against `kazeia serve --replicas` on Ray Serve.

    python benchmarks/scale_out.py [--tiny | --model DIR] [--dtype int8] [--clients 1,2,3,4] [--requests 3]
                                   [--frames 48] [--rounds 2]

Three servers on the same checkpoint and cores: `plain` (one process, --threads T), `ray-1x{T}`
(one replica of T threads behind Ray Serve's proxy) and `ray-{T}x1` (T replicas of one thread),
T = this machine's cores. Each round starts each server in turn (fresh processes), then for each
client count runs that many clients at once, each streaming `--requests` utterances of exactly
`--frames` frames (ignore_eos, fixed seed), and prints: aggregate audio seconds per wall second,
time to first audio (TTFA) p50/p95 over every utterance, and the round trip of `GET /health`
(p50 of 50, one client): the proxy's cost shows as the Ray servers' TTFA and /health over plain's.
Rounds alternate the servers (A, B, C, A, B, C), so a machine shared with other work weighs on
all of them; compare ratios within a round. Needs the `ray` extra.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from common import Checkpoints, add_checkpoint_options, concurrently, machine

TEXT = "Scaling out keeps every listener's first words quick, however many are talking at once."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(checkpoint: str, flags: list[str], replicas: int, log: Path) -> tuple[subprocess.Popen, str]:
    """A `kazeia serve` process, once `replicas` replicas have answered /health (at most 300 s)."""
    port = free_port()
    command = [sys.executable, "-m", "kazeia", "serve", "--model", checkpoint, "--port", str(port)]
    command += ["--allow-ignore-eos", "--log-level", "warning", *flags]
    process = subprocess.Popen(command, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
    url, seen, deadline = f"http://127.0.0.1:{port}", set(), time.monotonic() + 300
    while time.monotonic() < deadline and len(seen) < replicas:
        if process.poll() is not None:
            raise RuntimeError(f"kazeia serve exited with {process.returncode}: see {log}")
        try:
            r = httpx.get(url + "/health", timeout=5)
            if r.status_code == 200:
                seen.add(r.headers.get("x-kazeia-replica", "plain"))
                continue
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    if len(seen) < replicas:
        stop(process)
        raise RuntimeError(f"{replicas} replicas did not answer within 300 s: see {log}")
    return process, url


def stop(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(120)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # its own session: what it started, nothing else
        process.wait(30)


def utterance(client: httpx.Client, url: str, frames: int, seed: int, voice: str) -> tuple[float, float]:
    """(TTFA seconds, audio seconds) of one streamed utterance."""
    body = {"model": "tts-1", "input": TEXT, "response_format": "pcm", "seed": seed}
    body |= {"ignore_eos": True, "max_new_tokens": frames + 1, "voice": voice}
    started, first, size = time.perf_counter(), None, 0
    with client.stream("POST", url + "/v1/audio/speech", json=body) as r:
        r.raise_for_status()
        for chunk in r.iter_raw():
            if chunk and first is None:
                first = time.perf_counter() - started
            size += len(chunk)
    return first or float("nan"), size / 48000


def load(url: str, clients: int, requests: int, frames: int, voice: str) -> dict:
    results: list[tuple[float, float]] = []
    lock = threading.Lock()

    def run(i: int) -> None:
        with httpx.Client(timeout=600) as client:
            for j in range(requests):
                got = utterance(client, url, frames, 100 * i + j, voice)
                with lock:
                    results.append(got)

    wall = concurrently(run, clients)
    ttfa = sorted(r[0] for r in results)
    return {
        "audio_s_per_s": sum(r[1] for r in results) / wall,
        "ttfa_p50_ms": 1000 * statistics.median(ttfa),
        "ttfa_p95_ms": 1000 * ttfa[min(len(ttfa) - 1, round(0.95 * (len(ttfa) - 1)))],
    }


def health_ms(url: str) -> float:
    times = []
    with httpx.Client(timeout=30) as client:
        for _ in range(50):
            started = time.perf_counter()
            client.get(url + "/health").raise_for_status()
            times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_checkpoint_options(parser)
    parser.add_argument("--dtype", default="int8", help="the precision every server runs")
    parser.add_argument("--clients", default="1,2,3,4")
    parser.add_argument("--requests", type=int, default=3, help="utterances per client at each client count")
    parser.add_argument("--frames", type=int, default=48, help="frames per utterance (80 ms each)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--voice", default="ryan")
    parser.add_argument("--logs", type=Path, help="directory for the servers' logs (default: a new temporary one)")
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    servers = {
        "plain": (["--threads", str(cores)], 1),
        f"ray-1x{cores}": (["--replicas", "1", "--threads", str(cores)], 1),
        f"ray-{cores}x1": (["--replicas", str(cores), "--threads", "1"], cores),
    }
    logs = args.logs or Path(tempfile.mkdtemp(prefix="kazeia-scale-out-"))
    logs.mkdir(parents=True, exist_ok=True)
    with Checkpoints(args) as checkpoints:
        checkpoint = str(checkpoints.prepared(args.dtype))
        print(json.dumps({"machine": machine(), "checkpoint": checkpoints.label, "dtype": args.dtype,
                          "frames": args.frames, "logs": str(logs)}))  # fmt: skip
        for round_ in range(args.rounds):
            for name, (flags, replicas) in servers.items():
                process, url = start(checkpoint, flags, replicas, logs / f"{name}-{round_}.log")
                try:
                    with httpx.Client(timeout=600) as client:
                        utterance(client, url, 4, 0, args.voice)  # warm-up
                    row = {"round": round_, "server": name, "health_p50_ms": round(health_ms(url), 2)}
                    for clients in (int(c) for c in args.clients.split(",")):
                        figures = load(url, clients, args.requests, args.frames, args.voice)
                        row[f"c{clients}"] = {k: round(v, 2) for k, v in figures.items()}
                    print(json.dumps(row), flush=True)
                finally:
                    stop(process)


if __name__ == "__main__":
    main()
