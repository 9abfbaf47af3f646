"""Many streams at once through the scheduler on a real-size random checkpoint: aggregate audio
seconds per wall second, per-stream RTF, TTFB p50/p95 and continuity, by concurrency.

    python benchmarks/batch.py [--size 0.6B] [--tiny | --model DIR] [--dtypes int8,int8/bfloat16]
                               [--concurrency solo,4q,4,1/4]
                               [--requests 16] [--frames 15-40] [--gap 0.3] [--ramp S]
                               [--max-chunk-frames N] [--vocoder-lanes 1,2] [--vocoder-dtype D]
                               [--json out.json]

At concurrency c, c clients each send requests one after the other, the first at a random time
within the first `--ramp` s (default `--gap`: nearly at once, a burst the first prefills queue
behind) and each next one a random (exponential, mean `--gap` s) pause after the previous ended;
each request asks for a random number of frames in `--frames` (greedy, EOS suppressed, so exactly
that many) and takes its chunks as fast as they come. "solo" is the engine's own stream, one
client, no scheduler; "N/B" is N clients through a scheduler of B places, and "Nq" N clients
taking turns on the engine's own stream (`kazeia serve --max-batch B` and `--max-batch 1` with N
clients: `level`). `--vocoder-lanes`: the scheduler's (kazeia/scheduler.py), each
value a row of its own (default: the scheduler's default). TTFB counts from the call (queue wait
included); `ttfb_p95_later_s` leaves out each client's first request, the opening burst (with
clients > 1). A stream is continuous when, played in real time from its first chunk after a 160 ms
buffer, it never runs dry. `aggregate_all_clients`: the aggregate while every client is still at
it (from the last client's first request to the first client's last end; `all_clients_share` of
the level's wall time), leaving out the level's end, when its last requests run with fewer
neighbours. `after_generation_share`: of the requests' wall time, the share after
their generation ended (their audio still being decoded; such a stream is out of the batched
steps, so a vocoder that lags makes the batches smaller). Levels may repeat (`solo,4,solo,4`), to
alternate them within one run. Each row is one JSON line; a precision or level that fails prints
a FAILED line instead, the others still run, and the script exits 1.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import random
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    Checkpoints,
    Outcomes,
    add_checkpoint_options,
    concurrently,
    longest_wait,
    machine,
    precisions,
)

from kazeia import Engine

TEXT = "Kazeia speaks to many people at once, each voice exactly as it would sound alone."
RATE = 24000


class Turns:
    """A first-come-first-served lock: one request at a time, in the order they asked."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._tickets = itertools.count()
        self._serving = 0

    def __enter__(self) -> None:
        with self._cond:
            mine = next(self._tickets)
            self._cond.wait_for(lambda: self._serving == mine)

    def __exit__(self, *exc) -> None:
        with self._cond:
            self._serving += 1
            self._cond.notify_all()


def one_stream(
    engine: Engine, scheduler, frames: int, seed: int, catch_up: int | None = None, turns: Turns | None = None
) -> dict:
    """One request, its chunks taken at once (after its turn, with `turns`); its timings."""
    called = time.perf_counter()
    with turns if turns is not None else contextlib.nullcontext():
        return _timed(engine, scheduler, frames, seed, catch_up, called)


def _timed(engine: Engine, scheduler, frames: int, seed: int, catch_up: int | None, called: float) -> dict:
    begun = time.perf_counter()  # after any turn's wait
    options = dict(voice="serena", seed=seed, max_new_tokens=frames + 1, ignore_eos=True, max_chunk_frames=catch_up)
    stream = scheduler.stream(TEXT, **options) if scheduler is not None else engine.stream(TEXT, **options)
    arrivals, samples, delivered = [], 0, []
    for chunk in stream:
        if chunk.frames:
            arrivals.append((time.perf_counter() - called, samples / RATE))
            delivered.append((time.perf_counter(), len(chunk.audio) / RATE))
        samples += len(chunk.audio)
    ended = time.perf_counter() - called
    continuous = longest_wait(arrivals) == 0.0
    assert stream.metrics is not None and stream.metrics.generation_s is not None  # the last chunk is out
    # the stream's own clock (it starts at the call, after `begun`): its share after generation
    after = (stream.metrics.wall_s - stream.metrics.generation_s) / stream.metrics.wall_s
    return {
        "ttfb_s": arrivals[0][0], "audio_s": samples / RATE, "wall_s": ended, "continuous": continuous,
        "after_generation": after * (called + ended - begun), "called": called, "ended": called + ended,
        "delivered": delivered,
    }  # fmt: skip


def level(name: str) -> tuple[int, int | None, bool]:
    """A `--concurrency` level -> (clients, the scheduler's max_batch or None, one at a time):
    "solo": one client on the engine's own stream; "N": N clients through a scheduler of N
    places; "N/B": N clients through a scheduler of B places (the server's --max-batch B); "Nq": N
    clients taking turns on the engine's own stream, first come first served (the server's
    --max-batch 1: one worker, one utterance at a time)."""
    if name == "solo":
        return 1, None, False
    if name.endswith("q"):
        return int(name[:-1]), None, True
    clients, _, places = name.partition("/")
    return int(clients), int(places or clients), False


def run_level(
    engine: Engine,
    concurrency: int | str,
    requests: int,
    frames: tuple[int, int],
    gap: float,
    catch_up: int | None,
    ramp: float | None = None,
    lanes: int | None = None,
) -> dict:
    rng = random.Random(17)
    clients, max_batch, queued = level(concurrency)
    plan = [[rng.randint(*frames) for _ in range(requests // clients or 1)] for _ in range(clients)]
    results: list[dict] = []
    lock = threading.Lock()
    scheduler = None
    if max_batch is not None:
        scheduler = engine.scheduler(max_batch=max_batch, max_queue=clients, vocoder_lanes=lanes)
    turns = Turns() if queued else None

    def client(index: int) -> None:
        local = random.Random(index)
        time.sleep(local.uniform(0, gap if ramp is None else ramp))
        for k, n in enumerate(plan[index]):
            got = one_stream(engine, scheduler, n, seed=100 * index + k, catch_up=catch_up, turns=turns)
            got["opening"], got["client"] = k == 0, index
            with lock:
                results.append(got)
            time.sleep(local.expovariate(1 / gap))

    wall = concurrently(client, clients)
    stats = scheduler.stats if scheduler is not None else None
    if scheduler is not None:
        scheduler.close()
    ttfb = np.array([r["ttfb_s"] for r in results])
    later = np.array([r["ttfb_s"] for r in results if not r["opening"]]) if clients > 1 else ttfb
    rtf = np.array([r["wall_s"] / r["audio_s"] for r in results])
    # while every client is still at it: from the last client's first call to the first client's last end
    ranges = [[r for r in results if r["client"] == c] for c in range(clients)]
    start = max(min(r["called"] for r in mine) for mine in ranges)
    end = min(max(r["ended"] for r in mine) for mine in ranges)
    within = sum(seconds for r in results for at, seconds in r["delivered"] if start <= at <= end)
    return {
        "concurrency": concurrency,
        "vocoder_lanes": None if scheduler is None else scheduler.lanes.lanes,
        "streams": len(results),
        "audio_s": sum(r["audio_s"] for r in results),
        "wall_s": wall,
        "aggregate": sum(r["audio_s"] for r in results) / wall,
        # the same while all clients run (the level's end has fewer: its last requests finish alone)
        "aggregate_all_clients": within / (end - start) if end > start else None,
        "all_clients_share": max(0.0, end - start) / wall,
        "rtf_p50": float(np.percentile(rtf, 50)),
        "rtf_p95": float(np.percentile(rtf, 95)),
        "ttfb_p50_s": float(np.percentile(ttfb, 50)),
        "ttfb_p95_s": float(np.percentile(ttfb, 95)),
        # without each client's first request (the opening burst), where there are later ones
        "ttfb_p95_later_s": float(np.percentile(later, 95)) if len(later) else None,
        "continuity": sum(r["continuous"] for r in results) / len(results),
        "mean_batch": None if stats is None else stats.mean_batch,
        # of the requests' wall time, the share after their generation ended (the vocoder catching
        # up): a stream whose generation has ended is no longer in the batched steps
        "after_generation_share": sum(r["after_generation"] for r in results) / sum(r["wall_s"] for r in results),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_checkpoint_options(parser)
    parser.add_argument("--dtypes", default="int8,bfloat16")
    parser.add_argument("--concurrency", default="solo,1,2,4", help="levels: solo, N, N/B or Nq (`level`)")
    parser.add_argument("--requests", type=int, default=16, help="requests per level (split among the clients)")
    parser.add_argument("--frames", default="15-40", help="frames per request, a range MIN-MAX")
    parser.add_argument("--gap", type=float, default=0.3, help="mean pause between a client's requests (s)")
    parser.add_argument(
        "--vocoder-dtype", default="float32", help="float32 (exact audio) or bfloat16, where --dtypes names none"
    )
    parser.add_argument("--ramp", type=float, help="clients start within this many seconds (default: --gap)")
    parser.add_argument("--vocoder-lanes", default="", help="vocoder lanes, e.g. 1,2 (default: the scheduler's)")
    parser.add_argument(
        "--max-chunk-frames", type=int, help="let late streams catch up in chunks of up to this many frames"
    )
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    low, _, high = args.frames.partition("-")
    frames = (int(low), int(high or low))
    report: dict = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "runs": []}
    outcomes = Outcomes()
    with Checkpoints(args) as checkpoints:
        report["checkpoint"] = checkpoints.label
        print(checkpoints.label)
        for config in args.dtypes.split(","):  # DTYPE, or DTYPE/VOCODER_DTYPE as bench.py takes them
            chosen = precisions(config if "/" in config else f"{config}/{args.vocoder_dtype}")
            load = lambda chosen=chosen: Engine.load(checkpoints.prepared(chosen["dtype"]), **chosen)  # noqa: E731
            engine = outcomes.run(config, load)
            if engine is not None:
                levels(engine, chosen, args, frames, report, outcomes)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    outcomes.exit()


def levels(engine: Engine, chosen: dict, args, frames: tuple[int, int], report: dict, outcomes: Outcomes) -> None:
    """Every level of `--concurrency` (each vocoder-lanes value for a scheduler's) on one engine: a row each."""
    dtype, vocoder = chosen["dtype"], chosen["vocoder_dtype"]
    if "machine" not in report:  # after loading: the engine sets the thread count
        report["machine"] = machine()
        print(json.dumps(report["machine"]))
    one_stream(engine, None, 3, seed=0)  # warm-up: the native library, the first allocations
    lanes = [int(n) for n in args.vocoder_lanes.split(",") if n] or [None]
    for name in args.concurrency.split(","):
        for lane in lanes if level(name)[1] is not None else [None]:
            run = lambda name=name, lane=lane: run_level(  # noqa: E731
                engine, name, args.requests, frames, args.gap, args.max_chunk_frames, args.ramp, lane
            )
            got = outcomes.run(f"{dtype}/{vocoder} {name}" + (f" lanes {lane}" if lane else ""), run)
            if got is not None:
                row = {"dtype": dtype, "vocoder_dtype": vocoder, **got}
                report["runs"].append(row)
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
