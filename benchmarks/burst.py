"""Prompts that arrive together: first audio of N streams started at once through the scheduler,
prompts one after the other against side by side, alternated in one process.

    python benchmarks/burst.py [--size 0.6B] [--tiny | --model DIR] [--dtypes int8] [--streams 2,3,4]
                               [--rounds 4] [--frames 4] [--json out.json]

Each round starts N streams in the same instant (one thread each, greedy, EOS suppressed, `--frames`
frames each) on a fresh scheduler with `prompts_at_once=1`, then on one with the default (as many
prompts side by side as the prompt team holds stages' threads: two where each stage has half the
cores), and reports each one's first-audio time (from the common start) and their last. Every
stream's audio is checked to be the same bytes both ways. A stream's prompt costs the same either
way; what changes is how the cores are shared while several prompts wait (docs/design.md, "Many
streams"). One JSON row per precision of `--dtypes` and stream count; a failure prints a FAILED
line instead, the others still run, and the script exits 1.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Checkpoints, Outcomes, add_checkpoint_options, machine, precisions

from kazeia import Engine

TEXT = "Kazeia speaks to many people at once, each voice exactly as it would sound alone."


def burst(engine: Engine, streams: int, frames: int, at_once: int | None) -> tuple[list[float], list[bytes]]:
    """N streams started together: each one's first-audio seconds and its audio bytes."""
    firsts, audio = [0.0] * streams, [b""] * streams
    start = threading.Barrier(streams + 1)
    with engine.scheduler(max_batch=streams, max_queue=streams, prompts_at_once=at_once) as scheduler:

        def client(i: int) -> None:
            start.wait()
            began = time.perf_counter()
            stream = scheduler.stream(TEXT, voice="serena", seed=i, max_new_tokens=frames + 1, ignore_eos=True)
            chunks = []
            for chunk in stream:
                if not chunks:
                    firsts[i] = time.perf_counter() - began
                chunks.append(chunk.audio)
            audio[i] = np.concatenate(chunks).tobytes()

        threads = [threading.Thread(target=client, args=(i,)) for i in range(streams)]
        for thread in threads:
            thread.start()
        start.wait()
        for thread in threads:
            thread.join()
    return firsts, audio


def rows(engine: Engine, dtype: str, n: int, rounds: int, frames: int) -> dict:
    """`rounds` bursts of `n` streams each way, alternated: the medians of their first audio."""
    last: dict[str, list[float]] = {"one at a time": [], "side by side": []}
    mean: dict[str, list[float]] = {"one at a time": [], "side by side": []}
    for _ in range(rounds):
        one, audio_one = burst(engine, n, frames, 1)
        side, audio_side = burst(engine, n, frames, None)
        if audio_one != audio_side:
            raise AssertionError("the audio differs between the two ways: a bug")
        for name, firsts in (("one at a time", one), ("side by side", side)):
            last[name].append(max(firsts))
            mean[name].append(statistics.fmean(firsts))
    return {"dtype": dtype, "streams": n, **{
        f"{name}: last first audio (median s)": statistics.median(last[name]) for name in last
    }, **{f"{name}: mean first audio (median s)": statistics.median(mean[name]) for name in mean},
        "rounds": {name: [round(v, 3) for v in last[name]] for name in last}}  # fmt: skip


def counts(engine: Engine, config: str, args, report: dict, outcomes: Outcomes) -> None:
    """A row per stream count of `--streams`, on one engine."""
    burst(engine, 1, 2, None)  # warm-up
    for n in [int(v) for v in args.streams.split(",")]:
        row = outcomes.run(f"{config} {n} streams", lambda n=n: rows(engine, config, n, args.rounds, args.frames))
        if row is not None:
            report["rows"].append(row)
            print(json.dumps(row), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_checkpoint_options(parser)
    parser.add_argument("--dtypes", default="int8", help="precisions, DTYPE or DTYPE/VOCODER_DTYPE, a row set each")
    parser.add_argument("--streams", default="2,3,4")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--frames", type=int, default=4)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    report: dict = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "rows": []}
    outcomes = Outcomes()
    with Checkpoints(args) as checkpoints:
        report["checkpoint"] = checkpoints.label
        print(checkpoints.label)
        for config in args.dtypes.split(","):
            load = lambda config=config: Engine.load(checkpoints.prepared(config), **precisions(config))  # noqa: E731
            engine = outcomes.run(config, load)
            if engine is None:
                continue
            if "machine" not in report:  # after loading: the engine sets the thread count
                report["machine"] = machine()
                print(json.dumps(report["machine"]))
            counts(engine, config, args, report, outcomes)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    outcomes.exit()


if __name__ == "__main__":
    main()
