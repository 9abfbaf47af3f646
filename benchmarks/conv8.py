"""The int8 vocoder's convolutions alone (kazeia/conv.py's `Tiled8`): ms and GMAC/s per call.

Decodes `--frames` frames once with an int8 vocoder of the released dimensions (vocoder.py's cached
random speech tokenizer) and records the shape of every `Tiled8` call; then times one call of each
distinct shape on random weights and inputs, at each thread count, the best of the rounds. With
`--baseline DIR` (a second checkout, e.g. `git worktree add /tmp/base main`) its `Tiled8` runs the
same calls interleaved with this one's (A, B, B, A, ...) and must give the same bits; the ratio
column is this checkout's time over the baseline's. `KAZEIA_ISA` chooses the kernel (kazeia/cpu.py).

    python benchmarks/conv8.py --baseline /tmp/base --threads 1,2 --rounds 9
    KAZEIA_ISA=avx2 python benchmarks/conv8.py --baseline /tmp/base
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, real_checkpoint
from vocoder import baseline_vocoder, speech_tokenizer

from kazeia import cpu, native
from kazeia.conv import Tiled8
from kazeia.vocoder import Vocoder


def shapes(path: Path, frames: int) -> list[tuple[int, int, int, int, int]]:
    """(rows, cin, n, taps, dilation) of each distinct Tiled8 call while `frames` frames decode in one chunk."""
    vocoder = Vocoder.load(path, dtype=torch.float32, int8=True)
    seen: dict[tuple[int, int, int, int, int], None] = {}

    def record(module: Tiled8, inputs: tuple) -> None:
        seen[(inputs[0].shape[1], module.cin, module.n, module.taps, module.dilation)] = None

    for module in vocoder.modules():
        if isinstance(module, Tiled8):
            module.register_forward_pre_hook(record)
    codes = torch.randint(0, 2048, (frames, 16), generator=torch.Generator().manual_seed(1))
    vocoder.decode_chunk(codes, vocoder.new_state())
    return list(seen)


def timed(conv: Tiled8, x: torch.Tensor, res: torch.Tensor) -> tuple[float, torch.Tensor]:
    start = time.perf_counter()
    y = conv(x, res)
    return time.perf_counter() - start, y


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, help="another checkout's root, timed interleaved")
    parser.add_argument("--threads", default="1,2", help="torch thread counts")
    parser.add_argument("--frames", type=int, default=4, help="frames a call covers")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--tiny", action="store_true", help="a tiny random vocoder: checks that the script runs")
    args = parser.parse_args()
    path = real_checkpoint("0.6B", "custom_voice", tiny=True) / "speech_tokenizer" if args.tiny else speech_tokenizer()
    kinds = {"this": (Tiled8, native.library())}
    if args.baseline:
        baseline_vocoder(args.baseline.resolve())  # imports the checkout as kazeia_baseline
        kinds["baseline"] = (
            importlib.import_module("kazeia_baseline.conv").Tiled8,
            importlib.import_module("kazeia_baseline.native").library(),
        )
    print(json.dumps({**machine(), "isa": cpu.describe(), "frames": args.frames}))
    g = torch.Generator().manual_seed(0)
    header = "".join(f"  {name + ' ms, GMAC/s':>24}" for name in kinds)
    print(f"\n{'threads':>7} {'rows':>6} {'cin':>5} {'n':>5} {'taps':>4} {'dil':>3}{header}", end="")
    print("  this/baseline" if args.baseline else "")
    totals, calls = {}, shapes(path, args.frames)
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        for rows, cin, n, taps, dilation in calls:
            weight, bias = torch.randn(n, taps, cin, generator=g) / cin**0.5, torch.randn(n, generator=g)
            x = torch.randn(1, rows, cin, generator=g)
            res = torch.randn(1, rows - (taps - 1) * dilation, n, generator=g)
            convs = {name: cls(lib, weight, bias, dilation) for name, (cls, lib) in kinds.items()}
            best, out = dict.fromkeys(convs, float("inf")), {}
            for round_ in range(args.rounds):
                for name in list(convs) if round_ % 2 == 0 else list(convs)[::-1]:
                    seconds, out[name] = timed(convs[name], x, res)
                    best[name] = min(best[name], seconds)
            if args.baseline and not torch.equal(out["this"], out["baseline"]):
                raise SystemExit(f"the outputs differ from the baseline's at {(rows, cin, n, taps, dilation)}")
            macs = res.shape[1] * n * taps * cin
            cells = "".join(f"  {1000 * best[name]:15.3f} {macs / best[name] / 1e9:8.1f}" for name in convs)
            ratio = f"  {best['this'] / best['baseline']:13.3f}" if args.baseline else ""
            print(f"{threads:7d} {rows:6d} {cin:5d} {n:5d} {taps:4d} {dilation:3d}{cells}{ratio}")
            for name in convs:
                totals[(threads, name)] = totals.get((threads, name), 0.0) + best[name]
    for (threads, name), seconds in totals.items():
        print(f"total, {threads} threads, {name}: {1000 * seconds:.3f} ms", end="")
        if name == "baseline":
            print(f" (this/baseline {totals[(threads, 'this')] / seconds:.3f})", end="")
        print()
    if args.baseline:
        print("the same bits as the baseline: True")


if __name__ == "__main__":
    main()
