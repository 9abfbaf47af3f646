"""Every script in benchmarks/ runs: each on a tiny random checkpoint (`--tiny`), for a couple of
frames, at every precision it takes, in one process per script; it must exit 0 and print a row for
every configuration. A configuration that fails must make its script exit 1 after the other rows
(benchmarks/common.py, `Outcomes`), never be printed as a row of an exit-0 run. Speed is not
checked here: these figures mean nothing (BENCHMARKS.md has the real ones).

The scripts share one checkpoint cache, filled first (the tiny checkpoint and its prepared forms),
and run two at a time: most of their time is starting Python and torch, one core each.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kazeia import cpu

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
PRECISIONS = ["float32", "bfloat16", "float16", "int8", "int4"]
CONFIGS = [*PRECISIONS, "int8/bfloat16"]  # and a reduced vocoder
QUALITY = ["bfloat16", "float16", "int8", "int4", "q4_k_m", "q4_k_m/exact", "bfloat16/bfloat16"]
TINY = ["--tiny", "--size", "0.6B"]
CHART = Path(tempfile.gettempdir()) / f"kazeia-qualify-{os.getpid()}.png"  # qualify.py's chart


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


SMOKE = {  # script -> its arguments for a smoke run (the longest first)
    "soak.py": ["--seconds", "30", "--clients", "6"],
    "bench.py": [*TINY, "--dtypes", ",".join(CONFIGS), "--frames", "2", "--repeats", "1", "--long-seconds", "0.24",
                 "--reference"],
    "load.py": [*TINY, "--dtypes", ",".join(CONFIGS), "--frames", "2", "--repeats", "1"],
    "quality.py": [*TINY, "--dtypes", ",".join(QUALITY), "--frames", "2"],
    "batch.py": [*TINY, "--dtypes", ",".join(CONFIGS), "--frames", "2", "--requests", "2", "--gap", "0.01",
                 "--concurrency", "solo,2,2q,2/1"],
    "streaming.py": [*TINY, "--dtypes", ",".join(CONFIGS), "--frames", "2"],
    "burst.py": [*TINY, "--dtypes", ",".join(CONFIGS), "--frames", "2", "--rounds", "1", "--streams", "2"],
    "speed.py": [*TINY, "--speeds", "1.5", "--clips", "en", "--frames", "4"],
    "first_audio.py": [*TINY, "--dtypes", "int4,int8", "--runs", "2"],
    "gemv.py": ["--tiny", "--dtypes", ",".join(PRECISIONS)],
    "vocoder.py": ["--tiny", "--frames", "4", "--rounds", "1", "--chunks", "1,3", "--threads", "1,2", "--dtypes",
                   "float32,int8"],
    "conv8.py": ["--tiny", "--rounds", "1", "--threads", "1,2"],
    "scale_out.py": [*TINY, "--clients", "1", "--requests", "1", "--frames", "2", "--rounds", "1"],
    "qualify.py": [*TINY, "--dtype", "int8", "--levels", "1,2", "--requests", "1", "--frames", "3", "--port",
                   str(free_port()), "--admission", "all", "--png", str(CHART)],  # every request answered
}  # fmt: skip


PORTABLE = {**cpu.library_caps(frozenset()), "KAZEIA_ISA": "portable"}  # as on a CPU without AVX2
RUNS = {  # name -> (script, arguments, environment)
    **{script: (script, args, {}) for script, args in SMOKE.items()},
    "portable streaming": ("streaming.py", SMOKE["streaming.py"], PORTABLE),
    "failing gemv": ("gemv.py", ["--tiny", "--dtypes", "int8,int3,float32"], {}),
    "batched vocoder": ("vocoder.py", ["--tiny", "--frames", "4", "--rounds", "1", "--chunks", "1,3", "--threads", "1",
                                       "--dtypes", "int8", "--streams", "2"], {}),
}  # fmt: skip
WARM = """
import argparse, sys
sys.path.insert(0, sys.argv[1])
from common import Checkpoints
with Checkpoints(argparse.Namespace(size="0.6B", tiny=True, model=None)) as checkpoints:
    for dtype in sys.argv[2:]:
        checkpoints.prepared(dtype)
"""


def run(script: str, args: list[str], cache: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    environment = {**os.environ, "KAZEIA_BENCH_DIR": str(cache), "PYTHONPATH": str(ROOT), **env}
    command = [sys.executable, str(BENCHMARKS / script), *args]
    return subprocess.run(command, capture_output=True, text=True, env=environment, timeout=900, cwd=ROOT)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every smoke run, started two at a time: name -> its future CompletedProcess."""
    cache = tmp_path_factory.mktemp("bench-cache")  # KAZEIA_BENCH_DIR: checkpoints written once for all
    environment = {**os.environ, "KAZEIA_BENCH_DIR": str(cache), "PYTHONPATH": str(ROOT)}
    warm = [sys.executable, "-c", WARM, str(BENCHMARKS), *PRECISIONS]
    subprocess.run(warm, check=True, capture_output=True, env=environment, timeout=900)
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(run, script, args, cache, env) for name, (script, args, env) in RUNS.items()}
        yield futures
        for future in futures.values():
            future.cancel()


def ran(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    assert "FAILED" not in done.stdout, done.stdout[-4000:]
    return done.stdout


def json_rows(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith('{"dtype"')]


def numbers(cells: list[str]) -> list[float]:
    return [float(c) for c in cells if c != "-"]


def test_every_benchmark_script_has_a_smoke_run():
    scripts = {p.name for p in BENCHMARKS.glob("*.py")} - {"common.py"}
    assert scripts == set(SMOKE), "a script without a smoke run here (or one that is gone)"


def test_bench(runs):
    out = ran(runs["bench.py"].result())
    names = ("kazeia ", "reference ")
    table = {line.split("  ")[0].strip(): line for line in out.splitlines() if line.startswith(names)}
    for name in [*(f"kazeia {c}" for c in CONFIGS), "reference float32"]:
        assert name in table, (name, out[-3000:])
        cells = table[name][len(name) :].split()
        assert len(cells) == 15 and numbers(cells), table[name]  # every column, figures where they apply
    assert "GEMV bandwidth of the floor runs" in out and "ratios against the reference" in out


def test_streaming(runs):
    out = ran(runs["streaming.py"].result())
    for config in CONFIGS:
        line = next((line for line in out.splitlines() if line.split()[:1] == [config]), None)
        assert line is not None and len(numbers(line.split()[1:])) == 11, (config, out[-3000:])


def test_quality(runs):
    out = ran(runs["quality.py"].result())
    for config in QUALITY:
        line = next((line for line in out.splitlines() if line.split()[:1] == [config]), None)
        assert line is not None and len(line.split()) == 7, (config, out[-3000:])
    assert "int8 / bfloat16 relative error" in out and "int4 / Q4_K_M relative error" in out
    for vocoder in ("bfloat16", "float16", "int8"):  # the vocoder alone against float32: SNR, log-mel distance
        line = next((line for line in out.splitlines() if line.split()[:2] == ["vocoder", vocoder]), None)
        assert line is not None and len(numbers(line.split()[2:])) == 2, (vocoder, out[-3000:])


def test_load(runs):
    out = ran(runs["load.py"].result())
    for config in CONFIGS:
        for source in ("released", "prepared"):
            line = next((line for line in out.splitlines() if line.split()[:2] == [config, source]), None)
            assert line is not None and len(numbers(line.split()[2:])) == 4, (config, source, out[-3000:])


def test_batch(runs):
    out = ran(runs["batch.py"].result())
    got = {(f"{r['dtype']}/{r['vocoder_dtype']}", r["concurrency"]): r for r in json_rows(out)}
    for config in CONFIGS:
        name = config if "/" in config else f"{config}/float32"
        for level in ("solo", "2", "2q", "2/1"):
            row = got.get((name, level))
            assert row is not None and row["streams"] == 2 and row["audio_s"] > 0, (name, level, out[-3000:])


def test_burst(runs):
    out = ran(runs["burst.py"].result())
    got = {r["dtype"]: r for r in json_rows(out)}
    assert set(got) == set(CONFIGS) and all(r["streams"] == 2 for r in got.values()), out[-3000:]


def test_gemv(runs):
    out = ran(runs["gemv.py"].result())
    for dtype in PRECISIONS:
        assert any(line.startswith(dtype) and line.endswith("GB/s") for line in out.splitlines()), (dtype, out)
    assert any(line.startswith("read") for line in out.splitlines())


def test_speed(runs):
    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed (Debian package espeak-ng; scripts/install.sh --test installs it)")
    out = ran(runs["speed.py"].result())
    assert "| 1.5 | kazeia |" in out and "| 1.5 | librosa phase vocoder |" in out, out
    assert "ms per frame (1 thread)" in out and "speed 1.5:" in out


def test_first_audio(runs):
    out = ran(runs["first_audio.py"].result())
    p50 = out.split("p50 of 2 runs (ms)")[1].splitlines()
    assert p50[1].split() == ["request", "setup", "prompt", "voice", "prefill", "codebook0", "predictor", "handoff",
                              "vocoder", "out", "total"], out  # fmt: skip
    for config in ("int4", "int8"):
        row = next((line.split() for line in p50 if line.split()[:1] == [config]), None)
        assert row is not None and len(numbers(row[1:])) == 11 and float(row[-1]) > 0, (config, out[-3000:])


def test_vocoder(runs):
    out = ran(runs["vocoder.py"].result())
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["1"], ["2"])]
    assert [row[:2] for row in rows] == [["1", "1"], ["1", "3"], ["2", "1"], ["2", "3"]], out
    assert all(len(numbers(row)) >= 4 for row in rows), out  # ms/f per dtype (and ratios with several)
    for dtype in ("float32", "int8"):
        assert f"{dtype}: the same bits at every chunk size and thread count: True" in out, out


def test_vocoder_streams_alone_and_batched(runs):
    out = ran(runs["batched vocoder"].result())
    rows = [line.split() for line in out.splitlines() if line.split()[:1] == ["1"]]
    assert [row[:2] for row in rows] == [["1", "1"], ["1", "3"]], out
    assert all(len(numbers(row)) == 7 for row in rows), out  # ms/f alone and batched, and their ratio
    assert "this: the same bits at every chunk size and thread count, batched or not: True" in out, out


def test_conv8(runs):
    out = ran(runs["conv8.py"].result())
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["1"], ["2"])]
    assert rows and {row[0] for row in rows} == {"1", "2"}, out
    assert all(len(numbers(row)) == 8 for row in rows), out  # threads, the shape, ms and GMAC/s
    assert "total, 1 threads, this:" in out and "total, 2 threads, this:" in out, out


def test_qualify(runs):
    pytest.importorskip("fastapi")
    out = ran(runs["qualify.py"].result())
    levels = [line.split() for line in out.splitlines() if line.split()[:1] in (["1"], ["2"])]
    # C, answers, errors, refused
    assert [tuple(row[:4]) for row in levels] == [("1", "1", "0", "0"), ("2", "2", "0", "0")], out
    assert "C_max = " in out and "int8" in out, out
    try:
        assert CHART.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the chart of first audio and stalls
    finally:
        CHART.unlink(missing_ok=True)


def test_scale_out(runs):
    """Plain `kazeia serve`, one replica of every core and one replica per core on Ray Serve, each
    serving a client (the proxy's figures need a quiet machine: BENCHMARKS.md)."""
    pytest.importorskip("ray")
    rows = [json.loads(line) for line in ran(runs["scale_out.py"].result()).splitlines() if '"server"' in line]
    cores = os.cpu_count() or 1
    assert [row["server"] for row in rows] == ["plain", f"ray-1x{cores}", f"ray-{cores}x1"]
    assert all(row["c1"]["audio_s_per_s"] > 0 and row["health_p50_ms"] > 0 for row in rows), rows


def test_soak(runs):
    """The soak's figures that do not depend on how long the machine took: every hostile class
    answered without a 5xx, no stuck job, and every completed answer its solo replay's bytes (its
    slot and RSS checks need minutes of wall time: run by hand, BENCHMARKS.md)."""
    pytest.importorskip("wyoming")
    done = runs["soak.py"].result()
    out = done.stdout
    assert done.returncode in (0, 1), f"exit {done.returncode}\n{out[-3000:]}\n{done.stderr[-3000:]}"
    hostile = out.split("one of each hostile class:")[1].split("stuck jobs")[0].strip().splitlines()
    assert len(hostile) >= 10 and not any(re.search(r": 5\d\d$", line) for line in hostile), out
    assert "stuck jobs (HTTP server): 0" in out, out
    same, replayed = map(int, re.search(r"byte-identical to their solo replay: (\d+)/(\d+)", out).groups())
    assert same == replayed > 0, out


def test_a_failed_configuration_fails_the_script_after_the_others(runs):
    done = runs["failing gemv"].result()
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert "int3: FAILED: ValueError: unknown format 'int3'" in done.stdout
    assert any(line.startswith("float32") and line.endswith("GB/s") for line in done.stdout.splitlines())
    assert "1 configuration(s) failed: int3" in done.stderr


def test_the_lowest_instruction_set_runs_every_precision(runs):
    """The portable paths, with the libraries capped as on a CPU without AVX2 (kazeia/cpu.py)."""
    out = ran(runs["portable streaming"].result())
    assert '"isa": "portable"' in out
    for config in CONFIGS:
        assert any(line.split()[:1] == [config] for line in out.splitlines()), (config, out[-3000:])


def test_a_refused_qualification_client_waits_the_retry_after_before_asking_again(monkeypatch):
    """qualify.py's clients honour a refusal's Retry-After (bounded): the next request of a refused
    client goes out only after its wait, which the test's clock records instead of sleeping."""
    pytest.importorskip("httpx")
    import asyncio

    import httpx

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import qualify

    assert [qualify.retry_after(v) for v in ("7", "2.5", "-1", "nan", "Wed, 21 Oct 2026 07:28:00 GMT", None)] == [
        7.0, 2.5, 0.0, 0.0, 0.0, 0.0,
    ]  # fmt: skip
    assert qualify.retry_after("3600") == qualify.RETRY_CAP_S
    seen: list[str] = []

    def server(request: httpx.Request) -> httpx.Response:
        seen.append(f"request {json.loads(request.content)['seed']}")
        if len(seen) == 1:
            return httpx.Response(503, headers={"Retry-After": "7"}, json={"error": {"code": "at_capacity"}})
        return httpx.Response(200, stream=httpx.ByteStream(b"\0\0" * 1920))

    async def wait(seconds: float) -> None:
        seen.append(f"wait {seconds:g}")

    answers, _ = asyncio.run(
        qualify._level("http://q", 1, 3, {"input": "x"}, transport=httpx.MockTransport(server), wait=wait)
    )
    assert seen == ["request 0", "wait 7", "request 1", "request 2"]
    assert [a.error for a in answers] == ["HTTP 503", None, None]
    assert [a.audio_s for a in answers] == [0.0, 0.08, 0.08]
