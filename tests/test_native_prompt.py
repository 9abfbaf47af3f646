"""The native step's glue (kazeia/native/decode.c) and prompts through stack.c: attention over many
positions, split over threads, against a float64 reference and against itself position by
position; SiLU against float64; the same bits at every instruction-set level; prompts of int4 and
int8 stacks in one call."""

from __future__ import annotations

import copy
import ctypes
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from kazeia import cpu, native
from kazeia.int4 import Int4Linear, dequantize
from kazeia.layers import Block, KVCache, RMSNorm, Rotary, fuse_projections
from kazeia.matmul import replace_linears
from kazeia.native import linear as native_linear
from kazeia.quant import QuantLinear, int8_supported, quantize_linears

pytestmark = pytest.mark.skipif(native.library() is None, reason="no C compiler: the eager path runs")

# int4 products need widths that are multiples of 64
DIM, HEADS, KV_HEADS, HEAD_DIM, INNER, LAYERS = 128, 4, 2, 32, 256, 2


def test_silu_is_float64_silu_within_a_few_units_in_the_last_place():
    """silu_mul's exponential (decode.c's exp32, vectorized, no libm) over the whole float range
    SiLU meets: ordinary values within 2 ulp of float64, the tails exact or negligibly off, NaN kept."""
    lib = native.library()
    edges = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 87.5, -87.5, 300.0, -300.0])
    gate = torch.cat((torch.linspace(-90, 90, 20011), edges))
    gate_up, out = torch.cat((gate, torch.ones_like(gate))), torch.empty_like(gate)
    lib.silu_mul(gate_up.data_ptr(), out.data_ptr(), 1, gate.numel(), 0)
    want = torch.nn.functional.silu(gate.double())
    ulp = torch.finfo(torch.float32).eps * want.abs().clamp_min(torch.finfo(torch.float32).tiny)
    err = (out.double() - want).abs()
    ordinary = want.abs() > 1e-30
    assert (err[ordinary] <= 2 * ulp[ordinary]).all(), float((err / ulp)[ordinary].max())
    assert (err[~ordinary] <= 1e-36).all()  # silu(-88.5): -0 here, -3.4e-37 in float64
    assert out[gate == 300.0].item() == 300.0
    nan, pair = torch.empty(1), torch.tensor([float("nan"), 1.0])
    lib.silu_mul(pair.data_ptr(), nan.data_ptr(), 1, 1, 0)
    assert nan.isnan().all()


def reference_attention(qkv, qk_w, cos, sin, k_cache, v_cache, pos, eps=1e-6):
    """decode.c's `attend` in float64: the new positions' q/k norm and rotation, then causal
    attention over the cache's positions before them and themselves."""
    T = qkv.shape[0]
    heads = qkv.double().view(T, HEADS + 2 * KV_HEADS, HEAD_DIM)
    qk = heads[:, : HEADS + KV_HEADS]
    qk = qk * torch.rsqrt(qk.pow(2).mean(-1, keepdim=True) + eps) * qk_w.double()
    rolled = torch.cat((qk[..., HEAD_DIM // 2 :], qk[..., : HEAD_DIM // 2]), dim=-1)
    qk = qk * cos.double()[:, None] + rolled * sin.double()[:, None]
    keys = torch.cat((k_cache.double()[:, :pos], qk[:, HEADS:].transpose(0, 1)), dim=1)  # (kv, S, hd)
    values = torch.cat((v_cache.double()[:, :pos], heads[:, HEADS + KV_HEADS :].transpose(0, 1)), dim=1)
    group = HEADS // KV_HEADS
    out = torch.empty(T, HEADS, HEAD_DIM, dtype=torch.float64)
    for t in range(T):
        for h in range(HEADS):
            scores = keys[h // group, : pos + t + 1] @ qk[t, h] / HEAD_DIM**0.5
            out[t, h] = torch.softmax(scores, 0) @ values[h // group, : pos + t + 1]
    return out.view(T, HEADS * HEAD_DIM)


def attend(lib, qkv, qk_w, cos, sin, k_cache, v_cache, pos, threads):
    T = qkv.shape[0]
    out = torch.empty(T, HEADS * HEAD_DIM)
    status = lib.attend(qkv.data_ptr(), qk_w.data_ptr(), cos.data_ptr(), sin.data_ptr(), k_cache.data_ptr(),
                        v_cache.data_ptr(), out.data_ptr(), T, HEADS, KV_HEADS, HEAD_DIM, k_cache.shape[1], pos,
                        ctypes.c_float(1e-6), 0, threads)  # fmt: skip
    assert status == 0
    return out


@pytest.mark.parametrize("pos", [0, 37])
def test_attention_over_many_positions_is_the_same_at_once_one_by_one_and_on_threads(pos):
    """A prompt's attention (37 new positions, after `pos` cached ones) in one call on one thread,
    in one call split over three threads, and position by position: the same bits (each position's
    work is its own); and the float64 attention within float32 rounding."""
    lib = native.library()
    gen = torch.Generator().manual_seed(pos)
    T, cap = 37, 96
    qkv = torch.randn(T, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=gen) * 2
    qk_w = torch.rand(HEADS + KV_HEADS, HEAD_DIM, generator=gen) + 0.5
    rope = Rotary(HEAD_DIM, 10000.0).span(pos, T, torch.float32, "cpu")
    cos, sin = (t.reshape(T, HEAD_DIM).contiguous() for t in rope)
    before = [torch.randn(KV_HEADS, cap, HEAD_DIM, generator=gen) for _ in range(2)]
    want = reference_attention(qkv, qk_w, cos, sin, *before, pos)
    outs, caches = [], []
    for threads in (1, 3):
        k, v = (c.clone() for c in before)
        outs.append(attend(lib, qkv, qk_w, cos, sin, k, v, pos, threads))
        caches.append((k, v))
    k, v = (c.clone() for c in before)
    rows = [attend(lib, qkv[t : t + 1], qk_w, cos[t : t + 1], sin[t : t + 1], k, v, pos + t, 1) for t in range(T)]
    outs.append(torch.cat(rows))
    caches.append((k, v))
    for out, (k, v) in zip(outs[1:], caches[1:], strict=True):
        assert torch.equal(out, outs[0])
        assert torch.equal(k, caches[0][0]) and torch.equal(v, caches[0][1])
    torch.testing.assert_close(outs[0].double(), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(caches[0][0][:, :pos], before[0][:, :pos])  # earlier positions untouched


def make_stack(kind: str):
    """LAYERS fused random Blocks + final norm with `kind` products: int4, int8 or native (the float
    GEMV); and the same stack in float64 on the weights the products really multiply by."""
    torch.manual_seed(3)
    layers = nn.ModuleList(Block(DIM, HEADS, KV_HEADS, HEAD_DIM, INNER, 1e-6) for _ in range(LAYERS))
    norm = RMSNorm(DIM, 1e-6)
    with torch.no_grad():
        for p in [*layers.parameters(), norm.weight]:
            p.copy_(torch.randn_like(p) * (0.1 if p.dim() > 1 else 0.5) + (0 if p.dim() > 1 else 1))
    fuse_projections(layers)
    exact = copy.deepcopy(layers).double(), copy.deepcopy(norm).double()
    lib = native.library()
    if kind == "int4":
        replace_linears(layers, lambda linear: Int4Linear.from_float(linear.weight, linear.bias, lib))
    elif kind == "int8":
        quantize_linears(layers, lib)
    else:
        replace_linears(layers, native_linear.converter(lib))
    weights = dict(exact[0].named_modules())
    for name, module in layers.named_modules():
        if isinstance(module, Int4Linear):
            weights[name].weight.data = dequantize(module.stored).double()
        elif isinstance(module, QuantLinear):
            qweight, scales = module.stored
            weights[name].weight.data = qweight.double() * scales.double()[:, None]
    return layers, norm, exact


def kinds():
    for kind in ("int4", "int8", "native"):
        why = int8_supported(native.library()) if kind == "int8" else None
        yield pytest.param(kind, marks=[pytest.mark.skip(reason=why)] if why else [], id=kind)


def caches(capacity: int = 64, dtype: torch.dtype = torch.float32) -> list[KVCache]:
    return [KVCache(1, KV_HEADS, capacity, HEAD_DIM, "cpu", dtype) for _ in range(LAYERS)]


def eager(layers, norm, x, rope, cache, start):
    for layer, layer_cache in zip(layers, cache, strict=True):
        x = layer(x, rope, layer_cache, start)
    return norm(x)


@pytest.mark.parametrize("kind", list(kinds()))
def test_prompts_of_stacks_whose_products_split_rows_run_in_one_native_call(kind):
    """int4 and int8 stacks take a prompt (19 positions after 5 cached ones) in the native step:
    the same bits in one call, in pieces, and on a team of three threads, and as close to the exact
    arithmetic as the eager layers (a float-rounding difference may move an activation by a step of
    its 8-bit grid, so the two differ by more than float rounding). A stack of the float GEMV keeps
    the eager layers for prompts."""
    layers, norm, (exact_layers, exact_norm) = make_stack(kind)
    step = native.stack_step(native.library(), layers, norm, torch.float32)
    rot = Rotary(HEAD_DIM, 10000.0)
    gen = torch.Generator().manual_seed(5)
    head, prompt = torch.randn(1, 5, DIM, generator=gen), torch.randn(1, 19, DIM, generator=gen)
    if kind == "native":
        assert not step.prompts and not step.applies(prompt, caches())
        return
    assert step.prompts and step.applies(prompt, caches())
    got = []
    with torch.inference_mode():
        for team, pieces in ((1, (19,)), (1, (7, 1, 11)), (3, (19,))):
            cache = caches()
            step(head, rot.span(0, 5, torch.float32, "cpu"), cache, 0)
            start, outs = 5, []
            with cpu.team(team, openmp=False):
                for n in pieces:
                    x = prompt[:, start - 5 : start - 5 + n]
                    outs.append(step(x, rot.span(start, n, torch.float32, "cpu"), cache, start))
                    start += n
            got.append((torch.cat(outs, dim=1), torch.cat([c.k[:, :, :24] for c in cache])))
        wants = []
        for stack, final, dtype in ((layers, norm, torch.float32), (exact_layers, exact_norm, torch.float64)):
            cache = caches(dtype=dtype)
            eager(stack, final, head.to(dtype), rot.span(0, 5, dtype, "cpu"), cache, 0)
            wants.append(eager(stack, final, prompt.to(dtype), rot.span(5, 19, dtype, "cpu"), cache, 5))
    for out, keys in got[1:]:
        assert torch.equal(out, got[0][0]) and torch.equal(keys, got[0][1])
    ours, theirs, truth = got[0][0].double(), wants[0].double(), wants[1]
    error = float((ours - truth).norm() / truth.norm())
    assert error <= 1.25 * float((theirs - truth).norm() / truth.norm()) and error < 0.1


@pytest.mark.parametrize("kind", [k for k in kinds() if k.values[0] != "native"])
def test_a_prompts_last_position_alone_has_the_bits_it_has_among_all(kind):
    """`last` (a prompt whose last position makes the first frame): the last layer's output product
    and MLP run on the last row alone, which gets the bits it gets among all the rows, on one
    thread or three; every position's keys and values are placed all the same."""
    layers, norm, _ = make_stack(kind)
    step = native.stack_step(native.library(), layers, norm, torch.float32)
    rot = Rotary(HEAD_DIM, 10000.0)
    gen = torch.Generator().manual_seed(6)
    head, prompt = torch.randn(1, 4, DIM, generator=gen), torch.randn(1, 23, DIM, generator=gen)
    with torch.inference_mode():
        for team in (1, 3):
            got = []
            for last in (False, True):
                cache = caches()
                step(head, rot.span(0, 4, torch.float32, "cpu"), cache, 0)
                with cpu.team(team, openmp=False):
                    out = step(prompt, rot.span(4, 23, torch.float32, "cpu"), cache, 4, last=last)
                keys, values = (torch.cat([getattr(c, kv)[:, :, :27] for c in cache]) for kv in "kv")
                got.append((out, keys, values))
            (every, k, v), (alone, k_alone, v_alone) = got
            assert every.shape == (1, 23, DIM) and alone.shape == (1, 1, DIM)
            assert torch.equal(alone, every[:, -1:]) and torch.equal(k_alone, k) and torch.equal(v_alone, v)


# The glue's results as bytes (a digest), for one build: norms, SiLU, attention at a released head
# width and at an odd one (its generic loops), on two threads.
GLUE = """
import ctypes, hashlib, numpy, torch
from kazeia import native
lib, rng, digest = native.library(), numpy.random.default_rng(0), hashlib.md5()
def randn(*shape):  # numpy's generator: the same numbers whatever torch's own kernels are
    return torch.from_numpy(rng.standard_normal(shape, dtype=numpy.float32))
T, H, inner, nq, nkv, cap = 9, 1024, 3072, 16, 8, 64
h, d, w, out = randn(T, H), randn(T, H), randn(H).abs(), torch.empty(T, H)
lib.add_rms_norm(h.data_ptr(), d.data_ptr(), w.data_ptr(), out.data_ptr(), T, H, ctypes.c_float(1e-6), 0)
gu, act = randn(T, 2 * inner) * 10, torch.empty(T, inner)
lib.silu_mul(gu.data_ptr(), act.data_ptr(), T, inner, 0)
results = [h, out, act]
for hd in (128, 40):
    qkv, qk_w, cos, sin = randn(T, (nq + 2 * nkv) * hd), randn(nq + nkv, hd).abs(), randn(T, hd), randn(T, hd)
    k, v, att = randn(nkv, cap, hd), randn(nkv, cap, hd), torch.empty(T, nq * hd)
    assert lib.attend(qkv.data_ptr(), qk_w.data_ptr(), cos.data_ptr(), sin.data_ptr(), k.data_ptr(), v.data_ptr(),
                      att.data_ptr(), T, nq, nkv, hd, cap, 21, ctypes.c_float(1e-6), 0, 2) == 0
    results += [att, k]
for t in results:
    digest.update(t.numpy().tobytes())
print(digest.hexdigest())
"""


def glue_digest(level: str) -> str:
    features = cpu.parse(level, cpu.detected())
    env = {**os.environ, **cpu.library_caps(features), "KAZEIA_ISA": level}
    done = subprocess.run([sys.executable, "-c", GLUE], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip()


@pytest.mark.skipif(os.environ.get("KAZEIA_ISA", "native") != "native", reason="compares the levels itself")
def test_the_glue_gives_the_same_bits_at_every_isa_level():
    """decode.c's loops are plain C (GCC vector extensions and what the compiler vectorizes, nothing
    fused): the portable build, AVX2 and this CPU's whole set give the same bytes."""
    have = cpu.detected()
    levels = ["portable"] + (["avx2"] if "avx2" in have else []) + ["native"]
    digests = {level: glue_digest(level) for level in levels}
    assert len(set(digests.values())) == 1, digests
