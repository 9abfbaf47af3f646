"""`speed`: Kazeia's WSOLA against the alternatives on espeak-ng speech, and its cost per frame.

    python benchmarks/speed.py [--speeds 0.5,0.75,1.25,1.5,2,3] [--clips en,fr,de,es] [--frames 50]
                               [--size 0.6B] [--tiny | --model DIR] [--json out.json]

Clips: one sentence in each of four languages spoken by espeak-ng at 160 words per minute,
resampled to 24 kHz. For each speed and method: duration error (output length against input /
speed), F0 error (median pYIN F0 of the voiced frames against the input's), and the spectral distance
to espeak-ng's own reading of the same text at 160 * speed words per minute (mean log-mel distance
along a DTW path: lower is closer to a natural faster or slower reading). Methods: `kazeia`
(kazeia/speed.py), librosa's phase vocoder (`librosa.effects.time_stretch`), and Rubber Band's
command line when one is installed (GPL: a comparison only). Cost: milliseconds per 80 ms frame
(1920 samples) of output, beside the vocoder's own per frame on a real-size random checkpoint,
whose output on random codes is also stretched (a reference for cost and duration only; `--tiny`:
a tiny one, a check that the script runs). A row that fails prints a FAILED line, the others still
run, and the script exits 1.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import librosa
import numpy as np
import soundfile as sf
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent / "tests"))  # the espeak-ng helper
from clone_support import ESPEAK_RATE, espeak
from common import Checkpoints, Outcomes, add_checkpoint_options, machine

from kazeia.audio import SAMPLE_RATE, resample
from kazeia.speed import output_length, stretch
from kazeia.vocoder import Vocoder

BASE_WPM = 160  # espeak-ng's rate for the input clips (its range is 80-450, sonic beyond)
CLIPS = {
    "en": "The quick brown fox jumps over the lazy dog, and then it runs away into the forest.",
    "fr": "Le petit chat dort sur le canapé pendant que la pluie tombe doucement dehors.",
    "de": "Der schnelle braune Fuchs springt über den faulen Hund und läuft in den Wald.",
    "es": "El perro corre por el parque mientras los niños juegan con la pelota roja.",
}
FRAME = 1920  # samples per 80 ms frame at 24 kHz


def spoken(directory: Path, language: str, wpm: int) -> np.ndarray:
    path = espeak(directory / f"{language}-{wpm}.wav", CLIPS[language], language, rate=wpm)
    audio, _ = sf.read(path, dtype="float32")
    return resample(audio, ESPEAK_RATE, SAMPLE_RATE)


def median_f0(audio: np.ndarray) -> float:
    """Median pYIN F0 (Hz) of the voiced frames (NaN when none is voiced), as tests/test_speed.py."""
    f0, voiced, _ = librosa.pyin(audio, fmin=60, fmax=400, sr=SAMPLE_RATE, frame_length=2048)
    return float(np.median(f0[voiced])) if voiced.any() else float("nan")


def log_mel(audio: np.ndarray) -> np.ndarray:
    mel = librosa.feature.melspectrogram(y=audio, sr=SAMPLE_RATE, n_fft=1024, hop_length=256, n_mels=64)
    return np.log(mel + 1e-6)


def dtw_distance(audio: np.ndarray, target: np.ndarray) -> float:
    """Mean Euclidean log-mel distance per step of the DTW path between the two."""
    a, b = log_mel(audio), log_mel(target)
    cost, path = librosa.sequence.dtw(X=a, Y=b, metric="euclidean")
    return float(cost[-1, -1] / len(path))


def phase_vocoder(audio: np.ndarray, speed: float) -> np.ndarray:
    return librosa.effects.time_stretch(audio, rate=speed)


def rubberband(audio: np.ndarray, speed: float) -> np.ndarray:
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp) / "in.wav", Path(tmp) / "out.wav"
        sf.write(src, audio, SAMPLE_RATE, subtype="FLOAT")
        subprocess.run(["rubberband", "-q", "-T", str(speed), str(src), str(dst)], check=True, capture_output=True)
        out, _ = sf.read(dst, dtype="float32")
    return out


def timed(method, audio: np.ndarray, speed: float) -> tuple[np.ndarray, float]:
    """The output and its cost in ms per 80 ms frame of output (best of 3)."""
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        out = method(audio, speed)
        best = min(best, time.perf_counter() - start)
    return out, 1000 * best / (len(out) / FRAME)


def vocoder_reference(path: Path, speeds: list[float], frames: int = 50) -> dict:
    """The vocoder's ms per frame on random codes, and the stretch's on its output."""
    vocoder = Vocoder.load(path / "speech_tokenizer")
    codes = torch.randint(0, vocoder.cfg.codebook_size, (1, frames, 16), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        vocoder(codes[:, :5])  # warm-up
        start = time.perf_counter()
        audio = vocoder(codes)[0].float().numpy()
    ms = 1000 * (time.perf_counter() - start) / frames
    rows = {}
    for speed in speeds:
        out, cost = timed(stretch, audio, speed)
        rows[speed] = {"duration_error_pct": duration_error(out, audio, speed), "ms_per_frame": cost}
    return {"vocoder_ms_per_frame": ms, "stretch": rows}


def duration_error(out: np.ndarray, audio: np.ndarray, speed: float) -> float:
    return 100 * abs(len(out) / (len(audio) / speed) - 1)


def method_row(method, clips: dict, targets: dict, f0: dict, speed: float) -> dict:
    """One method at one speed over every clip: duration, F0 and DTW errors, cost."""
    row: dict = {"speed": speed, "duration": [], "f0": [], "dtw": [], "ms": []}
    for lang, audio in clips.items():
        out, cost = timed(method, audio, speed)
        row["duration"].append(duration_error(out, audio, speed))
        row["f0"].append(100 * abs(median_f0(out) / f0[lang] - 1))
        row["dtw"].append(dtw_distance(out, targets[lang]))
        row["ms"].append(cost)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--speeds", default="0.5,0.75,1.25,1.5,2,3")
    parser.add_argument("--clips", default=",".join(CLIPS), help=f"languages of the clips, from {','.join(CLIPS)}")
    parser.add_argument("--frames", type=int, default=50, help="frames of the vocoder reference")
    add_checkpoint_options(parser)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    torch.set_num_threads(1)
    speeds = [float(s) for s in args.speeds.split(",")]
    languages = args.clips.split(",")
    methods = {"kazeia": stretch, "librosa phase vocoder": phase_vocoder}
    if shutil.which("rubberband"):
        methods["rubberband (GPL, comparison)"] = rubberband
    results: dict = {"machine": machine(), "rows": []}
    outcomes = Outcomes()
    with tempfile.TemporaryDirectory() as tmp:
        clips = {lang: spoken(Path(tmp), lang, BASE_WPM) for lang in languages}
        f0 = {lang: median_f0(audio) for lang, audio in clips.items()}
        print("| speed | method | duration error % | F0 error % (max) | log-mel DTW to espeak-ng | ms / 80 ms frame |")
        print("|---|---|---|---|---|---|")
        for speed in speeds:
            targets = {lang: spoken(Path(tmp), lang, round(BASE_WPM * speed)) for lang in languages}
            unchanged = np.mean([dtw_distance(clips[lang], targets[lang]) for lang in languages])
            natural = max(100 * abs(median_f0(targets[lang]) / f0[lang] - 1) for lang in languages)
            label = "(input, unstretched; F0: espeak-ng's own reading)"
            print(f"| {speed:g} | {label} | | {natural:.1f} | {unchanged:.3f} | |")
            for name, method in methods.items():
                run = lambda method=method, targets=targets, speed=speed: method_row(method, clips, targets, f0, speed)  # noqa: E731
                row = outcomes.run(f"speed {speed:g} {name}", run)
                if row is None:
                    continue
                results["rows"].append({"method": name, **row})
                print(
                    f"| {speed:g} | {name} | {max(row['duration']):.3f} | {max(row['f0']):.1f} | "
                    f"{np.mean(row['dtw']):.3f} | {np.median(row['ms']):.2f} |",
                    flush=True,
                )
    with Checkpoints(args) as checkpoints:
        voc = outcomes.run("vocoder", lambda: vocoder_reference(checkpoints.released, speeds, args.frames))
        label = checkpoints.label
    if voc is not None:
        results["vocoder"] = voc
        print(f"\nvocoder ({label}): {voc['vocoder_ms_per_frame']:.1f} ms per frame (1 thread); on its output:")
        for speed, row in voc["stretch"].items():
            n = output_length(args.frames * FRAME, speed)
            error = row["duration_error_pct"]
            print(f"  speed {speed:g}: {row['ms_per_frame']:.2f} ms per frame, {n} samples, error {error:.3f} %")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=float))
    outcomes.exit()


if __name__ == "__main__":
    main()
