"""The vocoder alone: ms per frame by chunk size and thread count, against another checkout.

Decodes the same random codes on a real-size random speech-tokenizer decoder (the released
dimensions, written once to the benchmark cache) in chunks of each size, on a fresh stream state
each time, and prints ms per frame (median and best of the rounds). With `--baseline DIR` (a second
checkout of Kazeia, e.g. `git worktree add /tmp/base main`) its vocoder is loaded in the same
process under another package name and timed interleaved with this one (A, B, B, A, ...), so both
see the same machine; the ratio column is this checkout's time over the baseline's. It also checks
that this checkout's audio has the same bits at every chunk size and thread count, and how far it is
from the baseline's.

    python benchmarks/vocoder.py --baseline /tmp/base --chunks 1,4,32 --threads 1,2 --rounds 5
    python benchmarks/vocoder.py --dtypes float32,bfloat16,int8 --chunks 4 --threads 1,2

`--dtypes` times several precisions of this checkout interleaved the same way (int8: kazeia/conv.py's
`Tiled8`); the ratio column is then each one's time over the first's.

`--streams N` decodes N streams' codes at once, each chunk both ways, interleaved: every stream
on a state of its own, one after the other (as the engine's streams decode, kazeia/lanes.py), and
all N in one call on a batched state ("batched", what a scheduler could do: every vocoder value is
computed the same way whatever the batch, so each stream keeps its own bits, checked here); ms are
then per stream-frame and the ratio column is each precision's batched time over its own. A
2-vCPU Zen 4, 4 streams, one thread: batching pays only where chunks are short (int8 0.83x at 1
frame, 0.94x at 2, 1.06-1.07x at 4 and 8; float32 0.83x, 0.91x, 1.02-1.05x): BENCHMARKS.md.

`--threads` gives torch that many threads, as a stage of that many gets on a larger machine; its
regions then open OpenMP teams whose workers spin for a while after each region (libgomp's default
wait policy), on the cores Kazeia's own helpers need. `--team` runs the decodes as the engine runs a
two-core machine's first chunk instead: Kazeia's kernels on that many threads (`cpu.team`), torch's
regions on one (a 2-vCPU Zen 4, float32, two threads, in turns: one-frame chunks 55.0 / 54.9 ms a
frame without it, 46.4 / 43.1 with it; four-frame chunks 40.2 / 36.3 against 34.4 / 34.9).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import CACHE, machine, real_checkpoint

from kazeia import cpu
from kazeia.config import VocoderConfig
from kazeia.testing.vocoder import random_vocoder_tensors
from kazeia.vocoder import Vocoder

CONFIG = Path(__file__).resolve().parent.parent / "kazeia/reference_files/Qwen3-TTS-12Hz-0.6B-CustomVoice"


def speech_tokenizer() -> Path:
    """A real-size random speech-tokenizer directory (config.json + decoder tensors), cached."""
    path = CACHE / "speech_tokenizer-0.6B"
    if not (path / "model.safetensors").is_file():
        from safetensors.torch import save_file

        print(f"writing a real-size random speech tokenizer to {path} (once) ...", flush=True)
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text((CONFIG / "speech_tokenizer" / "config.json").read_text())
        cfg = VocoderConfig.from_file(path / "config.json")
        save_file(random_vocoder_tensors(cfg, torch.Generator().manual_seed(0)), str(path / "model.safetensors"))
    return path


def baseline_vocoder(root: Path):
    """`Vocoder` of the checkout at `root`, imported as the package `kazeia_baseline`."""
    spec = importlib.util.spec_from_file_location(
        "kazeia_baseline", root / "kazeia" / "__init__.py", submodule_search_locations=[str(root / "kazeia")]
    )
    if spec is None or spec.loader is None:
        raise SystemExit(f"no kazeia package in {root}")
    module = importlib.util.module_from_spec(spec)
    sys.modules["kazeia_baseline"] = module
    spec.loader.exec_module(module)
    return importlib.import_module("kazeia_baseline.vocoder").Vocoder


def load(cls, path: Path, dtype: str):
    """`cls.load` for a `--dtypes` name (int8: float32 weights, int8 products)."""
    if dtype == "int8":
        return cls.load(path, dtype=torch.float32, int8=True)
    return cls.load(path, dtype=getattr(torch, dtype))


def decode(vocoder, codes: torch.Tensor, chunk: int, batched: bool = False) -> tuple[float, torch.Tensor]:
    """Seconds to decode `codes` (streams, frames, 16) in chunks of `chunk` frames on fresh states,
    and the audio (streams, samples): each stream on its own state, one after the other, or all of
    them in one call on a batched state (`batched`)."""
    streams, frames = codes.shape[:2]
    states = [vocoder.new_state(streams)] if batched else [vocoder.new_state() for _ in range(streams)]
    pieces = []
    start = time.perf_counter()
    for i in range(0, frames, chunk):
        if batched:
            pieces.append(vocoder.decode_chunk(codes[:, i : i + chunk], states[0]))
        else:
            pieces.append(
                torch.stack([vocoder.decode_chunk(codes[s, i : i + chunk], states[s]) for s in range(streams)])
            )
    seconds = time.perf_counter() - start
    return seconds, torch.cat(pieces, dim=1).float()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, help="another checkout's root, timed interleaved")
    parser.add_argument("--chunks", default="1,4,32", help="frames per decode_chunk call")
    parser.add_argument("--threads", default="1,2", help="torch thread counts")
    parser.add_argument("--frames", type=int, default=64, help="frames decoded per measurement")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dtypes", default="float32", help="float32, bfloat16, float16, int8; several: interleaved")
    parser.add_argument("--team", action="store_true", help="threads for Kazeia's kernels only, torch's on one")
    parser.add_argument("--streams", type=int, default=1, help="streams decoded at once, alone and batched")
    parser.add_argument("--tiny", action="store_true", help="a tiny random vocoder: checks that the script runs")
    args = parser.parse_args()
    if args.streams < 1 or (args.streams > 1 and args.baseline):
        parser.error("--streams takes a count >= 1, and more than one without --baseline")
    chunks = [int(c) for c in args.chunks.split(",")]
    threads = [int(t) for t in args.threads.split(",")]
    dtypes = args.dtypes.split(",")

    path = real_checkpoint("0.6B", "custom_voice", tiny=True) / "speech_tokenizer" if args.tiny else speech_tokenizer()
    vocoders = {("this" if len(dtypes) == 1 else d): load(Vocoder, path, d) for d in dtypes}
    teams = dict.fromkeys(vocoders, cpu.team)  # each checkout's own (--team)
    if args.baseline:
        vocoders["baseline"] = load(baseline_vocoder(args.baseline.resolve()), path, dtypes[0])
        teams["baseline"] = importlib.import_module("kazeia_baseline.cpu").team
    runs: dict[str, tuple[str, bool]] = {}  # label -> (its vocoder, batched)
    for name in vocoders:
        runs[name] = (name, False)
        if args.streams > 1:
            runs[f"{name} batched"] = (name, True)
    codes = torch.randint(0, 2048, (args.streams, args.frames, 16), generator=torch.Generator().manual_seed(1))
    setting = {"dtypes": dtypes, "frames": args.frames, "streams": args.streams}
    print(json.dumps({**machine(), "isa": cpu.describe(), **setting}))

    times: dict[tuple[str, int, int], list[float]] = {}
    audio: dict[tuple[str, int, int], torch.Tensor] = {}
    names = list(runs)
    for round_ in range(args.rounds):
        for n_threads in threads:
            torch.set_num_threads(1 if args.team else n_threads)
            for chunk in chunks:
                order = names if round_ % 2 == 0 else names[::-1]
                for name in order:
                    vocoder, batched = runs[name]
                    with teams[vocoder](n_threads if args.team else None, openmp=False):
                        seconds, out = decode(vocoders[vocoder], codes, chunk, batched)
                    times.setdefault((name, n_threads, chunk), []).append(1000 * seconds / codes.shape[:2].numel())
                    audio.setdefault((name, n_threads, chunk), out)

    print(f"\n{'threads':>7} {'chunk':>5}  " + "  ".join(f"{n + ' ms/f (median, best)':>34}" for n in names), end="")
    ratio = len(names) > 1
    header = "  batched/alone (median)" if args.streams > 1 else f"  each/{names[0]} (median)"
    print(("  this/baseline (median)" if args.baseline else header) if ratio else "")
    for n_threads in threads:
        for chunk in chunks:
            cells, medians, bests = [], [], []
            for name in names:
                got = times[(name, n_threads, chunk)]
                medians.append(statistics.median(got))
                bests.append(min(got))
                cells.append(f"{medians[-1]:26.1f} {bests[-1]:7.1f}")
            line = f"{n_threads:7d} {chunk:5d}  " + "  ".join(cells)
            if args.streams > 1:  # each precision's batched median over its own
                line += "  " + " ".join(f"{b / a:.3f}" for a, b in zip(medians[::2], medians[1::2], strict=True))
            elif ratio:  # each one's median time over the first's (with --baseline: this over the baseline's)
                first = medians[-1] if args.baseline else medians[0]
                line += "  " + " ".join(f"{m / first:.3f}" for m in (medians[:1] if args.baseline else medians[1:]))
            print(line)

    for name in vocoders:
        if name == "baseline":
            continue
        ours = [audio[(label, t, c)] for label in runs if runs[label][0] == name for t in threads for c in chunks]
        same = all(torch.equal(ours[0], other) for other in ours[1:])
        batched = ", batched or not" if args.streams > 1 else ""
        print(f"\n{name}: the same bits at every chunk size and thread count{batched}: {same}", end="")
    print()
    if args.baseline:
        diff = (audio[(names[0], threads[0], chunks[0])] - audio[("baseline", threads[0], chunks[0])]).abs().max()
        print(f"largest difference from the baseline's audio: {diff.item():.2e}")


if __name__ == "__main__":
    main()
