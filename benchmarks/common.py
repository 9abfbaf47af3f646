"""Shared by the benchmarks: the checkpoints a run uses, its failed configurations, and a
description of the machine.

Every script takes `--size`, and `--tiny` or `--model DIR` (`add_checkpoint_options`): by default
the real-size random checkpoint, written once (a few GB, minutes) and cached under CACHE
(`KAZEIA_BENCH_DIR`); `--tiny` a tiny random one, cached likewise (seconds; its figures mean
nothing: it checks that the script runs, as tests/test_benchmarks.py does).
Each configuration a script runs either prints its row or fails; a failure is printed where its row
would be, the other configurations still run, and the script then exits 1 naming it (`Outcomes`).
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

CACHE = Path(os.environ.get("KAZEIA_BENCH_DIR", Path.home() / ".cache" / "kazeia" / "bench"))
T = TypeVar("T")


def real_checkpoint(size: str = "0.6B", kind: str = "custom_voice", tiny: bool = False) -> Path:
    """A random checkpoint of the real dimensions (or tiny ones), bfloat16 weights as released,
    written once and cached."""
    path = CACHE / f"{'tiny-' if tiny else ''}{size}-{kind}"
    if not (path / "speech_tokenizer" / "model.safetensors").is_file():
        print(f"writing a {'tiny' if tiny else 'real-size'} random {size} {kind} checkpoint to {path} (once) ...")
        write(path, size, kind, tiny)
    return path


def write(path: Path, size: str, kind: str, tiny: bool) -> None:
    """kazeia.testing.write_checkpoint in a process of its own (the workers inherit peak RSS)."""
    sys.stdout.flush()
    code = "import sys, torch; from kazeia.testing import write_checkpoint as w; "
    code += "w(sys.argv[1], sys.argv[2], sys.argv[3], tiny=sys.argv[4] == 'tiny', seed=0, dtype=torch.bfloat16)"
    subprocess.run([sys.executable, "-c", code, str(path), size, kind, "tiny" if tiny else "real"], check=True)


def prepare(source: Path, target: Path, dtype: str) -> Path:
    """`source` prepared for `dtype` by `kazeia quantize` (kazeia/prepared.py) into `target`, once."""
    if not (target / "model.safetensors").is_file():
        print(f"preparing {target} for {dtype} (once) ...", flush=True)
        shutil.rmtree(target, ignore_errors=True)
        # In a process of its own: the workers inherit this one's peak RSS, which must stay small.
        command = [sys.executable, "-m", "kazeia", "quantize", str(source), str(target), "--dtype", dtype]
        subprocess.run(command, check=True)
    return target


def add_checkpoint_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size", default="0.6B", choices=["0.6B", "1.7B"])
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--tiny", action="store_true", help="a tiny random checkpoint: checks that the script runs, no figures"
    )
    source.add_argument("--model", type=Path, help="this checkpoint directory instead of the real-size random one")


class Checkpoints:
    """The checkpoints of one run (a `with` block): the released layout and, per precision, one
    prepared by `kazeia quantize`. The random ones (real-size or `--tiny`) and their prepared forms
    are cached under CACHE; those prepared from `--model` live in a temporary directory removed at
    the end."""

    def __init__(self, args: argparse.Namespace, kind: str = "custom_voice"):
        self.size, self.kind = args.size, kind
        self.tiny, self.model = getattr(args, "tiny", False), getattr(args, "model", None)
        self._temporary: Path | None = None

    def __enter__(self) -> Checkpoints:
        if self.model is not None:
            self._temporary = Path(tempfile.mkdtemp(prefix="kazeia-bench-"))
        return self

    def __exit__(self, *exc) -> None:
        if self._temporary is not None:
            shutil.rmtree(self._temporary, ignore_errors=True)

    @property
    def label(self) -> str:
        what = f"{self.size} {self.kind}"
        if self.tiny:
            return f"tiny random {what} (a check that the script runs: the figures mean nothing)"
        if self.model is not None:
            return f"checkpoint {self.model}"
        return f"{what}, real dimensions, random weights"

    @property
    def released(self) -> Path:
        return self.model if self.model is not None else real_checkpoint(self.size, self.kind, self.tiny)

    def prepared(self, dtype: str) -> Path:
        """The released checkpoint prepared for `dtype` (e.g. "int8"; "int8/bfloat16" takes its first part)."""
        dtype = dtype.partition("/")[0]
        if self.model is None:
            target = CACHE / f"{'tiny-' if self.tiny else ''}{self.size}-{self.kind}-prepared-{dtype}"
        elif self._temporary is not None:
            target = self._temporary / f"prepared-{dtype}"
        else:
            raise RuntimeError("Checkpoints must be used in a with block")
        return prepare(self.released, target, dtype)


class Outcomes:
    """Which configurations of a run failed. `run(name, fn)` returns fn()'s result, or None after
    printing `name` as failed (with the error's last line, the traceback on stderr); `exit()` ends
    the script with status 1, naming them, if any failed."""

    def __init__(self) -> None:
        self.failed: dict[str, str] = {}

    def run(self, name: str, fn: Callable[[], T]) -> T | None:
        try:
            return fn()
        except Exception as error:
            traceback.print_exc()
            self.fail(name, f"{type(error).__name__}: {error}")
            return None

    def fail(self, name: str, reason: str) -> None:
        lines = reason.strip().splitlines() or ["failed"]
        self.failed[name] = lines[-1]
        print(f"{name}: FAILED: {self.failed[name]}", flush=True)

    def exit(self) -> None:
        if self.failed:
            print(f"\n{len(self.failed)} configuration(s) failed: {', '.join(self.failed)}", file=sys.stderr)
            raise SystemExit(1)


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
    from kazeia import cpu

    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": model,
        "isa": ",".join(sorted(cpu.enabled())) or "portable",  # the paths Kazeia uses (KAZEIA_ISA)
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


def concurrently(client: Callable[[int], object], count: int) -> float:
    """`client(0)` .. `client(count - 1)`, each on its own thread, all started at once -> the wall
    seconds until the last has returned."""
    started = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - started
