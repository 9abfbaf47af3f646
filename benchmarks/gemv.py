"""Batch-1 GEMV bandwidth probe: how fast each weight format is read by a one-row product here.

    python benchmarks/gemv.py [--dtypes float32,bfloat16,float16,int8,int4] [--threads N] [--tiny]

Prints GB/s of weight bytes (scales included) per format and kernel: the stock `F.linear`
(float32, bfloat16, float16), Kazeia's native products (kazeia/native: the GEMV for the float
formats, int8.c, int4.c), the int8 GEMM that int8 falls back to without the native library
(fbgemm), and a plain streaming read (the memory floor). The weights (20 layers of 3072x1024, 256
MB in float32) exceed any cache; `--tiny` takes 2 small layers (a check that the script runs: the
figures mean nothing). A kernel this CPU or build cannot run is listed as not available, with the
reason; one that fails prints a FAILED line, the others still run, and the script exits 1.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Outcomes

from kazeia import native
from kazeia.int4 import Int4Linear
from kazeia.int4 import supported as int4_shape
from kazeia.native.linear import NativeLinear
from kazeia.quant import QuantLinear, int8_supported

FLOATS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
Kernel = tuple[Callable[[], object], int]  # a call doing every layer's product, and the bytes it reads


def _time(fn, repeat: int) -> float:
    fn()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(repeat):
            fn()
        best = min(best, (time.perf_counter() - start) / repeat)
    return best


def stored_bytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*module.buffers(), *module.parameters()) if t is not None)


def kernels(dtype: str, base: list[torch.Tensor], lib) -> dict[str, Kernel | str]:
    """The kernels of one format: name -> (call, bytes), or the reason it cannot run here."""
    x32 = torch.randn(1, base[0].shape[1])
    found: dict[str, Kernel | str] = {}
    if dtype in FLOATS:
        weights = [w.to(FLOATS[dtype]) for w in base]
        x = x32.to(FLOATS[dtype])
        read = sum(w.numel() * w.element_size() for w in weights)
        found["stock F.linear"] = (lambda: [torch.nn.functional.linear(x, w) for w in weights], read)
        if lib is None or lib.gemv_vector_bits() == 0:
            found["native GEMV, 1 thread"] = "no native library with vector instructions here"
        elif FLOATS[dtype] == torch.float16 and not lib.has_float16():
            found["native GEMV, 1 thread"] = "the native library has no float16 here"
        else:
            layers = [NativeLinear(_linear(w), lib) for w in weights]
            found["native GEMV, 1 thread"] = (lambda: [m(x) for m in layers], read)
    elif dtype == "int8":
        for name, with_lib in (("native int8.c", lib), ("int8 GEMM (fbgemm)", None)):
            reason = "no native library here" if with_lib is None and name.startswith("native") else None
            reason = reason or int8_supported(with_lib)
            if reason is not None:
                found[name] = reason
                continue
            layers = [QuantLinear.from_float(w, None, with_lib) for w in base]
            read = sum(w.numel() + 4 * w.shape[0] for w in base)  # int8 values and a float32 scale a row
            found[name] = (lambda layers=layers: [m(x32) for m in layers], read)
    elif dtype == "int4":
        if lib is None:
            found["native int4.c"] = "no native library here"
        elif not int4_shape(base[0].shape[1]):
            found["native int4.c"] = f"int4 does not take {base[0].shape[1]} input features"
        else:
            layers = [Int4Linear.from_float(w, None, lib) for w in base]
            found["native int4.c"] = (lambda: [m(x32) for m in layers], sum(map(stored_bytes, layers)))
    else:
        raise ValueError(f"unknown format {dtype!r}; choose from float32, bfloat16, float16, int8, int4")
    return found


def _linear(weight: torch.Tensor) -> nn.Linear:
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype)
    linear.weight.data = weight
    return linear


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="float32,bfloat16,float16,int8,int4")
    parser.add_argument("--threads", type=int)
    parser.add_argument("--tiny", action="store_true", help="2 small layers: checks the script, no figures")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    out_features, in_features, layers, repeat = (256, 512, 2, 1) if args.tiny else (3072, 1024, 20, 5)
    torch.manual_seed(0)
    base = [torch.randn(out_features, in_features) * in_features**-0.5 for _ in range(layers)]
    lib = native.library()
    print(f"{layers} layers of {out_features}x{in_features}, {torch.get_num_threads()} threads")
    outcomes = Outcomes()
    for dtype in args.dtypes.split(","):
        found = outcomes.run(dtype, lambda dtype=dtype: kernels(dtype, base, lib))
        for name, kernel in (found or {}).items():
            if isinstance(kernel, str):
                print(f"{dtype:<9} {name:<22} not available: {kernel}")
                continue
            call, read = kernel
            seconds = outcomes.run(f"{dtype} {name}", lambda call=call: _time(call, repeat))
            if seconds is not None:
                print(f"{dtype:<9} {name:<22} {read / seconds / 1e9:6.1f} GB/s", flush=True)
    flat = torch.cat([w.flatten() for w in base])
    seconds = _time(lambda: flat.sum(), repeat)
    print(f"{'read':<9} {'sum of float32':<20} {flat.numel() * 4 / seconds / 1e9:6.1f} GB/s")
    outcomes.exit()


if __name__ == "__main__":
    main()
