"""The native decode step (kazeia/native) against the eager layers it replaces, and its fallbacks."""

from __future__ import annotations

import copy
import os
import stat
import subprocess
import time

import numpy as np
import pytest
import torch
from torch import nn

from kazeia import Engine, cpu, native
from kazeia.conv import SnakeBeta
from kazeia.layers import Block, KVCache, RMSNorm, Rotary, fuse_projections
from kazeia.matmul import can_pack, pack_linears, replace_linears
from kazeia.native import linear as native_linear
from kazeia.quant import QuantLinear, int8_supported, quantize_linears

pytestmark = pytest.mark.skipif(native.library() is None, reason="no C compiler: the eager path runs")

DIM, HEADS, KV_HEADS, HEAD_DIM, INNER = 48, 6, 2, 16, 96
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def native_gemv(dtype: torch.dtype) -> bool:
    """Whether this build has the native vector GEMV for `dtype` (what the engine would use)."""
    lib = native.library()
    if lib is None or lib.gemv_vector_bits() == 0:
        return False
    return dtype != torch.float16 or bool(lib.has_float16())


def make_stack(dtype: torch.dtype, linears: str, seed: int = 0):
    """Three fused random layers + final norm; `linears`: plain, packed (oneDNN) or int8. Also
    returns the same stack in float64 on the weights it really multiplies by (rounded to `dtype`,
    or the int8 weights dequantized): the exact arithmetic both implementations approximate."""
    torch.manual_seed(seed)
    layers = nn.ModuleList(Block(DIM, HEADS, KV_HEADS, HEAD_DIM, INNER, 1e-6) for _ in range(3))
    norm = RMSNorm(DIM, 1e-6)
    with torch.no_grad():
        for p in [*layers.parameters(), norm.weight]:
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() > 1 else 0.5) + (0 if p.dim() > 1 else 1))
    layers.to(dtype), norm.to(dtype)
    fuse_projections(layers)
    exact = copy.deepcopy(layers).double(), copy.deepcopy(norm).double()
    if linears == "packed":
        pack_linears(layers)
    elif linears == "native":
        replace_linears(layers, native_linear.converter(native.library()))
    elif linears == "int8":
        quantize_linears(layers, native.library())
        exact_linears = dict(exact[0].named_modules())
        for name, module in layers.named_modules():
            if isinstance(module, QuantLinear):
                qweight, scales = module.stored
                exact_linears[name].weight.data = qweight.double() * scales.double()[:, None]
    return layers, norm, exact


def eager_step(layers, norm, x, rope, caches, start):
    for layer, cache in zip(layers, caches, strict=True):
        x = layer(x, rope, cache, start)
    return norm(x)


def new_caches(capacity: int = 40, dtype: torch.dtype = torch.float32):
    return [KVCache(1, KV_HEADS, capacity, HEAD_DIM, "cpu", dtype) for _ in range(3)]


def rms(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).pow(2).mean().sqrt())


def stack_cases():
    """Every linear kind the engine can build here for each dtype, and what is skipped and why."""
    cases = [(torch.float32, "int8")]
    cases += [(dtype, kind) for dtype in DTYPES for kind in ("plain", "packed", "native")]
    for dtype, kind in cases:
        why = None
        if kind == "packed" and not can_pack(dtype):
            why = f"no oneDNN packed {dtype} matmul on this CPU (or KAZEIA_ISA)"
        elif kind == "native" and not native_gemv(dtype):
            why = f"no vector native {dtype} product in this build (portable, or no _Float16)"
        elif kind == "int8" and int8_supported(native.library()) is not None:
            why = int8_supported(native.library())
        marks = [pytest.mark.skip(reason=why)] if why else []
        yield pytest.param(dtype, kind, marks=marks, id=f"{str(dtype).removeprefix('torch.')}-{kind}")


@pytest.mark.parametrize(("dtype", "linears"), list(stack_cases()))
def test_native_step_matches_the_eager_layers(dtype, linears):
    """The three implementations of a layer (kazeia/native/step.py) on one input, over 23 positions
    (one- and two-position steps), caches included. The native step against the eager layers:
    float32, the same values up to summation order; reduced precision and int8, where a
    summation-order difference can move a rounding (to the 16-bit format, or on an int8 product's
    16-bit activation grid), as close to the exact float64 arithmetic as the eager layers are.
    Where every product is native the step is stack.c's whole step, and the C glue called layer by
    layer gives its bits exactly."""
    if dtype == torch.float16 and not native.library().has_float16():
        pytest.skip("this C compiler has no _Float16")
    layers, norm, (exact_layers, exact_norm) = make_stack(dtype, linears)
    rot = Rotary(HEAD_DIM, 10000.0)
    ours, theirs, glue, truth = new_caches(), new_caches(), new_caches(), new_caches(dtype=torch.float64)
    gen = torch.Generator().manual_seed(1)
    got_all, want_all, exact_all = [], [], []
    with torch.inference_mode():
        prompt = torch.randn(1, 7, DIM, generator=gen).to(dtype)
        for caches in (ours, theirs, glue):  # the prompt on the eager path in all (tests/test_native_prompt.py)
            eager_step(layers, norm, prompt, rot.span(0, 7, dtype, "cpu"), caches, 0)
        eager_step(exact_layers, exact_norm, prompt.double(), rot.span(0, 7, torch.float64, "cpu"), truth, 0)
        step = native.stack_step(native.library(), layers, norm, dtype)
        assert step is not None and step.applies(prompt, ours) == step.prompts
        pos = 7
        while pos < 30:
            width = 2 if pos % 5 == 0 else 1  # two-position steps too (MAX_POSITIONS)
            x = torch.randn(1, width, DIM, generator=gen).to(dtype)
            x_before = x.clone()
            rope = rot.span(pos, width, dtype, "cpu")
            assert step.applies(x, ours)
            got = step(x, rope, ours, pos)
            want = eager_step(layers, norm, x, rope, theirs, pos)
            if step.whole is not None:  # layer by layer through the same kernels: the same bits
                apart = step._run(x.reshape(width, DIM), width, [(rope, glue, pos)], step.layers)
                assert torch.equal(apart.view(1, width, DIM), got)
            exact = eager_step(
                exact_layers, exact_norm, x.double(), rot.span(pos, width, torch.float64, "cpu"), truth, pos
            )
            pos += width
            assert torch.equal(x, x_before)  # the input is not modified
            assert got.shape == want.shape and got.dtype == want.dtype
            if dtype == torch.float32 and linears != "int8":
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            got_all.append(got), want_all.append(want), exact_all.append(exact)
        got, want, exact = (torch.cat(t, dim=1) for t in (got_all, want_all, exact_all))
        # The positions written (a cache's others are never read: KVCache)
        ours_k, theirs_k, truth_k = (torch.cat([c.k[:, :, :pos] for c in cs]) for cs in (ours, theirs, truth))
    if dtype == torch.float32 and linears != "int8":
        torch.testing.assert_close(ours_k, theirs_k, rtol=1e-5, atol=1e-5)
    else:
        # No less accurate than the eager layers (both errors come from the same roundings).
        assert rms(got, exact) <= 1.25 * rms(want, exact), (rms(got, exact), rms(want, exact))
        assert rms(ours_k, truth_k) <= 1.25 * rms(theirs_k, truth_k)
        assert rms(want, exact) < 0.05 * float(exact.pow(2).mean().sqrt())  # a meaningful yardstick


def test_native_step_attends_over_the_whole_cache():
    """A late key that dominates attention must change the output (the attention really spans
    every cached position, grouped query heads included)."""
    layers, norm, _ = make_stack(torch.float32, "plain")
    step = native.stack_step(native.library(), layers, norm, torch.float32)
    rot = Rotary(HEAD_DIM, 10000.0)
    with torch.inference_mode():
        caches = new_caches()
        x = torch.randn(1, 1, DIM)
        for pos in range(5):
            step(x, rot.span(pos, 1, torch.float32, "cpu"), caches, pos)
        before = step(x, rot.span(5, 1, torch.float32, "cpu"), caches, 5)
        for cache in caches:
            cache.v[:, :, 2] += 50.0
        after = step(x, rot.span(5, 1, torch.float32, "cpu"), caches, 5)
        assert not torch.allclose(before, after)


def test_cache_overflow_is_an_error_not_a_write_past_the_end():
    layers, norm, _ = make_stack(torch.float32, "plain")
    step = native.stack_step(native.library(), layers, norm, torch.float32)
    rot = Rotary(HEAD_DIM, 10000.0)
    caches = new_caches(capacity=4)
    with torch.inference_mode(), pytest.raises(RuntimeError, match="KV cache overflow"):
        step(torch.randn(1, 1, DIM), rot.span(4, 1, torch.float32, "cpu"), caches, 4)


def test_where_the_native_step_does_not_apply():
    lib = native.library()
    layers, norm, _ = make_stack(torch.float32, "plain")
    step = native.stack_step(lib, layers, norm, torch.float32)
    caches = new_caches()
    assert not step.applies(torch.randn(1, 3, DIM), caches)  # a prompt
    assert not step.applies(torch.randn(2, 1, DIM), caches)  # several sequences
    assert not step.applies(torch.randn(1, 1, DIM, dtype=torch.bfloat16), caches)  # another dtype
    assert not step.applies(torch.randn(1, 1, DIM), new_caches(dtype=torch.bfloat16))
    wide_layers, wide_norm, _ = make_stack(torch.float64, "plain")
    assert native.stack_step(lib, wide_layers, wide_norm, torch.float64) is None
    unfused = nn.ModuleList(Block(DIM, HEADS, KV_HEADS, HEAD_DIM, INNER, 1e-6) for _ in range(3))
    assert native.stack_step(lib, unfused, RMSNorm(DIM, 1e-6), torch.float32) is None
    assert native.stack_step(None, layers, norm, torch.float32) is None  # no library


def test_the_step_is_chosen_when_the_model_is_loaded(tiny_checkpoints, monkeypatch):
    """Where the model is built (TTSModel.prepare): the native step for both stacks, int8 products
    that use the library and, with one torch thread per stage, the native GEMV for float products;
    or the eager layers and stock or oneDNN products without it. (Each load sets the threads.)"""
    path = tiny_checkpoints["0.6B-custom"]
    model = Engine.load(path).model
    for stack in (model.talker, model.code_predictor):
        assert isinstance(stack.native_step, native.StackStep) and stack.native_step.dtype == torch.float32
    if int8_supported(native.library()) is None:
        quantized = Engine.load(path, dtype="int8").model
        assert all(m.native for m in quantized.modules() if isinstance(m, QuantLinear))
    products = {type(m).__name__ for m in model.talker.layers.modules() if hasattr(m, "in_features")}
    if native_gemv(torch.float32) and torch.get_num_threads() == 1:  # one thread per stage: the GEMV
        assert products == {"NativeLinear"}
    multi = Engine.load(path, threads=2).model  # more threads: oneDNN's products (or the stock ones)
    assert not any(isinstance(m, native_linear.NativeLinear) for m in multi.modules())
    monkeypatch.setenv("KAZEIA_NATIVE", "0")
    eager = Engine.load(path).model
    assert eager.talker.native_step is None and eager.code_predictor.native_step is None
    assert not any(isinstance(m, native_linear.NativeLinear) for m in eager.modules())


def test_a_new_build_removes_builds_unused_for_a_month(tmp_path):
    stale, recent = tmp_path / "decode-0000000000000000.so", tmp_path / "decode-1111111111111111.so"
    for old in (stale, recent):
        old.write_bytes(b"an earlier build")
    month_ago = time.time() - 31 * 86400
    os.utime(stale, (month_ago, month_ago))
    built = native.build(target_dir=tmp_path)
    assert built.exists() and recent.exists() and not stale.exists()
    os.utime(built, (month_ago, month_ago))
    assert native.build(target_dir=tmp_path) == built and built.stat().st_mtime > month_ago  # use refreshes


def test_build_is_cached_and_a_missing_compiler_is_named(tmp_path):
    first = native.build(target_dir=tmp_path)
    inode = first.stat().st_ino  # a rebuild would replace the file (a new inode)
    assert native.build(target_dir=tmp_path) == first and first.stat().st_ino == inode
    with pytest.raises(RuntimeError, match="no-such-cc"):
        native.build(compiler="no-such-cc", target_dir=tmp_path / "other")


def test_without_a_compiler_the_engine_warns_once_and_runs_eager(tiny_checkpoints, monkeypatch, tmp_path):
    opts = dict(voice="serena", language="english", do_sample=False, subtalker_dosample=False, max_new_tokens=12)
    native_out = Engine.load(tiny_checkpoints["0.6B-custom"]).synthesize("Hello there.", **opts)
    monkeypatch.setenv("CC", "no-such-cc")
    monkeypatch.setenv("KAZEIA_CACHE", str(tmp_path))  # nothing cached there: a build is needed
    native.reset()
    try:
        with pytest.warns(UserWarning, match="no-such-cc"):
            assert native.library() is None
        eager = Engine.load(tiny_checkpoints["0.6B-custom"]).synthesize("Hello there.", **opts)
    finally:
        native.reset()
    np.testing.assert_array_equal(eager.codes, native_out.codes)
    np.testing.assert_allclose(eager.audio, native_out.audio, atol=1e-4)


def test_kazeia_native_0_turns_it_off(monkeypatch):
    monkeypatch.setenv("KAZEIA_NATIVE", "0")
    assert native.library() is None


def snake_truth(x: torch.Tensor, log_alpha: torch.Tensor, log_beta: torch.Tensor) -> torch.Tensor:
    """SnakeBeta in float64 from the stored float32 logs (time-major x: channels last). The factors
    are taken in float64 too: torch's float32 exp is one ulp off on some ISA levels (AVX2 caps), and
    at |x * alpha| ~ 40 one ulp of alpha moves the output by ~4e-6, more than the sine's own error."""
    alpha, inv_beta = log_alpha.double().exp(), 1.0 / (log_beta.double().exp() + 1e-9)
    return x.double() + torch.sin(x.double() * alpha) ** 2 * inv_beta


def snake_module(channels: int, seed: int = 0) -> SnakeBeta:
    gen = torch.Generator().manual_seed(seed)
    snake = SnakeBeta(channels)
    snake.lib = native.library()
    with torch.no_grad():
        snake.alpha.copy_(torch.randn(channels, generator=gen) * 0.5)
        snake.beta.copy_(torch.randn(channels, generator=gen) * 0.5)
    return snake


@pytest.mark.parametrize("shape", [(1, 700, 96), (2, 300, 24), (3, 5, 7)])
def test_snake_beta_is_as_accurate_as_pytorch(shape, monkeypatch):
    """vocoder.c's one-pass SnakeBeta against float64: no worse than PyTorch's own sin (the eager
    path), for batches, odd channel counts and lengths below one vector."""
    snake = snake_module(shape[-1])
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1)) * 4
    truth = snake_truth(x, snake.alpha, snake.beta)
    with torch.no_grad():
        native_out = snake(x)
        monkeypatch.setattr(snake, "lib", None)
        eager = snake(x)
    native_error = (native_out.double() - truth).abs().max().item()
    eager_error = (eager.double() - truth).abs().max().item()
    assert native_error <= 2 * eager_error + 1e-7, (native_error, eager_error)
    assert native_error <= 2e-6 * x.abs().max().item()


def test_snake_beta_writes_only_its_window_and_takes_any_argument():
    """Written into a window of a wider buffer (the conv input after its carried tail), leaving the
    rest alone; huge, infinite and NaN arguments give what float64 sin gives."""
    snake = snake_module(16, seed=2)
    x = torch.randn(2, 40, 16, generator=torch.Generator().manual_seed(3))
    x[0, 0, :6] = torch.tensor([3e5, -7e6, 1e30, float("inf"), float("nan"), -2.5e4])
    buffer = torch.full((2, 46, 16), 123.0)
    with torch.no_grad():
        out = snake(x, out=buffer[:, 6:])
    assert out.data_ptr() == buffer[:, 6:].data_ptr()
    assert torch.all(buffer[:, :6] == 123.0)
    truth = snake_truth(x, snake.alpha, snake.beta).float()
    assert torch.equal(out.isnan(), truth.isnan())
    finite = ~truth.isnan()
    torch.testing.assert_close(out[finite], truth[finite], rtol=1e-6, atol=2e-6)


def test_snake_beta_gives_the_same_bits_on_any_thread_count():
    lib = native.library()
    snake = snake_module(96, seed=4)
    x = torch.randn(1, 2000, 96, generator=torch.Generator().manual_seed(5)) * 3
    outs = []
    for threads in (1, 2, 3, 8):
        y = torch.empty_like(x)
        ptrs = (x.data_ptr(), y.data_ptr(), snake.alpha.data_ptr(), snake.beta.data_ptr())
        assert lib.snake_beta(*ptrs, 1, 2000, 96, x.stride(0), y.stride(0), threads) == 0
        outs.append(y)
    assert all(torch.equal(outs[0], y) for y in outs[1:])


def test_without_the_library_snake_beta_runs_in_pytorch(monkeypatch):
    snake = snake_module(32, seed=6)
    x = torch.randn(2, 300, 32, generator=torch.Generator().manual_seed(7)) * 3
    with torch.no_grad():
        native_out = snake(x)
        monkeypatch.setattr(snake, "lib", None)
        eager = snake(x)
        window = torch.zeros(2, 303, 32)
        snake(x, out=window[:, 3:])
    assert not torch.equal(native_out, eager)  # two different sines...
    torch.testing.assert_close(native_out, eager, rtol=1e-6, atol=2e-6)  # ...of the same accuracy
    assert torch.equal(window[:, 3:], eager) and torch.all(window[:, :3] == 0)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("shape", [(3072, 1024, 1), (96, 48, 2), (37, 131, 2), (5, 7, 1)], ids=str)
def test_native_gemv_is_the_exact_product_rounded_once(dtype, shape):
    """gemv.c against float64 on the same (dtype-rounded) values: every build's vector path (this
    machine's, and through tests/test_cpu.py each smaller level's), odd sizes with tails, one and
    two rows, a bias; two rows give each row what it gets alone (the same sums), and so do the
    weight rows split over a team (a frame step that takes the vocoder's core: gemv_team)."""
    if not native_gemv(dtype):
        pytest.skip("no vector native product for this dtype in this build")
    rows, cols, m = shape
    gen = torch.Generator().manual_seed(rows + cols)
    linear = nn.Linear(cols, rows, bias=True)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(rows, cols, generator=gen) / cols**0.5)
        linear.bias.copy_(torch.randn(rows, generator=gen))
    linear.to(dtype)
    layer = native_linear.NativeLinear(linear, native.library())
    x = torch.randn(m, cols, generator=gen).to(dtype)
    with torch.inference_mode():
        got = layer(x)
        exact = (x.double() @ linear.weight.double().T + linear.bias.double()).to(dtype)
        alone = torch.cat([layer(x[i : i + 1]) for i in range(m)])
        teams = []
        for threads in (2, 3):
            with cpu.team(threads, openmp=False):
                teams.append(layer(x))
    assert got.dtype == dtype and got.shape == (m, rows)
    assert torch.equal(got, alone)
    assert all(torch.equal(got, team) for team in teams)
    step = {torch.float32: 2e-6, torch.bfloat16: 2**-7, torch.float16: 2**-10}[dtype]
    torch.testing.assert_close(got.double(), exact.double(), rtol=step, atol=step * float(exact.abs().max()))


PLANTED = """
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen(getenv("KAZEIA_PLANTED_MARK"), "w");
    if (f) fclose(f);
}
int gemv(void) { return 0; }
"""


@pytest.fixture
def planted(tmp_path, monkeypatch):
    """A library that is not Kazeia's, put where the build for this machine is looked for; its
    constructor leaves a mark when it is loaded. Returns (its path, the mark)."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("KAZEIA_CACHE", str(cache))
    expected = native.build()  # the name the engine will look for
    source = tmp_path / "planted.c"
    source.write_text(PLANTED)
    subprocess.run(["cc", "-shared", "-fPIC", str(source), "-o", str(expected)], check=True)
    mark = tmp_path / "constructor-ran"
    monkeypatch.setenv("KAZEIA_PLANTED_MARK", str(mark))
    native.reset()
    yield expected, mark
    native.reset()


def test_the_cache_directory_is_created_private(tmp_path, monkeypatch):
    monkeypatch.setenv("KAZEIA_CACHE", str(tmp_path / "new" / "cache"))
    path = native.build()
    for directory in (tmp_path / "new", tmp_path / "new" / "cache", path.parent):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700, directory
    assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0


def test_a_library_others_may_write_is_rebuilt_not_loaded(planted):
    path, mark = planted
    path.chmod(0o777)
    with pytest.warns(UserWarning, match="not a private file"):
        lib = native.library()
    assert lib is not None and lib.gemv_vector_bits() >= 0 and not mark.exists()
    assert stat.S_IMODE(path.stat().st_mode) == 0o700


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="chown to another user needs root")
def test_a_library_of_another_user_is_rebuilt_not_loaded(planted):
    path, mark = planted
    os.chown(path, 4321, 4321)
    with pytest.warns(UserWarning, match="not a private file"):
        assert native.library() is not None
    assert not mark.exists() and path.stat().st_uid == os.getuid()


def test_a_foreign_library_of_this_user_is_refused_with_one_warning(planted, tiny_checkpoints):
    path, mark = planted  # private and ours: loaded (its constructor runs), then found not to be a build
    with pytest.warns(UserWarning, match="not a Kazeia build: it lacks"):
        assert native.library() is None
    assert mark.exists()
    engine = Engine.load(tiny_checkpoints["0.6B-custom"])  # the PyTorch path, no AttributeError
    assert engine.model.talker.native_step is None
    assert engine.synthesize("Still speaks.", voice="serena", max_new_tokens=3).audio.size > 0


def test_a_cache_directory_others_may_write_is_not_used(tmp_path, monkeypatch):
    cache = tmp_path / "shared"
    (cache / "native").mkdir(parents=True)
    (cache / "native").chmod(0o777)
    monkeypatch.setenv("KAZEIA_CACHE", str(cache))
    native.reset()
    try:
        with pytest.warns(UserWarning, match="writable by others"):
            assert native.library() is None
    finally:
        native.reset()
    assert not list((cache / "native").iterdir())  # nothing was built there


def test_a_cache_inside_a_directory_others_may_change_is_not_used(tmp_path, monkeypatch):
    shared = tmp_path / "shared"  # like a /tmp without its sticky bit: others may rename entries
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("KAZEIA_CACHE", str(shared / "kazeia"))
    native.reset()
    try:
        with pytest.warns(UserWarning, match="which another user may change"):
            assert native.library() is None
        shared.chmod(0o1777)  # sticky, as /tmp is: only owners may rename their entries
        native.reset()
        assert native.library() is not None
    finally:
        native.reset()
