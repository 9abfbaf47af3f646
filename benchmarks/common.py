"""Shared by the benchmarks: cached real-size random checkpoints and a description of the machine."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import torch

CACHE = Path(os.environ.get("KAZEIA_BENCH_DIR", Path.home() / ".cache" / "kazeia" / "bench"))


def real_checkpoint(size: str = "0.6B", kind: str = "custom_voice") -> Path:
    """A real-dimension random checkpoint (bfloat16 weights, as released), written once and cached."""
    path = CACHE / f"{size}-{kind}"
    if not (path / "speech_tokenizer" / "model.safetensors").is_file():
        print(f"writing a real-size random {size} {kind} checkpoint to {path} (once) ...", flush=True)
        # In a process of its own, as `prepared_checkpoint` does (the workers inherit peak RSS).
        code = "import sys, torch; from kazeia.testing import write_checkpoint as w; "
        code += "w(sys.argv[1], sys.argv[2], sys.argv[3], tiny=False, seed=0, dtype=torch.bfloat16)"
        subprocess.run([sys.executable, "-c", code, str(path), size, kind], check=True)
    return path


def prepared_checkpoint(size: str, dtype: str, kind: str = "custom_voice") -> Path:
    """`real_checkpoint` prepared for `dtype` by `kazeia quantize` (kazeia/prepared.py), cached."""
    path = CACHE / f"{size}-{kind}-prepared-{dtype}"
    if not (path / "model.safetensors").is_file():
        print(f"preparing {path} for {dtype} (once) ...", flush=True)
        shutil.rmtree(path, ignore_errors=True)
        # In a process of its own: the workers inherit this one's peak RSS, which must stay small.
        command = [sys.executable, "-m", "kazeia", "quantize", str(real_checkpoint(size, kind)), str(path)]
        subprocess.run([*command, "--dtype", dtype], check=True)
    return path


def read_through(path: Path) -> None:
    """Read a file once so that load times measure loading, not the disk: the page cache then
    holds it, as it does on a machine that loaded the model before (what a restart meets)."""
    with open(path, "rb") as f:
        while f.read(64 << 20):
            pass


def precisions(config: str) -> dict:
    """A configuration of `--dtypes`: "DTYPE" or "DTYPE/VOCODER_DTYPE" -> Engine.load keywords."""
    dtype, _, vocoder = config.partition("/")
    return {"dtype": dtype, "vocoder_dtype": vocoder or "float32"}


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


PLAYER_BUFFER_S = 0.160  # what a player holds before it starts


def longest_wait(arrivals: list[tuple[float, float]], buffer_s: float = PLAYER_BUFFER_S) -> float:
    """A stream played as a player would: starting `buffer_s` after its first chunk came, then in
    real time. `arrivals`: per chunk with audio, in order, (when it came, seconds of audio before
    it), times on any one clock. -> the longest time (s) the player waited with nothing to play
    (0.0: it never ran dry); after a wait, playback resumes when the chunk comes."""
    start, worst = None, 0.0
    for at, before in arrivals:
        if start is None:
            start = at + buffer_s
        due = start + before  # when this chunk's first sample must play
        worst = max(worst, at - due)
        if at > due:
            start += at - due
    return worst
