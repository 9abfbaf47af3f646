"""Where the time to first audio goes: one client, a 3-sentence text, the first chunk one frame.

    python benchmarks/first_audio.py [--size 0.6B] [--tiny | --model DIR] [--dtypes int4,int8]
                                     [--runs 9] [--text TEXT] [--trees DIR_A,DIR_B] [--rounds 5]
                                     [--json out.json]

Each precision loads its prepared checkpoint (benchmarks/common.py: the real-size random one by
default) in a process of its own, which opens `Engine.stream(text, first_chunk_frames=1)` `--runs`
times, takes the first chunk and closes the stream. The engine's steps are timed by wrapping them from outside, in the
order the first chunk needs them:

  request    the text tokenized and the request validated (`build_request`)
  setup      from there to the prompt: the stream, its generation thread
  prompt     the prompt's input vectors (`build_prompt`)
  voice      the talker over the voice's positions (0 once they are cached)
  prefill    the talker over the text's positions
  codebook0  the talker's head and the first frame's codebook-0 sample
  predictor  the code predictor's 15 steps of that frame
  handoff    from the frame to the vocoder starting on it (the queue between the threads)
  vocoder    the first chunk's decode
  out        from there to the chunk in the caller's hands
  total      the call to the first chunk (time to first audio)

Printed: each step's p50 over the runs after the first, and the first run after loading on its own
(first-call costs). With `--trees`, each precision runs once per source tree (PYTHONPATH), the
trees' processes taking turns run by run (`--rounds` of `--runs` each), so that a before/after
comparison sees the same machine; the ratios of their p50s are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Checkpoints, Outcomes, add_checkpoint_options, machine

TEXT = (
    "The morning train was late again, so Mara walked down to the harbour instead. "
    "The fishermen were already back, sorting the night's catch under a low grey sky. "
    "She bought two mackerel, a warm loaf of bread, and a newspaper she would never read."
)
VOICE, LANGUAGE = "serena", "english"
STEPS = ("request", "setup", "prompt", "voice", "prefill", "codebook0", "predictor", "handoff", "vocoder", "out")


class Marks:
    """Start and end (perf_counter) of the first call of each wrapped function since `reset`."""

    def __init__(self) -> None:
        self.at: dict[str, tuple[float, float]] = {}

    def reset(self) -> None:
        self.at = {}

    def wrap(self, owner, attribute: str, name: str) -> None:
        inner = getattr(owner, attribute)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.at.setdefault(name, (start, time.perf_counter()))

        setattr(owner, attribute, timed)


def instrument(engine) -> Marks:
    """Wrap the steps of the first chunk's path (module docstring)."""
    from kazeia import engine as engine_module
    from kazeia import utterance

    marks = Marks()
    step = engine.runtime.step
    marks.wrap(engine_module, "build_request", "request")
    marks.wrap(utterance, "build_prompt", "prompt")
    marks.wrap(step, "_voice_positions", "voice")
    marks.wrap(step, "_frames", "frame")
    marks.wrap(step, "_predict", "predictor")
    marks.wrap(engine.vocoder, "decode_chunk", "vocoder")
    return marks


def one_run(engine, marks: Marks, text: str, seed: int) -> dict[str, float]:
    """One stream to its first chunk -> seconds per step (module docstring)."""
    marks.reset()
    start = time.perf_counter()
    stream = engine.stream(text, voice=VOICE, language=LANGUAGE, seed=seed, first_chunk_frames=1)
    with stream:
        next(stream)
        got = time.perf_counter()
    at = marks.at
    voiced = at.get("voice")  # absent where the prompt has no voice positions
    return {
        "request": at["request"][1] - at["request"][0],
        "setup": at["prompt"][0] - at["request"][1],
        "prompt": at["prompt"][1] - at["prompt"][0],
        "voice": voiced[1] - voiced[0] if voiced else 0.0,
        "prefill": at["frame"][0] - (voiced[1] if voiced else at["prompt"][1]),
        "codebook0": at["predictor"][0] - (at["frame"][0]),
        "predictor": at["predictor"][1] - at["predictor"][0],
        "handoff": at["vocoder"][0] - at["frame"][1],
        "vocoder": at["vocoder"][1] - at["vocoder"][0],
        "out": got - at["vocoder"][1],
        "total": got - start,
    }


def worker(checkpoint: Path, config: str) -> None:
    """Load one precision, then answer each stdin line "RUNS SEED TEXT-JSON" with one JSON line:
    the list of runs' step times."""
    from common import precisions

    from kazeia import Engine

    engine = Engine.load(checkpoint, **precisions(config))
    marks = instrument(engine)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        runs, seed, text = line.split(" ", 2)
        out = [one_run(engine, marks, json.loads(text), int(seed) + i) for i in range(int(runs))]
        print(json.dumps(out), flush=True)


def start_worker(tree: Path, checkpoint: Path, config: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(tree))
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", str(checkpoint), "--dtypes", config]
    process = subprocess.Popen(command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=tree)
    line = process.stdout.readline()  # type: ignore[union-attr]
    if not line or not json.loads(line).get("ready"):
        process.kill()
        process.wait()
        raise RuntimeError(f"the {config} worker on {tree} did not start (exit {process.returncode})")
    return process


def ask(process: subprocess.Popen, runs: int, seed: int, text: str) -> list[dict[str, float]]:
    process.stdin.write(f"{runs} {seed} {json.dumps(text)}\n")  # type: ignore[union-attr]
    process.stdin.flush()  # type: ignore[union-attr]
    return json.loads(process.stdout.readline())  # type: ignore[union-attr]


def p50(runs: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(run[key] for run in runs) for key in (*STEPS, "total")}


def table(title: str, rows: dict[str, dict[str, float]]) -> None:
    print(f"\n{title} (ms)")
    print(f"{'':22}" + "".join(f"{s:>10}" for s in (*STEPS, "total")))
    for name, figures in rows.items():
        print(f"{name:22}" + "".join(f"{1000 * figures[s]:10.1f}" for s in (*STEPS, "total")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_options(parser)
    parser.add_argument("--dtypes", default="int4,int8")
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--text", default=TEXT)
    parser.add_argument("--trees", default=str(Path(__file__).resolve().parent.parent))
    parser.add_argument("--json")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        return worker(args.worker, args.dtypes)
    trees = [Path(t).resolve() for t in args.trees.split(",")]
    configs = args.dtypes.split(",")
    print(json.dumps(machine()))
    outcomes = Outcomes()
    with Checkpoints(args) as checkpoints:
        print(checkpoints.label)
        workers = {}
        for config in configs:
            path = outcomes.run(config, lambda config=config: checkpoints.prepared(config))
            for tree in trees if path is not None else ():
                name = f"{config} {tree.name}" if len(trees) > 1 else config
                started = outcomes.run(name, lambda t=tree, p=path, c=config: start(t, p, c, args.text))
                if started is not None:
                    workers[(tree, config)] = started
        runs = measure(workers, args, outcomes)
    report(runs, trees, configs, args.json)
    outcomes.exit()


def start(tree: Path, checkpoint: Path, config: str, text: str) -> tuple[subprocess.Popen, dict[str, float]]:
    """A worker on `tree` -> it and its first run after loading."""
    process = start_worker(tree, checkpoint, config)
    return process, ask(process, 1, 0, text)[0]


def measure(workers: dict, args, outcomes: Outcomes) -> dict[tuple[Path, str], dict]:
    """The workers' runs, the trees taking turns: (tree, config) -> {"first", "runs"}."""
    out = {key: {"first": first, "runs": []} for key, (_, first) in workers.items()}
    for round_ in range(args.rounds):
        for key, (process, _) in list(workers.items()):
            got = outcomes.run(
                " ".join(map(str, key)), lambda p=process, r=round_: ask(p, args.runs, 1 + r * args.runs, args.text)
            )
            if got is None:
                workers.pop(key)
                out.pop(key)
            else:
                out[key]["runs"] += got
    for process, _ in workers.values():
        process.stdin.close()  # type: ignore[union-attr]
        process.wait()
    return out


def report(out: dict[tuple[Path, str], dict], trees: list[Path], configs: list[str], json_path: str | None) -> None:
    label = {key: f"{key[1]} {key[0].name}" if len(trees) > 1 else key[1] for key in out}
    table("first run after loading", {label[key]: got["first"] for key, got in out.items()})
    medians = {key: p50(got["runs"]) for key, got in out.items()}
    table(
        f"p50 of {len(next(iter(out.values()))['runs']) if out else 0} runs", {label[k]: m for k, m in medians.items()}
    )
    for config in configs:
        base = medians.get((trees[0], config))
        for tree in trees[1:]:
            mine = medians.get((tree, config))
            if base is None or mine is None:
                continue
            ratios = {s: mine[s] / base[s] if base[s] else float("nan") for s in ("prefill", "total")}
            print(f"{config} {tree.name} / {trees[0].name}: prefill x{ratios['prefill']:.2f}, "
                  f"total x{ratios['total']:.2f}")  # fmt: skip
    if json_path:
        data = {
            label[key]: {"first": got["first"], "p50": medians[key], "runs": got["runs"]} for key, got in out.items()
        }
        Path(json_path).write_text(json.dumps(data, indent=1))


if __name__ == "__main__":
    main()
