"""Building and loading the native library: C, compiled on this machine, called through ctypes.

Sources: the decoding step's glue between products (`decode.c`), a whole step in one call
(`stack.c`, kazeia/native/step.py), the float GEMV (`gemv.c`), the int8 (`int8.c`) and int4
(`int4.c`) products, the vocoder's products (`conv.c`, and `conv8.c` for an int8 vocoder) and its
SnakeBeta (`vocoder.c`, kazeia/conv.py). The system C
compiler builds them into one library, once per version of the sources, flags, compiler, CPU and
set of enabled CPU features (kazeia/cpu.py), in `~/.cache/kazeia/native` (or `$KAZEIA_CACHE/native`),
a directory only this user may change; the file is checked again as it is loaded. Where no compiler
is found or the build fails, `library()` returns None with one warning and the eager code runs
instead; `KAZEIA_NATIVE=0` turns this path off. Callers choose once, at load.

Non-goals: what the functions compute (the C files and the modules that call them).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import stat
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

from .. import cpu

SOURCES = tuple(
    Path(__file__).with_name(name)
    for name in ("decode.c", "vocoder.c", "conv.c", "conv8.c", "gemv.c", "int4.c", "int8.c", "jobs.c", "stack.c")
)
# included by the sources: part of the build key
HEADERS = tuple(Path(__file__).with_name(name) for name in ("conv8.h", "dtypes.h", "jobs.h", "int4_tiles.h"))
# -ffp-contract=off: no fused multiply-adds where the eager code rounds the product first. The
# target flags come from the enabled CPU features (`cpu.compiler_flags`: -march=native by default).
FLAGS = ("-O3", "-ffp-contract=off", "-fPIC", "-shared", "-pthread")


def enabled() -> bool:
    return os.environ.get("KAZEIA_NATIVE", "1").strip().lower() not in ("0", "false", "no", "off")


def cache_dir() -> Path:
    root = os.environ.get("KAZEIA_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "kazeia") / "native"


def flags() -> tuple[str, ...]:
    """The compiler flags for the features enabled now (kazeia/cpu.py)."""
    return FLAGS + cpu.compiler_flags(cpu.enabled())


def _cpu_signature() -> str:
    """What -march=native depends on: the CPU's model and feature flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    lines = [line for line in info.splitlines() if line.startswith(("model name", "flags", "Features"))]
    return "\n".join(sorted(set(lines)))


def build(compiler: str | None = None, target_dir: Path | None = None, options: tuple[str, ...] | None = None) -> Path:
    """Compile the sources (once per version of them, flags, compiler and CPU); return the library path.
    `options`: the compiler flags (default: `flags()`)."""
    compiler = compiler or os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C compiler: {compiler!r} not found")
    options = flags() if options is None else options
    sources = [source.read_bytes() for source in (*SOURCES, *HEADERS)]
    key = hashlib.sha256(
        b"\0".join([*sources, " ".join(options).encode(), compiler.encode(), _cpu_signature().encode()])
    )
    target_dir = target_dir or cache_dir()
    _private_dir(target_dir)
    path = target_dir / f"decode-{key.hexdigest()[:16]}.so"
    if path.exists() or path.is_symlink():
        if _ours(path):
            _touch(path)  # in use: its age says when it was last loaded, for `_prune`
            return path
        warnings.warn(f"kazeia: {path} is not a private file of this user; rebuilding it", stacklevel=2)
        path.unlink()
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target_dir)
    os.close(fd)
    try:
        key_flag = f'-DKAZEIA_BUILD_KEY="{key.hexdigest()}"'  # `build_key()` in the library says which build it is
        cmd = [compiler, *options, key_flag, *map(str, SOURCES), "-o", tmp, "-lm"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr.strip()}")
        os.chmod(tmp, 0o700)
        os.replace(tmp, path)  # atomic: concurrent builds leave one complete file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    _prune(target_dir, keep=path)
    return path


def _private_dir(directory: Path) -> None:
    """Create `directory` (and missing parents) readable by this user only; refuse one that another
    user owns or others may write to, where anyone could plant a library that Kazeia would load."""
    missing = []
    at = directory
    while not at.exists():
        missing.append(at)
        at = at.parent
    for new in reversed(missing):
        try:
            new.mkdir(mode=0o700)
        except FileExistsError:  # made meanwhile by a concurrent build: checked below
            pass
    info = directory.lstat()
    if not stat.S_ISDIR(info.st_mode):
        raise RuntimeError(f"the native cache {directory} is not a directory")
    if hasattr(os, "getuid") and info.st_uid != os.getuid():
        raise RuntimeError(f"the native cache {directory} belongs to another user (uid {info.st_uid})")
    if info.st_mode & 0o022:
        raise RuntimeError(
            f"the native cache {directory} is writable by others (mode {stat.S_IMODE(info.st_mode):o}); "
            f"make it private (chmod 700) or set KAZEIA_CACHE"
        )
    # Its parents too: whoever may rename entries in one could swap the cache for another directory.
    for parent in directory.resolve().parents:
        up = parent.stat()
        owner_ok = not hasattr(os, "getuid") or up.st_uid in (os.getuid(), 0)
        # /tmp-like (sticky) is safe, and so is group write for the user's own group (a home
        # directory on systems with a private group per user is often 775)
        group_ok = hasattr(os, "getgid") and up.st_gid == os.getgid() and not up.st_mode & 0o002
        shared = up.st_mode & 0o022 and not up.st_mode & stat.S_ISVTX and not group_ok
        if not owner_ok or shared:
            raise RuntimeError(
                f"the native cache {directory} is inside {parent}, which another user may change "
                f"(owner uid {up.st_uid}, mode {stat.S_IMODE(up.st_mode):o}); set KAZEIA_CACHE elsewhere"
            )


def _ours(path: Path) -> bool:
    """A regular file (not a link) owned by this user that nobody else may write."""
    return _private_file(path.lstat())


def _private_file(info: os.stat_result) -> bool:
    owner = not hasattr(os, "getuid") or info.st_uid == os.getuid()
    return stat.S_ISREG(info.st_mode) and owner and not info.st_mode & 0o022


def _load_checked(path: Path) -> ctypes.CDLL:
    """Load `path` (in a directory only this user may change: `_private_dir`), checked again as
    the file that is opened, and the same file (device and inode) after it has been loaded.
    (Not through /proc/self/fd: the loader matches libraries by name, and descriptor numbers are
    reused.)"""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    try:
        checked = os.fstat(fd)
        if not _private_file(checked):
            raise RuntimeError(f"{path} changed after it was checked")
        lib = ctypes.CDLL(str(path))
        now = os.stat(path, follow_symlinks=False)
        if (now.st_dev, now.st_ino) != (checked.st_dev, checked.st_ino):
            raise RuntimeError(f"{path} was replaced while it was loaded")
        return lib
    finally:
        os.close(fd)


STALE_DAYS = 30  # builds not loaded for this long are removed when another one is built


def _touch(path: Path) -> None:
    try:
        os.utime(path)
    except OSError:  # a read-only cache still works
        pass


def _prune(target_dir: Path, keep: Path) -> None:
    """Remove other builds (older sources, compilers or CPUs) not loaded for STALE_DAYS days. A
    process still using one keeps its mapping; recent ones stay for other installed versions."""
    cutoff = time.time() - STALE_DAYS * 86400
    for old in target_dir.glob("decode-*.so"):
        try:
            if old != keep and old.stat().st_mtime < cutoff:
                old.unlink()
        except OSError:
            pass


_P, _INT, _LONG, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float
SIGNATURES = {  # argument and result types of the C functions (pointers: tensors' data_ptr())
    "add_rms_norm": ([_P, _P, _P, _P, _INT, _INT, _F, _INT], None),
    "attend": ([*[_P] * 7, *[_INT] * 6, _F, _INT, _INT], _INT),
    "silu_mul": ([_P, _P, _INT, _INT, _INT], None),
    "has_float16": ([], _INT),
    "snake_beta": ([*[_P] * 4, *[_LONG] * 5, _INT], _INT),
    "layer_norm_rows": ([*[_P] * 4, _LONG, _LONG, _F], None),
    "gelu_rows": ([_P, _LONG, _LONG], None),
    "depthwise_conv": ([_P, _LONG, _P, _P, _P, *[_LONG] * 4, _INT, _INT], None),
    "window_attend": ([*[_P] * 6, _LONG, _LONG, *[_INT] * 4, _LONG], _INT),
    "vconv": ([_P, _LONG, _LONG, *[_P] * 3, _LONG, _LONG, _P, *[_LONG] * 6, *[_INT] * 4], _INT),
    "vconv_pack": ([_P, _LONG, _LONG, _INT, _P], None),
    "vconv_packed_bytes": ([_LONG, _LONG, _INT], _LONG),
    "vconv_pairs": ([_LONG], _INT),
    "vconv_lanes": ([], _INT),
    "vconv8": ([_P, _LONG, _LONG, *[_P] * 3, _LONG, _LONG, _P, *[_LONG] * 6, *[_INT] * 3], _INT),
    "vconv8_pack": ([_P, _LONG, _INT, _LONG, _P], None),
    "vconv8_packed_bytes": ([_LONG, _INT, _LONG], _LONG),
    "vconv8_kernel": ([], _INT),
    "gemv_team": ([*[_P] * 4, _LONG, _LONG, _INT, _INT, _INT], _INT),
    "gemv_vector_bits": ([], _INT),
    "int4_gemv": ([*[_P] * 7, _LONG, _LONG, _LONG], _INT),
    "int4_gemm": ([*[_P] * 7, _LONG, _LONG, _LONG, ctypes.c_int], _INT),
    "int4_kernel": ([], _INT),
    "int8_gemm": ([*[_P] * 5, _LONG, _LONG, _LONG, ctypes.c_int], _INT),
    "int8_kernel": ([], _INT),
    "stack_step": ([_P, _INT, *[_P] * 8, _INT, _INT, *[_P] * 6, *[_INT] * 5, _F, _F, _INT, _INT, _INT], _INT),
}


def library() -> ctypes.CDLL | None:
    """The native library for the enabled CPU features, or None (disabled, no compiler, build
    failure: warned once)."""
    if not enabled() or sys.platform == "win32":
        return None
    return _library(flags())


def reset() -> None:
    """Forget the libraries loaded so far (for tests that change the compiler or the cache)."""
    _library.cache_clear()


@functools.cache
def _library(options: tuple[str, ...]) -> ctypes.CDLL | None:
    try:
        path = build(options=options)
        lib = _load_checked(path)
        _check_exports(lib, path)
    except (RuntimeError, OSError, subprocess.SubprocessError) as err:
        what = "native decode steps and vocoder activation unavailable, using eager PyTorch"
        warnings.warn(f"kazeia: {what} ({err})", stacklevel=2)
        return None
    return lib


def _check_exports(lib: ctypes.CDLL, path: Path) -> None:
    """The library is the build its name says (its key) and has every function Kazeia calls."""
    missing = [name for name in (*SIGNATURES, "build_key") if not hasattr(lib, name)]
    if missing:
        raise RuntimeError(f"{path} is not a Kazeia build: it lacks {', '.join(missing)}")
    lib.build_key.argtypes, lib.build_key.restype = [], ctypes.c_char_p
    key = (lib.build_key() or b"").decode("ascii", "replace")
    if not path.name.startswith(f"decode-{key[:16]}") or len(key) != 64:
        raise RuntimeError(f"{path} is not the build its name says (its key is {key[:16]!r})")
    for name, (args, result) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, result
