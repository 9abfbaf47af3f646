"""Native code (C, built on this machine, called through ctypes): the decode step of a decoder
stack at batch 1 with the glue between the products in C, and the vocoder's SnakeBeta in one pass.

Products: the float GEMV (`gemv.c`), int8 (`int8.c`) and int4 (`int4.c`) kernels, or PyTorch's
(oneDNN) where these do not apply; the norms, rotation, KV-cache write, attention and SiLU of each
layer run as four calls into `decode.c`, or the whole step in one call of `stack.c` where every
product is native; `vocoder.c` holds `snake_beta` (kazeia/conv.py). The system C compiler builds
them into one library, once per machine and set of
CPU features (kazeia/cpu.py), in `~/.cache/kazeia/native` (or `$KAZEIA_CACHE/native`). Where no
compiler is found or the build fails, `library()` returns None with one warning and the eager
code runs instead; `KAZEIA_NATIVE=0` turns this path off. Callers choose once, at load.
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
from collections.abc import Callable
from pathlib import Path

import torch

from .. import cpu

SOURCES = tuple(
    Path(__file__).with_name(name)
    for name in ("decode.c", "vocoder.c", "conv.c", "gemv.c", "int4.c", "int8.c", "stack.c")
)
HEADERS = tuple(Path(__file__).with_name(name) for name in ("dtypes.h", "jobs.h"))  # included: in the build key
# -ffp-contract=off: no fused multiply-adds where the eager code rounds the product first. The
# target flags come from the enabled CPU features (`cpu.compiler_flags`: -march=native by default).
FLAGS = ("-O3", "-ffp-contract=off", "-fPIC", "-shared", "-pthread")
DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


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
    "attend": ([*[_P] * 8, *[_INT] * 6, _F, _INT], None),
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
    "gemv": ([*[_P] * 4, _LONG, _LONG, _INT, _INT], _INT),
    "gemv_vector_bits": ([], _INT),
    "gemv_bf16_dot": ([], _INT),
    "gemv_wide": ([_P, _INT, *[_P] * 3, _LONG, _LONG, _INT], _INT),
    "int4_gemv": ([*[_P] * 7, _LONG, _LONG, _LONG], _INT),
    "int4_gemm": ([*[_P] * 7, _LONG, _LONG, _LONG, ctypes.c_int], _INT),
    "int4_kernel": ([], _INT),
    "int8_gemm": ([*[_P] * 5, _LONG, _LONG, _LONG, ctypes.c_int], _INT),
    "int8_gemv": ([*[_P] * 5, _LONG, _LONG, _LONG], _INT),
    "int8_kernel": ([], _INT),
    "stack_step": ([_P, _INT, *[_P] * 9, _INT, _INT, *[_P] * 6, *[_INT] * 5, _F, _F, _INT], _INT),
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


def address(t: torch.Tensor | None) -> int | None:
    """A tensor's data address for a C call, None (NULL) for none: an optional bias."""
    return None if t is None else t.data_ptr()


class Product(ctypes.Structure):
    """stack.c's description of one native product (`product_spec()` of NativeLinear, HeadLinear
    and Int4Linear): its kind, weight dtype, the addresses of its weights and bias, its shape."""

    GEMV, WIDE, INT4, INT8 = 0, 1, 2, 3
    _fields_ = [
        ("kind", ctypes.c_int),
        ("dt", ctypes.c_int),
        ("w", ctypes.c_void_p),
        ("a", ctypes.c_void_p),
        ("b", ctypes.c_void_p),
        ("c", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
        ("rows", ctypes.c_long),
        ("cols", ctypes.c_long),
    ]


class Layer(ctypes.Structure):
    """stack.c's layer: its four products and the addresses of its norms' weights."""

    _fields_ = [
        ("qkv", Product),
        ("o", Product),
        ("gate_up", Product),
        ("down", Product),
        ("qk_w", ctypes.c_void_p),
        ("post_w", ctypes.c_void_p),
        ("next_w", ctypes.c_void_p),
    ]


# Positions a native step takes at once: one, or the code predictor's two-position first step of
# each frame (otherwise ~125 PyTorch operations per frame). Prompts keep the eager layers, whose
# attention runs on every core.
MAX_POSITIONS = 2


class StackStep:
    """One position (or up to MAX_POSITIONS) through a stack of fused `layers.Block`s and its final
    norm, batch 1, for the activation dtype it was built for.

    Built once per stack when the model is loaded (`stack_step`); holds the norms' weights and the
    products, so it describes the weights of that moment. Each layer is: qkv product, `attend`,
    output product, `add_rms_norm`, gate/up product, `silu_mul`, down product, `add_rms_norm`
    (which also applies the next layer's input norm or the final one). Products' inputs are
    (rows, features) buffers of T rows (one per position) that the C code writes.
    """

    def __init__(self, lib: ctypes.CDLL, layers, norm, dtype: torch.dtype, batch_product=None):
        self.lib, self.dtype, self.dt = lib, dtype, DTYPES[dtype]
        first = layers[0].self_attn
        self.heads, self.kv_heads, self.head_dim = first.heads, first.kv_heads, first.head_dim
        self.hidden = layers[0].mlp.down_proj.out_features
        self.inner = layers[0].mlp.down_proj.in_features
        self.eps = layers[0].input_layernorm.eps
        self.qk_eps = first.q_norm.eps
        norms = [layer.input_layernorm.weight for layer in layers] + [norm.weight]
        self.keep = []  # the tensors whose addresses are held below
        self.first_norm = self._address(norms[0])
        products = [(layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
                    for layer in layers]  # fmt: skip
        self.layers = self._layers(layers, products, norms, _solo)
        # The batched step's products (kazeia/batch.py): each row's result independent of the
        # others, or None where some product is not (that model's batches run request by request).
        made = [[batch_product(p) for p in four] for four in products] if batch_product else [[None]]
        complete = all(f is not None for four in made for f in four)
        self.batch_layers = self._layers(layers, made, norms, lambda f: f) if complete else None
        # The whole step in one call (stack.c) where every product is native in these activations:
        # the same kernels as `layers` and `batch_layers`, in the same order.
        self.whole = self._whole(layers, products, norms)

    def _whole(self, layers, products, norms):
        """stack.c's layers (a ctypes array), or None where some product is not native here."""
        specs = [[getattr(p, "product_spec", lambda dtype: None)(self.dtype) for p in four] for four in products]
        if not all(spec is not None for four in specs for spec in four):
            return None
        made = (Layer * len(layers))()
        for i, (layer, four) in enumerate(zip(layers, specs, strict=True)):
            made[i].qkv, made[i].o, made[i].gate_up, made[i].down = (Product(*spec) for spec in four)
            made[i].qk_w = self._address(layer.self_attn.qk_norm_weight)
            made[i].post_w = self._address(layer.post_attention_layernorm.weight)
            made[i].next_w = self._address(norms[i + 1])
        self.keep.extend(p for four in products for p in four)  # the modules whose weights it addresses
        return made

    def _layers(self, layers, products, norms, wrap: Callable) -> list[tuple]:
        """Per layer: its four products (`wrap`ped: called with the input buffer and the number of
        requests) and the addresses of its norm weights, in the order `_run` takes them."""
        out = []
        for i, (layer, (qkv, o_proj, gate_up, down)) in enumerate(zip(layers, products, strict=True)):
            qk_w = self._address(layer.self_attn.qk_norm_weight)
            post_w = self._address(layer.post_attention_layernorm.weight)
            out.append((wrap(qkv), qk_w, wrap(o_proj), post_w, wrap(gate_up), wrap(down), self._address(norms[i + 1])))
        return out

    def _address(self, t: torch.Tensor) -> int:
        if t.dtype != self.dtype or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"expected a contiguous CPU {self.dtype} tensor, got {t.dtype} {tuple(t.shape)}")
        self.keep.append(t)
        return t.data_ptr()

    def applies(self, x: torch.Tensor, cache) -> bool:
        """One sequence at 1..MAX_POSITIONS positions in this step's dtype, over float32 caches."""
        return (
            x.shape[0] == 1
            and 1 <= x.shape[1] <= MAX_POSITIONS
            and x.dtype == self.dtype
            and cache[0].k.dtype == torch.float32
            and cache[0].k.shape[0] == 1
        )

    def __call__(self, x: torch.Tensor, rope, cache, start: int) -> torch.Tensor:
        """x (1, T, H) at positions [start, start + T) -> final-normed hidden (1, T, H); fills each
        layer's cache. T is 1, or 2 for the code predictor's first step of a frame (MAX_POSITIONS)."""
        T = x.shape[1]
        if self.whole is not None:
            return self._run_whole(x.reshape(T, self.hidden), T, [(rope, cache, start)]).view(1, T, -1)
        return self._run(x.reshape(T, self.hidden), T, [(rope, cache, start)], self.layers).view(1, T, -1)

    def batch(self, x: torch.Tensor, requests: list) -> torch.Tensor:
        """Several requests' step at once: x (B, T, H), request b at positions [start_b, start_b + T)
        of its own cache, `requests[b]` = (its rope (cos, sin) (T, 1, hd), its cache, start_b) ->
        final-normed hidden (B, T, H). The products take all B * T rows at once (`batch_layers`,
        each row's result that of the request alone); attention runs over each request's cache."""
        B, T, H = x.shape
        if self.whole is not None:
            return self._run_whole(x.reshape(B * T, H), T, requests).view(B, T, H)
        return self._run(x.reshape(B * T, H), T, requests, self.batch_layers).view(B, T, H)

    def _check_room(self, T: int, requests: list) -> int:
        """The largest cache capacity of `requests`; an error if T positions overflow any of them."""
        for _, cache, start in requests:
            if start + T > cache[0].k.shape[2]:
                raise RuntimeError(f"KV cache overflow: position {start + T} > capacity {cache[0].k.shape[2]}")
        return max(cache[0].k.shape[2] for _, cache, _ in requests)

    def _run_whole(self, x: torch.Tensor, T: int, requests: list) -> torch.Tensor:
        """`_run` in one call of stack.c: x (B * T, H), B = len(requests) -> final-normed (B * T, H)."""
        dtype, H, nq, nkv, hd, inner = self.dtype, self.hidden, self.heads, self.kv_heads, self.head_dim, self.inner
        capacity = self._check_room(T, requests)
        B, L, n = len(requests), len(self.whole), x.shape[0]
        h = x.clone()  # the residual stream, updated in place
        # normed (the result), attended, activated, then the products' outputs: qkv, o or down, gate/up
        widths = (H, nq * hd, inner, (nq + 2 * nkv) * hd, H, 2 * inner)
        buffers = [torch.empty(n, width, dtype=dtype) for width in widths]
        scratch = torch.empty(nq * hd + nq // nkv * capacity, dtype=torch.float32)
        pointers = ctypes.c_void_p * B
        cos = pointers(*(c.data_ptr() for (c, _), _, _ in requests))
        sin = pointers(*(s.data_ptr() for (_, s), _, _ in requests))
        keys = (ctypes.c_void_p * (B * L))(*(layer.k.data_ptr() for _, cache, _ in requests for layer in cache))
        values = (ctypes.c_void_p * (B * L))(*(layer.v.data_ptr() for _, cache, _ in requests for layer in cache))
        caps = (ctypes.c_int * B)(*(cache[0].k.shape[2] for _, cache, _ in requests))
        starts = (ctypes.c_int * B)(*(start for _, _, start in requests))
        status = self.lib.stack_step(self.whole, L, self.first_norm, h.data_ptr(), *(b.data_ptr() for b in buffers),
                                     scratch.data_ptr(), B, T, cos, sin, keys, values, caps, starts, nq, nkv, hd, H,
                                     inner, self.eps, self.qk_eps, self.dt)  # fmt: skip
        if status == -2:
            raise MemoryError(f"native step of {n} rows: out of memory")
        if status != 0:
            raise RuntimeError(f"the native step refused {n} rows (status {status})")
        return buffers[0]

    def _run(self, x: torch.Tensor, T: int, requests: list, layers: list) -> torch.Tensor:
        """x (B * T, H), B = len(requests), request-major -> final-normed (B * T, H)."""
        lib, dt, dtype = self.lib, self.dt, self.dtype
        H, nq, nkv, hd = self.hidden, self.heads, self.kv_heads, self.head_dim
        B = len(requests)
        capacity = self._check_room(T, requests)
        h = x.clone()  # the residual stream, updated in place
        rows = B * T
        normed = torch.empty(rows, H, dtype=dtype)
        attended = torch.empty(rows, nq * hd, dtype=dtype)
        activated = torch.empty(rows, self.inner, dtype=dtype)
        scratch = torch.empty(nq * hd + nq // nkv * capacity, dtype=torch.float32)
        hp, np_, ap, mp, sp = (t.data_ptr() for t in (h, normed, attended, activated, scratch))
        ropes = [(cos.data_ptr(), sin.data_ptr()) for (cos, sin), _, _ in requests]
        n = B * T
        width, out_width = (nq + 2 * nkv) * hd * dtype.itemsize, nq * hd * dtype.itemsize  # bytes a row
        eps, qk_eps = self.eps, self.qk_eps
        lib.add_rms_norm(hp, None, self.first_norm, np_, n, H, eps, dt)
        for index, (qkv, qk_w, o_proj, post_w, gate_up, down, next_w) in enumerate(layers):
            y = qkv(normed, B)
            yp = y.data_ptr()
            for b, ((cos, sin), (_, cache, start)) in enumerate(zip(ropes, requests, strict=True)):
                k, v = cache[index].k, cache[index].v
                lib.attend(yp + b * T * width, qk_w, cos, sin, k.data_ptr(), v.data_ptr(), ap + b * T * out_width, sp,
                           T, nq, nkv, hd, k.shape[2], start, qk_eps, dt)  # fmt: skip
            # Each product's output is held in a name until the call returns (a temporary's memory
            # would be freed as soon as its address is taken).
            y = o_proj(attended, B)
            lib.add_rms_norm(hp, y.data_ptr(), post_w, np_, n, H, eps, dt)
            y = gate_up(normed, B)
            lib.silu_mul(y.data_ptr(), mp, n, self.inner, dt)
            y = down(activated, B)
            lib.add_rms_norm(hp, y.data_ptr(), next_w, np_, n, H, eps, dt)
        return normed[:n]


def _solo(linear) -> Callable:
    """A solo step's product, called as the batched ones are (the number of requests is 1)."""
    return lambda rows, groups: linear(rows)


def stack_step(lib: ctypes.CDLL | None, layers, norm, dtype: torch.dtype, batch_product=None) -> StackStep | None:
    """The native step for a loaded stack whose activations are `dtype`, or None where it does not
    apply (no library, a dtype without C support, unfused layers or unsupported head shapes).
    `batch_product(linear)`: its product for batched steps, or None (kazeia/batch.py)."""
    if lib is None or dtype not in DTYPES or not _supported(layers, dtype):
        return None
    if dtype == torch.float16 and not lib.has_float16():
        return None
    return StackStep(lib, layers, norm, dtype, batch_product)


def _supported(layers, dtype: torch.dtype) -> bool:
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        if attn.qkv_proj is None or mlp.gate_up_proj is None or attn.qk_norm_weight is None:
            return False
        if attn.heads % attn.kv_heads or attn.head_dim % 2:
            return False
        if layer.input_layernorm.weight.dtype != dtype or layer.input_layernorm.weight.device.type != "cpu":
            return False
    return True
