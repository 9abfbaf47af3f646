"""Start-up: load time and first synthesis, from the released checkpoint and from one prepared by
`kazeia quantize`, each in fresh processes.

    python benchmarks/load.py [--size 0.6B] [--tiny | --model DIR] [--dtypes float32,bfloat16,int8]
                              [--repeats 3] [--frames 10]

Each (precision, source) pair is loaded `--repeats` times, alternating between the sources, each
time in a new process with the file read through once just before (the page cache holds it, as on
a machine that has loaded the model before: this measures loading, not the disk). Printed per
pair: load seconds (best and median), the first `--frames`-frame synthesis after loading, and the
peak RSS of the process. A configuration of `--dtypes` is DTYPE or DTYPE/VOCODER_DTYPE.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Checkpoints, Outcomes, add_checkpoint_options, machine, precisions, read_through

WORKER = """
import json, resource, sys, time
started = time.perf_counter()
from kazeia import Engine
engine = Engine.load(sys.argv[1], **json.loads(sys.argv[2]))
load_s = time.perf_counter() - started
speech = engine.synthesize("Start-up time.", voice="ryan", do_sample=False, subtalker_dosample=False,
                           ignore_eos=True, max_new_tokens=int(sys.argv[3]) + 1)
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
print(json.dumps({"load_s": load_s, "first_s": speech.metrics.wall_s, "rss_gb": rss}))
"""
HEADER = (("dtype", 16), ("source", 9), ("load s best", 12), ("load s median", 14), ("first s", 9), ("peak RSS GB", 12))


def measure(path: Path, config: str, frames: int) -> dict:
    read_through(path / "model.safetensors")
    command = [sys.executable, "-c", WORKER, str(path), json.dumps(precisions(config)), str(frames)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        sys.stderr.write(done.stderr)
        raise RuntimeError(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def pair(checkpoints: Checkpoints, config: str, repeats: int, frames: int) -> dict[str, list[dict]]:
    """`repeats` loads of each source, alternating, so both see the same machine."""
    sources = {"released": checkpoints.released, "prepared": checkpoints.prepared(config)}
    runs: dict[str, list[dict]] = {name: [] for name in sources}
    for _ in range(repeats):
        for name, path in sources.items():
            runs[name].append(measure(path, config, frames))
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_checkpoint_options(parser)
    parser.add_argument("--dtypes", default="float32,bfloat16,int8")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--frames", type=int, default=10, help="frames of the first synthesis")
    args = parser.parse_args()
    outcomes = Outcomes()
    with Checkpoints(args) as checkpoints:
        print(f"{checkpoints.label}; {json.dumps(machine())}")
        print(" ".join(f"{name:{'<' if i < 2 else '>'}{width}}" for i, (name, width) in enumerate(HEADER)), flush=True)
        for config in args.dtypes.split(","):
            runs = outcomes.run(config, lambda config=config: pair(checkpoints, config, args.repeats, args.frames))
            for name, figures in (runs or {}).items():
                loads = [f["load_s"] for f in figures]
                first = min(f["first_s"] for f in figures)
                rss = max(f["rss_gb"] for f in figures)
                cells = f"{min(loads):12.2f} {statistics.median(loads):14.2f} {first:9.2f} {rss:12.2f}"
                print(f"{config:16} {name:9} {cells}")
    outcomes.exit()


if __name__ == "__main__":
    main()
