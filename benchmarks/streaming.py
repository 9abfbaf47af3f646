"""Streaming vs offline on a real-size random checkpoint: TTFB, total wall time, vocoder cost per frame.

    python benchmarks/streaming.py [--size 0.6B] [--frames 50] [--threads N] [--json out.json]

Greedy decoding with EOS suppressed, so every run generates exactly `--frames` frames. All figures
come from one process on one machine; compare the ratios, not absolute times across machines.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, real_checkpoint

from kazeia import Engine

TEXT = "Kazeia streams speech while it is still being generated, one frame after another."


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="0.6B", choices=["0.6B", "1.7B"])
    parser.add_argument("--frames", type=int, default=50)
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    engine, load_s = timed(lambda: Engine.load(real_checkpoint(args.size)))
    options = dict(
        voice="serena",
        language="english",
        do_sample=False,
        subtalker_dosample=False,
        ignore_eos=True,
        max_new_tokens=args.frames + 1,
    )
    engine.synthesize(TEXT, **{**options, "max_new_tokens": 3})  # warm-up

    offline = engine.synthesize(TEXT, **options)
    stream = engine.stream(TEXT, **options)
    for _ in stream:
        pass
    request = engine.request(TEXT, **options)
    _, generate_s = timed(lambda: sum(1 for _ in engine.frames(request)))
    codes = torch.from_numpy(offline.codes)
    with torch.inference_mode():
        _, vocoder_s = timed(lambda: engine.vocoder(codes))
        state = engine.vocoder.new_state()
        _, vocoder_1_s = timed(
            lambda: [engine.vocoder.decode_chunk(codes[i : i + 1], state) for i in range(len(codes))]
        )

    n, s = args.frames, stream.metrics
    figures = {
        "machine": machine(),
        "checkpoint": f"{args.size} CustomVoice, real dimensions, random weights, float32",
        "frames": n,
        "load_s": load_s,
        "prefill_s": s.prefill_s,
        "generate_ms_per_frame": 1000 * generate_s / n,
        "vocoder_ms_per_frame_one_pass": 1000 * vocoder_s / n,
        "vocoder_ms_per_frame_1_frame_chunks": 1000 * vocoder_1_s / n,
        "offline_wall_s": offline.metrics.wall_s,
        "offline_rtf": offline.metrics.rtf,
        "stream_wall_s": s.wall_s,
        "stream_rtf": s.rtf,
        "stream_over_offline": s.wall_s / offline.metrics.wall_s,
        "ttfb_s": s.ttfb_s,
        "ttfb_budget_s": s.prefill_s + (generate_s + vocoder_1_s) / n,
    }
    figures["ttfb_over_budget"] = figures["ttfb_s"] / figures["ttfb_budget_s"]
    width = max(map(len, figures))
    for key, value in figures.items():
        shown = (
            json.dumps(value) if isinstance(value, dict) else (f"{value:.3f}" if isinstance(value, float) else value)
        )
        print(f"{key:<{width}}  {shown}")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
