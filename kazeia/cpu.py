"""The CPU's instruction sets, and which of them Kazeia's own ISA-specific paths may use.

Each path is named by one feature; all are x86-64 features (elsewhere none applies):

  avx2    the native library (kazeia/native) compiled for AVX2, FMA and F16C
  avx512  the native library compiled for AVX-512 (F, BW, VL, DQ, CD)
  vnni    int8 products on the full 8-bit activation grid. fbgemm's AVX-512 VNNI kernel sums the
          uint8 x int8 products straight into 32 bits; its AVX2 and plain AVX-512 kernels sum pairs
          into saturating 16 bits, so activations must stay within 7 bits there (kazeia/quant.py).
          AVX-VNNI (the 256-bit form) does not count: fbgemm has no kernel for it. Also the
          native int4 products' 8-bit dot product (kazeia/native/int4.c).
  bf16    oneDNN's packed bfloat16 matmuls (AVX512_BF16, AMX-BF16 or AVX-NE-CONVERT)
  f16     oneDNN's packed float16 matmuls (AVX512_FP16, AMX-FP16 or AVX-NE-CONVERT)

`KAZEIA_ISA` chooses: unset or "native" uses every feature the CPU has; "portable" none; a list
such as "avx2" or "avx512,vnni" exactly those; signed changes such as "-vnni,-bf16" the detected
set less (or plus) those. Naming a feature the CPU lacks is an error: no path ever runs an
instruction the CPU cannot. The choice is read on every call, not cached.

The libraries choose their own kernels by their own variables; `library_caps` gives the ones that
make them behave as on a CPU with only the chosen features (the tests use it to run each path the
machine supports, docs/design.md). Kazeia never sets them itself: they only work before torch
first runs a kernel, and changing a process's environment is the caller's business.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import platform
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

FEATURES = ("avx2", "avx512", "vnni", "bf16", "f16")
ENV = "KAZEIA_ISA"

# /proc/cpuinfo flags that make up each feature: all of one of the alternatives.
_FLAGS: dict[str, tuple[frozenset[str], ...]] = {
    "avx2": (frozenset({"avx2", "fma", "f16c"}),),
    "avx512": (frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}),),
    "vnni": (frozenset({"avx512_vnni"}),),
    "bf16": (frozenset({"avx512_bf16"}), frozenset({"amx_bf16"}), frozenset({"avx_ne_convert"})),
    "f16": (frozenset({"avx512_fp16"}), frozenset({"amx_fp16"}), frozenset({"avx_ne_convert"})),
}
# A feature is only usable with these (fbgemm's VNNI kernel is an AVX-512 one; the bf16/f16 flags
# above come with AVX-512 or AVX2 on every CPU that has them).
_REQUIRES = {"avx512": ("avx2",), "vnni": ("avx512",), "bf16": ("avx2",), "f16": ("avx2",)}


def _x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")


@functools.cache
def detected() -> frozenset[str]:
    """The features this CPU has (read once: the CPU does not change)."""
    if not _x86():
        return frozenset()
    flags = _cpu_flags()
    if flags is None:  # no /proc/cpuinfo: ask torch what its own dispatch found
        import torch

        level = torch.backends.cpu.get_cpu_capability().lower()
        return frozenset({"avx2", "avx512"} if level.startswith("avx512") else {"avx2"} if level == "avx2" else ())
    have = {name for name, options in _FLAGS.items() if any(option <= flags for option in options)}
    return _closed(have)


def _cpu_flags() -> frozenset[str] | None:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return None


def _closed(features: set[str]) -> frozenset[str]:
    """`features` less those whose prerequisites are missing."""
    out = set(features)
    changed = True
    while changed:
        changed = False
        for name in list(out):
            if any(need not in out for need in _REQUIRES.get(name, ())):
                out.discard(name)
                changed = True
    return frozenset(out)


def parse(value: str | None, have: frozenset[str]) -> frozenset[str]:
    """The features a `KAZEIA_ISA` value selects on a CPU with `have`; ValueError naming the
    problem for an unknown word, a mix of plain and signed words, or a feature the CPU lacks."""
    words = [w.strip().lower() for w in (value or "").split(",") if w.strip()]
    if not words or words == ["native"]:
        return have
    if words == ["portable"]:
        return frozenset()
    signed = [w[0] in "+-" for w in words]
    if any(signed) and not all(signed):
        raise ValueError(f"{ENV}={value!r}: give either a list of features or signed changes (+f/-f), not both")
    names = [w.lstrip("+-") for w in words]
    unknown = [n for n in names if n not in FEATURES]
    if unknown:
        raise ValueError(f"{ENV}={value!r}: unknown feature {unknown[0]!r}; choose from native, portable, "
                         f"{', '.join(FEATURES)}")  # fmt: skip
    if all(signed):
        chosen = set(have)
        for word, name in zip(words, names, strict=True):
            (chosen.add if word[0] == "+" else chosen.discard)(name)
    else:
        chosen = set(names)
    lacking = sorted(chosen - have)
    if lacking:
        raise ValueError(f"{ENV}={value!r} asks for {', '.join(lacking)}, which this CPU does not have "
                         f"(it has: {', '.join(sorted(have)) or 'none of them'})")  # fmt: skip
    missing = {n: [r for r in _REQUIRES.get(n, ()) if r not in chosen] for n in chosen}
    for name, needs in missing.items():
        if needs:
            raise ValueError(f"{ENV}={value!r}: {name} needs {', '.join(needs)} as well")
    return frozenset(chosen)


def enabled() -> frozenset[str]:
    """The features Kazeia's paths may use now: `KAZEIA_ISA` applied to the detected set."""
    return parse(os.environ.get(ENV), detected())


def uses(feature: str) -> bool:
    """True when the path named by `feature` may run."""
    if feature not in FEATURES:
        raise KeyError(feature)
    return feature in enabled()


# Each library's own variable and its value for the highest level a feature set allows.
# fbgemm has nothing below AVX2 (without AVX2 there is no int8 GEMM at all: `int8_supported`).
def library_caps(features: frozenset[str]) -> dict[str, str]:
    """Environment for a new process whose libraries (ATen, MKL, oneDNN, fbgemm) should use only
    `features`, as on a CPU that has nothing else."""
    avx2, avx512 = "avx2" in features, "avx512" in features
    if avx512:
        onednn = (
            "AVX512_CORE_BF16" if "bf16" in features else "AVX512_CORE_VNNI" if "vnni" in features else "AVX512_CORE"
        )
        if "f16" in features:
            onednn = "AVX512_CORE_FP16"
        return {
            "ATEN_CPU_CAPABILITY": "avx512",
            "MKL_ENABLE_INSTRUCTIONS": "AVX512",
            "ONEDNN_MAX_CPU_ISA": onednn,
            "FBGEMM_ENABLE_INSTRUCTIONS": "AVX512_E1" if "vnni" in features else "AVX512",
        }
    if avx2:
        return {
            "ATEN_CPU_CAPABILITY": "avx2",
            "MKL_ENABLE_INSTRUCTIONS": "AVX2",
            "ONEDNN_MAX_CPU_ISA": "AVX2",
            "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2",
        }
    return {
        "ATEN_CPU_CAPABILITY": "default",
        "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
        "ONEDNN_MAX_CPU_ISA": "SSE41",
        "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2",
    }


def compiler_flags(features: frozenset[str]) -> tuple[str, ...]:
    """Target flags for the native library: the CPU's own (-march=native) when every feature it
    has is on, else exactly the chosen instruction sets over the x86-64 baseline."""
    if not _x86():
        return () if os.environ.get(ENV, "").strip().lower() == "portable" else ("-march=native",)
    c_features = {"avx2", "avx512", "vnni", "bf16"}
    if features & c_features == detected() & c_features:
        return ("-march=native",)
    flags = ["-march=x86-64", "-mtune=generic"]
    if "avx2" in features:
        flags += ["-mavx2", "-mfma", "-mf16c"]
    if "avx512" in features:
        flags += ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512cd"]
        if "vnni" in features:
            flags.append("-mavx512vnni")  # the native int4 products' dpbusd (kazeia/native/int4.c)
        if "bf16" in features and "avx512_bf16" in (_cpu_flags() or ()):
            flags.append("-mavx512bf16")  # the native products' bfloat16 pair dot product
    return tuple(flags)


def describe() -> str:
    """One line for logs and benchmarks: detected and enabled features."""
    have, use = detected(), enabled()
    line = f"CPU features: {', '.join(sorted(have)) or 'none'}"
    return line if use == have else f"{line}; {ENV} enables {', '.join(sorted(use)) or 'none'}"


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity where the OS tells it), at least one."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


@functools.cache
def _omp_set_num_threads() -> Callable[[int], int] | None:
    """omp_set_num_threads of the OpenMP runtime torch runs on, or None."""
    try:
        return ctypes.CDLL(None).omp_set_num_threads
    except (OSError, AttributeError):  # no OpenMP torch (or no such runtime in the process)
        return None


class Team(NamedTuple):
    """The threads a block of work runs on (`team`): a count, or a function asked for it at each of
    Kazeia's own products (None: as they are), and whether torch's parallel regions take them too."""

    threads: int | Callable[[], int | None] | None
    openmp: bool = True


_local = threading.local()


def _count(threads: int | Callable[[], int | None] | None) -> int | None:
    """A team's thread count now: a callable asked, a count as it is (None: none)."""
    return threads() if callable(threads) else threads


def native_threads() -> int:
    """The threads Kazeia's own multi-threaded kernels may take in the calling thread: its
    `team`'s (asked at each call where the team is a callable; None from it: one), else one."""
    return _count(getattr(_local, "threads", None)) or 1


def stage_team() -> int:
    """The threads the vocoder's kernels may take in the calling thread: its `team`'s where it is
    in one (asked now where the team is a callable; None from it: torch's), else torch's, the
    stage's own (kazeia/placement.py)."""
    import torch

    return _count(getattr(_local, "threads", None)) or torch.get_num_threads()


def on(t: Team | None) -> contextlib.AbstractContextManager[None]:
    """`team` for a `Team`: the block on its threads; None: as they are."""
    return contextlib.nullcontext() if t is None else team(*t)


@contextlib.contextmanager
def team(threads: int | Callable[[], int | None] | None, openmp: bool = True) -> Iterator[None]:
    """Run the block's parallel work on `threads` threads, in the calling thread only: Kazeia's
    own kernels (`native_threads`) and, with `openmp`, torch's parallel regions. A callable is
    asked for the count at each of Kazeia's products (OpenMP's team: once, here), so that a
    prompt takes cores as they become free (kazeia/scheduler.py).

    OpenMP keeps the team size per thread: setting it here leaves other threads, and the count
    torch gives threads it starts later (`torch.set_num_threads`'s, process-wide), as they were;
    the vocoder's thread keeps its own. None: the block as it is; a torch without OpenMP: its
    regions as they are."""
    import torch

    if threads is None:
        yield
        return
    set_team = _omp_set_num_threads() if openmp else None
    # torch's count first: torch's first call resets the team
    before, native = torch.get_num_threads(), getattr(_local, "threads", None)
    _local.threads = threads
    if set_team is not None:
        set_team(_count(threads) or before)
    try:
        yield
    finally:
        if native is None:  # no team around this one: none after it (`stage_team` takes torch's again)
            del _local.threads
        else:
            _local.threads = native
        if set_team is not None:
            set_team(before)
