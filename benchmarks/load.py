"""Start-up: load time and first synthesis, from the released checkpoint and from one prepared by
`kazeia quantize`, each in fresh processes.

    python benchmarks/load.py [--size 0.6B] [--dtypes float32,bfloat16,int8] [--repeats 3]

Each (precision, source) pair is loaded `--repeats` times, alternating between the sources, each
time in a new process with the file read through once just before (the page cache holds it, as on
a machine that has loaded the model before: this measures loading, not the disk). Printed per
pair: load seconds (best and median), the first 10-frame synthesis after loading, and the peak RSS
of the process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from common import machine, prepared_checkpoint, read_through, real_checkpoint

WORKER = """
import json, resource, sys, time
started = time.perf_counter()
from kazeia import Engine
engine = Engine.load(sys.argv[1], dtype=sys.argv[2])
load_s = time.perf_counter() - started
speech = engine.synthesize("Start-up time.", voice="ryan", do_sample=False, subtalker_dosample=False,
                           ignore_eos=True, max_new_tokens=11)
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
print(json.dumps({"load_s": load_s, "first_s": speech.metrics.wall_s, "rss_gb": rss}))
"""


def measure(path: Path, dtype: str) -> dict:
    read_through(path / "model.safetensors")
    done = subprocess.run([sys.executable, "-c", WORKER, str(path), dtype], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-2000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="0.6B", choices=["0.6B", "1.7B"])
    parser.add_argument("--dtypes", default="float32,bfloat16,int8")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    released = real_checkpoint(args.size)
    print(json.dumps(machine()))
    header = ("dtype", 10), ("source", 9), ("load s best", 12), ("load s median", 14), ("first 10 f s", 13)
    print(" ".join(f"{name:{'<' if i < 2 else '>'}{width}}" for i, (name, width) in enumerate(header)), "peak RSS GB")
    for dtype in args.dtypes.split(","):
        sources = {"released": released, "prepared": prepared_checkpoint(args.size, dtype)}
        runs: dict[str, list[dict]] = {name: [] for name in sources}
        for _ in range(args.repeats):
            for name, path in sources.items():  # alternating, so both see the same machine
                runs[name].append(measure(path, dtype))
        for name, figures in runs.items():
            loads = [f["load_s"] for f in figures]
            first = min(f["first_s"] for f in figures)
            rss = max(f["rss_gb"] for f in figures)
            print(f"{dtype:10} {name:9} {min(loads):12.2f} {statistics.median(loads):14.2f} {first:13.2f} {rss:12.2f}")


if __name__ == "__main__":
    main()
