"""Batch-1 GEMV bandwidth probe: how fast each weight format is read by `x @ W.T` on this machine.

    python benchmarks/gemv.py [--threads N]

Prints GB/s of weight bytes for float32, bfloat16, float16, int8 (dynamic, per-channel) and a plain
streaming read (the memory floor). The weights (256 MB per format in float32 terms) exceed any cache.
"""

from __future__ import annotations

import argparse
import time

import torch

from kazeia.quant import QuantLinear


def _time(fn, repeat: int) -> float:
    fn()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(repeat):
            fn()
        best = min(best, (time.perf_counter() - start) / repeat)
    return best


def probe(out_features: int = 3072, in_features: int = 1024, layers: int = 20) -> dict[str, float]:
    """GB/s of weight bytes read by batch-1 matrix-vector products, per weight format."""
    results = {}
    x32 = torch.randn(1, in_features)
    base = [torch.randn(out_features, in_features) * in_features**-0.5 for _ in range(layers)]
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16), ("float16", torch.float16)):
        weights = [w.to(dtype) for w in base]
        x = x32.to(dtype)
        seconds = _time(lambda x=x, weights=weights: [torch.nn.functional.linear(x, w) for w in weights], 5)
        results[name] = sum(w.numel() * w.element_size() for w in weights) / seconds / 1e9
    quant = [QuantLinear.from_float(w, None) for w in base]
    seconds = _time(lambda: [q(x32) for q in quant], 5)
    results["int8"] = sum(w.numel() for w in base) / seconds / 1e9
    flat = torch.cat([w.flatten() for w in base])
    seconds = _time(lambda: flat.sum(), 5)
    results["read"] = flat.numel() * 4 / seconds / 1e9
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    for name, gbps in probe().items():
        print(f"{name:<9} {gbps:6.1f} GB/s  ({torch.get_num_threads()} threads)")


if __name__ == "__main__":
    main()
