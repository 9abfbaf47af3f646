"""Streaming vs offline on a real-size random checkpoint: TTFB, total wall time, vocoder cost per frame.

    python benchmarks/streaming.py [--size 0.6B] [--tiny | --model DIR] [--dtypes float32]
                                   [--frames 50] [--threads N] [--json out.json]

Greedy decoding with EOS suppressed, so every run generates exactly `--frames` frames. One row per
configuration of `--dtypes` (DTYPE or DTYPE/VOCODER_DTYPE, as bench.py takes them), each loaded in
turn in this one process; compare the ratios, not absolute times across machines.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Checkpoints, Outcomes, add_checkpoint_options, machine, precisions

from kazeia import Engine

TEXT = "Kazeia streams speech while it is still being generated, one frame after another."
COLUMNS = {  # figure -> heading
    "load_s": "load s",
    "prefill_s": "prefill s",
    "generate_ms_per_frame": "generate ms/f",
    "vocoder_ms_per_frame_one_pass": "vocoder ms/f",
    "vocoder_ms_per_frame_1_frame_chunks": "voc 1-f ms/f",
    "offline_rtf": "offline RTF",
    "stream_rtf": "stream RTF",
    "stream_over_offline": "stream/offline",
    "ttfb_s": "TTFB s",
    "ttfb_budget_s": "TTFB budget s",
    "ttfb_over_budget": "TTFB/budget",
}


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def measure(path: Path, config: str, frames: int) -> dict:
    """One configuration's figures: offline and streamed synthesis, generation and vocoder alone."""
    engine, load_s = timed(lambda: Engine.load(path, **precisions(config)))
    options = dict(
        voice="serena",
        language="english",
        do_sample=False,
        subtalker_dosample=False,
        ignore_eos=True,
        max_new_tokens=frames + 1,
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
    s = stream.metrics
    assert s is not None and offline.metrics.frames == s.frames == frames, "a run stopped early"
    figures = {
        "load_s": load_s,
        "prefill_s": s.prefill_s,
        "generate_ms_per_frame": 1000 * generate_s / frames,
        "vocoder_ms_per_frame_one_pass": 1000 * vocoder_s / frames,
        "vocoder_ms_per_frame_1_frame_chunks": 1000 * vocoder_1_s / frames,
        "offline_wall_s": offline.metrics.wall_s,
        "offline_rtf": offline.metrics.rtf,
        "stream_wall_s": s.wall_s,
        "stream_rtf": s.rtf,
        "stream_over_offline": s.wall_s / offline.metrics.wall_s,
        "ttfb_s": s.ttfb_s,
        "ttfb_budget_s": s.prefill_s + (generate_s + vocoder_1_s) / frames,
    }
    figures["ttfb_over_budget"] = figures["ttfb_s"] / figures["ttfb_budget_s"]
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_checkpoint_options(parser)
    parser.add_argument("--dtypes", default="float32", help="configurations, e.g. float32,int8,int8/bfloat16")
    parser.add_argument("--frames", type=int, default=50)
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    outcomes, results = Outcomes(), {}
    with Checkpoints(args) as checkpoints:
        path = checkpoints.released
        print(f"{checkpoints.label}, {args.frames} frames, greedy")
        print(f"{'configuration':<16}" + "".join(f"{label:>15}" for label in COLUMNS.values()), flush=True)
        for config in args.dtypes.split(","):
            figures = outcomes.run(config, lambda config=config: measure(path, config, args.frames))
            if figures is not None:
                results[config] = figures
                print(f"{config:<16}" + "".join(f"{figures[key]:>15.3f}" for key in COLUMNS), flush=True)
    print(f"machine: {json.dumps(machine())}")  # after loading: the engine sets the thread count
    if args.json:
        payload = {"machine": machine(), "checkpoint": checkpoints.label, "frames": args.frames, "results": results}
        Path(args.json).write_text(json.dumps(payload, indent=2))
    outcomes.exit()


if __name__ == "__main__":
    main()
