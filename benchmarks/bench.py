"""Kazeia vs the reference (qwen-tts 0.1.1) on real-size random checkpoints, side by side.

    python benchmarks/bench.py [--size 0.6B] [--tiny | --model DIR] [--dtypes float32,bfloat16,int8]
                               [--frames 50] [--threads N] [--repeats 3] [--reference] [--prepared]
                               [--json out.json] [--contend N] [--long-seconds 20]

A configuration in `--dtypes` is the weights' dtype, optionally with the vocoder's after a slash
(`bfloat16/bfloat16`; float32 otherwise).

Each configuration runs in its own process (clean peak RSS) on the same cached checkpoint, text,
frame count and thread count: greedy decoding with EOS suppressed, so every run generates exactly
`--frames` frames; every timing is the best of `--repeats` runs (noise on a shared machine only
adds time), the reference's too. Each generation figure is printed as a multiple of its floor: the
same frames' matrix products run back to back in the same process, with the engine's own weights,
kernels and shapes and nothing in between (as many frames as generation, timed between the
generation runs, so both see the same machine). The floor divided into the frame's weight bytes is
the GEMV bandwidth it reached. A configuration that fails prints its row as failed; the script then
exits 1 (benchmarks/common.py, `Outcomes`).

Also per configuration: the first synthesis after loading against the steady one (`1st/steady`),
and a long stream (`--long-seconds`) played as a player would, from its first chunk with 160 ms
buffered: the longest wait with nothing to play (`long dry s`, 0 = real time throughout) and its
RTF. `--contend N` keeps N busy processes (a pure-Python spin each) running through every run: the
machine an assistant shares with its LLM. `--threads N` is passed to `Engine.load` (threads per
stage); by default the engine chooses.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Checkpoints, Outcomes, add_checkpoint_options, longest_wait, machine, precisions, read_through

TEXT = "Kazeia reads every weight once per frame, so its speed is set by memory bandwidth."
VOICE, LANGUAGE = "serena", "english"
# Figures of a GGML-based C++ engine on the same random weights, 50 frames, greedy, 2 threads, best
# of 3, measured on another machine: a 2-vCPU AMD EPYC Zen 3 (AVX2, FMA, F16C, no AVX-512, ~20 GB/s
# read bandwidth with 2 threads), as reported in the project's issue tracker. Never this machine:
# printed for orientation only.
CPP_ENGINE_MACHINE = "2-vCPU AMD EPYC Zen 3, AVX2 only"
CPP_ENGINE = {
    "F32": {"generate_ms": 313, "rtf": 5.77},
    "BF16": {"generate_ms": 189, "rtf": 4.17},
    "Q8_0": {"generate_ms": 116, "rtf": 3.15},
    "Q4_K_M": {"generate_ms": 80, "rtf": 2.67},
}


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # ru_maxrss is in KiB on Linux


# -- workers (run in a subprocess each) ----------------------------------------------------------
class StepTimes:
    """Seconds spent in the frame loop's steps, measured by wrapping the methods of
    `kazeia.frame.FrameStep` from outside: the prompt (`prefill`) and each frame (`decode_frame`)
    without the code predictor's 15 steps inside them, and those (`predict_codes`) on their own."""

    STEPS = {"prefill": "prefill", "decode_frame": "decode", "predict_codes": "_predict"}  # name -> method

    def __init__(self):
        self.seconds = dict.fromkeys(self.STEPS, 0.0)

    @contextlib.contextmanager
    def installed(self):
        from kazeia.frame import FrameStep

        originals = {name: getattr(FrameStep, method) for name, method in self.STEPS.items()}
        inner = [0.0]  # time of wrapped calls made inside the current one

        def timed(name, fn):
            def wrapper(*args, **kwargs):
                outer, inner[0] = inner[0], 0.0
                start = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    spent = time.perf_counter() - start
                    self.seconds[name] += spent - inner[0]
                    inner[0] = outer + spent

            return wrapper

        for name, fn in originals.items():
            setattr(FrameStep, self.STEPS[name], timed(name, fn))
        try:
            yield self
        finally:
            for name, fn in originals.items():
                setattr(FrameStep, self.STEPS[name], fn)


def continuity(stream) -> float:
    """Take `stream`'s chunks as they come and play them (`common.longest_wait`): the longest
    time (s) a player would have waited with nothing to play."""
    arrivals, played = [], 0.0
    for chunk in stream:
        if len(chunk.audio):
            arrivals.append((time.perf_counter(), played))
            played += len(chunk.audio) / 24000
    return longest_wait(arrivals)


def run_kazeia(
    path: Path, dtype: str, frames: int, repeats: int, threads: int | None, long_frames: int, catch_up: int | None
) -> dict:
    from kazeia import Engine

    start = time.perf_counter()
    engine = Engine.load(path, **precisions(dtype), threads=threads)
    load_s = time.perf_counter() - start
    options = dict(voice=VOICE, language=LANGUAGE, do_sample=False, subtalker_dosample=False, ignore_eos=True)
    first_call_s = engine.synthesize(TEXT, max_new_tokens=frames + 1, **options).metrics.wall_s  # the first
    # Each timing is the best of `repeats` runs: on a shared machine, noise only ever adds time.
    best, floor_s = None, float("inf")
    products_only(engine, 1)  # warm-up
    for _ in range(repeats):
        request = engine.request(TEXT, max_new_tokens=frames + 1, **options)
        with StepTimes().installed() as steps:
            start = time.perf_counter()
            codes = torch.stack(list(engine.frames(request)))
            generate_s = time.perf_counter() - start - steps.seconds["prefill"]
        if best is None or generate_s < best[0]:
            best = (generate_s, steps.seconds)
        floor_s = min(floor_s, products_only(engine, frames))
    generate_s, seconds = best
    vocoder_s = float("inf")
    with torch.inference_mode():
        for _ in range(repeats):
            start = time.perf_counter()
            engine.vocoder(codes)
            vocoder_s = min(vocoder_s, time.perf_counter() - start)
    offline = min(
        (engine.synthesize(TEXT, max_new_tokens=frames + 1, **options) for _ in range(repeats)),
        key=lambda speech: speech.metrics.wall_s,
    )
    stream = engine.stream(TEXT, max_new_tokens=frames + 1, max_chunk_frames=catch_up, **options)
    for _ in stream:
        pass
    assert offline.metrics.frames == stream.metrics.frames == frames
    long = None
    if long_frames:
        long = engine.stream(TEXT, max_new_tokens=long_frames + 1, max_chunk_frames=catch_up, **options)
    dry_s = continuity(long) if long is not None else None
    reads = weight_reads(engine)
    return {
        "load_s": load_s,
        "first_call_s": first_call_s,
        "first_over_steady": first_call_s / offline.metrics.wall_s,
        "threads": torch.get_num_threads(),
        "long_dry_s": dry_s,  # longest wait of a real-time player (160 ms buffer) over the long stream
        "long_rtf": long.metrics.rtf if long is not None else None,
        "prefill_s": seconds["prefill"],  # the talker over the prompt and the first codebook-0 token
        "talker_ms": 1000 * seconds["decode_frame"] / frames,  # next input, talker step, head, sampling
        "predictor_ms": 1000 * seconds["predict_codes"] / frames,  # 15 steps with sampling
        "generate_ms": 1000 * generate_s / frames,
        "floor_ms": 1000 * floor_s,
        "x_floor": generate_s / frames / floor_s,
        "weight_reads": reads,
        "gemv_gbps": weight_reads(engine, stored_bytes) / floor_s / 1e9,
        "vocoder_ms": 1000 * vocoder_s / frames,
        "wall_s": offline.metrics.wall_s,
        "rtf": offline.metrics.rtf,
        "ttfb_s": stream.metrics.ttfb_s,
        "stream_wall_s": stream.metrics.wall_s,
        "peak_rss_gb": peak_rss_gb(),
    }


def _products(engine) -> tuple[list, list, list]:
    """The linear layers one frame runs: the talker's (once), the code predictor's stack and its 15
    heads (once per codebook)."""
    from torch import nn

    from kazeia.int4 import Int4Linear
    from kazeia.matmul import PackedLinear
    from kazeia.native.linear import NativeLinear
    from kazeia.quant import QuantLinear

    kinds = (nn.Linear, PackedLinear, NativeLinear, QuantLinear, Int4Linear)
    talker, predictor = engine.model.talker, engine.model.code_predictor
    per_frame = [m for m in talker.layers.modules() if isinstance(m, kinds)] + [talker.codec_head]
    per_group = [m for m in predictor.layers.modules() if isinstance(m, kinds)]
    if isinstance(predictor.small_to_mtp_projection, kinds):
        per_group.append(predictor.small_to_mtp_projection)
    return per_frame, per_group, list(predictor.lm_head)


def products_only(engine, frames: int) -> float:
    """Seconds per frame of the frames' matrix products alone, back to back: the same weights,
    kernels and shapes as generation with nothing else in between, over as many frames as the
    generation it is held to (a one-frame sample would be judged against a 50-frame run: the best
    of a few short samples catches quiet moments of a shared machine that a long run cannot).
    Each product is its layer's own call, so it runs the kernel the model uses: the native int8,
    int4 or GEMV product where the layer has one, the int8 GEMM or a stock one where it has not,
    on the threads generation takes while nothing else runs (`Placement.decode_team`)."""
    per_frame, per_group, heads = _products(engine)
    dtype = engine.model.talker.norm.weight.dtype  # activations (float32 for int8 and int4 weights)
    modules = per_frame + per_group + heads
    x = {m.in_features: torch.randn(1, 1, m.in_features, dtype=dtype) for m in modules}

    def product(m):
        return lambda: m(x[m.in_features])

    frame, group = [product(m) for m in per_frame], [product(m) for m in per_group]
    head_calls = [product(m) for m in heads]
    from kazeia import cpu

    team = engine.runtime.placement.decode_team(engine.runtime.decoding, lambda: False, [])
    with torch.inference_mode(), cpu.team(*(team or cpu.Team(None))):
        start = time.perf_counter()
        for _ in range(frames):
            for call in frame:
                call()
            for head in head_calls:
                for call in group:
                    call()
                head()
        return (time.perf_counter() - start) / frames


def weight_reads(engine, size=lambda m: m.in_features * m.out_features) -> int:
    """Weights one frame reads (parameters): the talker's once, the code predictor's per codebook;
    with `size=stored_bytes`, the bytes they are stored in."""
    per_frame, per_group, heads = _products(engine)
    return sum(map(size, per_frame)) + sum(map(size, heads)) + len(heads) * sum(map(size, per_group))


def stored_bytes(m) -> int:
    """Bytes a product's weights are stored in (int8 and int4: their scales included)."""
    return (
        sum(t.numel() * t.element_size() for name, t in m.named_buffers() if name != "bias")
        + sum(p.numel() * p.element_size() for p in m.parameters())
        or m.in_features * m.out_features
    )  # an int8 QuantLinear's packed weight is opaque: 1 byte each


def engine_dtype(engine) -> str:
    from kazeia.int4 import Int4Linear
    from kazeia.quant import QuantLinear

    if any(isinstance(m, Int4Linear) for m in engine.model.modules()):
        return "int4"
    if any(isinstance(m, QuantLinear) for m in engine.model.modules()):
        return "int8"
    return str(engine.model.talker.norm.weight.dtype).removeprefix("torch.")


def run_reference(path: Path, dtype: str, frames: int, repeats: int) -> dict:
    """qwen-tts 0.1.1 on the same checkpoint; EOS is moved to a suppressed id so it never stops early."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from reference import load_reference

    qwen_tts = load_reference()
    start = time.perf_counter()
    ref = qwen_tts.Qwen3TTSModel.from_pretrained(str(path), dtype=getattr(torch, dtype))
    load_s = time.perf_counter() - start
    timers = {"predictor": 0.0, "vocoder": 0.0, "generate": 0.0}

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                timers[name] += time.perf_counter() - t

        return wrapper

    ref.model.talker.code_predictor.generate = timed("predictor", ref.model.talker.code_predictor.generate)
    ref.model.speech_tokenizer.decode = timed("vocoder", ref.model.speech_tokenizer.decode)
    ref.model.generate = timed("generate", ref.model.generate)
    kwargs = dict(speaker=VOICE, language=LANGUAGE, do_sample=False, subtalker_dosample=False, eos_token_id=2151)
    ref.generate_custom_voice(text=TEXT, max_new_tokens=3, **kwargs)  # warm-up
    best = None
    for _ in range(repeats):  # best of `repeats`, as for Kazeia
        timers.update(predictor=0.0, vocoder=0.0, generate=0.0)
        start = time.perf_counter()
        wavs, _ = ref.generate_custom_voice(text=TEXT, max_new_tokens=frames + 1, **kwargs)
        wall = time.perf_counter() - start
        assert len(wavs[0]) == frames * 1920, "the reference stopped early"
        if best is None or wall < best[0]:
            best = (wall, dict(timers))
    wall, timers = best
    audio_s = frames * 1920 / 24000
    return {
        "load_s": load_s,
        "predictor_ms": 1000 * timers["predictor"] / frames,
        "talker_ms": 1000 * (timers["generate"] - timers["predictor"]) / frames,
        "generate_ms": 1000 * timers["generate"] / frames,
        "vocoder_ms": 1000 * timers["vocoder"] / frames,
        "wall_s": wall,
        "rtf": wall / audio_s,
        "peak_rss_gb": peak_rss_gb(),
    }


# -- orchestration -------------------------------------------------------------------------------
@contextlib.contextmanager
def competing(count: int):
    """`count` busy processes (a pure-Python spin each) running for the duration: a neighbour
    that takes a core whenever the scheduler lets it."""
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for process in busy:
            process.kill()
            process.wait()


def spawn(
    kind: str,
    path: Path,
    dtype: str,
    frames: int,
    threads: int | None,
    repeats: int,
    long_frames: int = 0,
    catch_up: int | None = None,
) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        kind,
        "--checkpoint",
        str(path),
        "--dtype",
        dtype,
        "--frames",
        str(frames),
        "--repeats",
        str(repeats),
        "--long-frames",
        str(long_frames),
    ]
    if threads:
        cmd += ["--threads", str(threads)]
    if catch_up:
        cmd += ["--max-chunk-frames", str(catch_up)]
    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    print(f"  running {kind} {dtype} ...", flush=True)
    read_through(path / "model.safetensors")
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        sys.stderr.write(out.stderr)
        return {"error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def results_threads(results: dict) -> str:
    values = sorted({r["threads"] for r in results.values() if "threads" in r})
    return "/".join(map(str, values)) or "-"


def report(results: dict, bandwidth: dict, args, checkpoint: str) -> None:
    cols = [
        ("talker_ms", "talker ms/f"),
        ("predictor_ms", "predictor ms/f"),
        ("generate_ms", "generate ms/f"),
        ("floor_ms", "floor ms/f"),
        ("x_floor", "x floor"),
        ("vocoder_ms", "vocoder ms/f"),
        ("prefill_s", "prefill s"),
        ("ttfb_s", "TTFB s"),
        ("wall_s", "wall s"),
        ("rtf", "RTF"),
        ("peak_rss_gb", "peak RSS GB"),
        ("load_s", "load s"),
        ("first_over_steady", "1st/steady"),
        ("long_dry_s", "long dry s"),
        ("long_rtf", "long RTF"),
    ]
    print(
        f"\n{checkpoint}, {args.frames} frames, greedy, "
        f"threads per stage {results_threads(results)}, {args.contend} competing busy processes; "
        f"machine: {json.dumps(machine())}"
    )
    print(
        "GEMV bandwidth of the floor runs (GB/s of weight bytes, the engine's kernels): "
        + ", ".join(f"{k} {v:.1f}" for k, v in bandwidth.items())
    )
    print(f"{'configuration':<22}" + "".join(f"{label:>15}" for _, label in cols))
    for name, r in results.items():
        if "error" in r:
            print(f"{name:<22}  FAILED: {r['error']}")
            continue
        row = f"{name:<22}"
        for key, _ in cols:
            value = r.get(key)
            row += f"{value:>15.2f}" if isinstance(value, float) else f"{'-':>15}"
        print(row)
    ref = results.get("reference float32")
    if ref and "error" not in ref:
        print("\nratios against the reference in float32 (higher is better):")
        for name, r in results.items():
            if name.startswith("kazeia") and "error" not in r:
                print(
                    f"  {name:<20} generation x{ref['generate_ms'] / r['generate_ms']:.2f}  "
                    f"vocoder x{ref['vocoder_ms'] / r['vocoder_ms']:.2f}  "
                    f"whole synthesis (RTF) x{ref['rtf'] / r['rtf']:.2f}"
                )
    print(
        f"\nfor orientation only, a GGML-based C++ engine measured on another machine ({CPP_ENGINE_MACHINE}; "
        "50 frames, 2 threads): "
        + "; ".join(f"{k}: generate {v['generate_ms']} ms/frame, RTF {v['rtf']}" for k, v in CPP_ENGINE.items())
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_checkpoint_options(parser)
    parser.add_argument("--dtypes", default="float32,bfloat16,int8")
    parser.add_argument("--frames", type=int, default=50)
    parser.add_argument("--threads", type=int, help="torch threads in every process (default: torch's choice)")
    parser.add_argument("--reference", action="store_true", help="also run qwen-tts 0.1.1 (float32)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per figure; the best is kept (default 3)")
    parser.add_argument("--json", help="write all figures to this file")
    parser.add_argument(
        "--contend", type=int, default=0, help="busy processes competing for the CPU during every run (default 0)"
    )
    parser.add_argument(
        "--long-seconds",
        type=float,
        default=20.0,
        help="also stream an utterance this long and report whether real-time playback ran dry (0: skip)",
    )
    parser.add_argument(
        "--prepared", action="store_true", help="load each precision from a checkpoint prepared by kazeia quantize"
    )
    parser.add_argument(
        "--max-chunk-frames", type=int, help="streams whose vocoder falls behind catch up in chunks of up to this many"
    )
    parser.add_argument("--long-frames", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--worker", choices=["kazeia", "reference"], help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    parser.add_argument("--dtype", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.worker:
        checkpoint = Path(args.checkpoint)
        if args.worker == "kazeia":
            figures = run_kazeia(
                checkpoint, args.dtype, args.frames, args.repeats, args.threads, args.long_frames, args.max_chunk_frames
            )
        else:
            figures = run_reference(checkpoint, args.dtype, args.frames, args.repeats)
        print(json.dumps(figures))
        return

    with Checkpoints(args) as checkpoints:
        results = compare(args, checkpoints)
    bandwidth = {d: r["gemv_gbps"] for d, r in results.items() if "gemv_gbps" in r}
    report(results, bandwidth, args, checkpoints.label)
    if args.json:
        payload = {
            "machine": machine(),
            "checkpoint": checkpoints.label,
            "frames": args.frames,
            "bandwidth_gbps": bandwidth,
            "weight_reads_per_frame": next((r["weight_reads"] for r in results.values() if "weight_reads" in r), None),
            "results": results,
            "cpp_engine_other_run": CPP_ENGINE,
        }
        Path(args.json).write_text(json.dumps(payload, indent=2))
    outcomes = Outcomes()
    for name, r in results.items():
        if "error" in r:
            outcomes.failed[name] = r["error"]
    outcomes.exit()


def compare(args, checkpoints: Checkpoints) -> dict:
    """Every configuration in a worker process of its own: name -> its figures or {"error": ...}."""
    dtypes = args.dtypes.split(",")
    results = {}
    long_frames = round(args.long_seconds * 12.5)
    # --prepared: each precision from a checkpoint `kazeia quantize` prepared for it (made before
    # the timed runs, outside any competing load).
    sources = {}
    for dtype in dtypes:
        try:
            sources[dtype] = checkpoints.prepared(dtype) if args.prepared else checkpoints.released
        except Exception as error:  # e.g. `kazeia quantize` refused it: this configuration fails
            results[f"kazeia {dtype}"] = {"error": f"{type(error).__name__}: {error}"}
    with competing(args.contend):
        for dtype in sources:
            results[f"kazeia {dtype}"] = spawn(
                "kazeia", sources[dtype], dtype, args.frames, args.threads, args.repeats, long_frames,
                args.max_chunk_frames,
            )  # fmt: skip
        if args.reference:
            path = checkpoints.released
            results["reference float32"] = spawn("reference", path, "float32", args.frames, args.threads, args.repeats)
    order = [f"kazeia {d}" for d in dtypes] + ["reference float32"] * args.reference
    return {name: results[name] for name in order}


if __name__ == "__main__":
    main()
