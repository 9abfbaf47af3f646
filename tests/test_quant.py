"""int8 products (kazeia/quant.py). The native product (kazeia/native/int8.c): the float64
reference of its arithmetic bit for bit in every build, rows independent, as accurate as its int8
weights. The int8 GEMM's path (no native library): two activation rows make the product as
accurate as its weights, where one 8-bit row adds an activation error of the same size again."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from kazeia import cpu, native
from kazeia.quant import (
    LINEAR_DYNAMIC,
    QuantLinear,
    activation_scale,
    deinterleave,
    interleave,
    quantize_weight,
    reference_product,
    residual_factor,
    split_rows,
)

LIB = native.library()
needs_lib = pytest.mark.skipif(LIB is None, reason="the native int8 product needs the native library")


def dequantized(weight: torch.Tensor) -> torch.Tensor:
    """The weights an int8 layer really multiplies by: per-row symmetric rounding, independently."""
    scales = weight.abs().amax(dim=1, keepdim=True) / 127
    return torch.round(weight / scales) * scales


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


INPUTS = {
    "gaussian": lambda g: torch.randn(1, 512, generator=g),
    "heavy-tailed": lambda g: torch.randn(1, 512, generator=g) * torch.randn(1, 512, generator=g),
    "several rows": lambda g: torch.randn(5, 512, generator=g),
    "offset": lambda g: torch.randn(1, 512, generator=g) + 1.5,
}


def rounding_error(x: torch.Tensor, weight: torch.Tensor, exact: torch.Tensor, step: float) -> float:
    """The relative output error expected when every input is off by an independent error spread
    evenly over one grid step (variance step^2 / 12), as rounding to that grid leaves it."""
    return step / math.sqrt(12) * float(weight.norm()) * math.sqrt(x.shape[0]) / float(exact.norm())


@pytest.mark.parametrize("levels", [255, 127], ids=["8-bit", "7-bit"])
@pytest.mark.parametrize("kind", list(INPUTS))
def test_two_rows_leave_only_the_weights_rounding(kind, levels):
    """The error of one and of two rows as the arithmetic predicts it, on both activation grids
    (7 bits where the GEMM has no VNNI kernel, `needs_reduced_range`; the 7-bit grid is valid on
    every CPU, so both run everywhere). One row rounds x to steps s = range / levels; two rows
    leave the second row's rounding divided by f, f >= the largest power of two with f * s/2
    inside the input's range on both sides of 0 (`residual_factor`)."""
    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(384, 512, generator=g), torch.randn(384, generator=g)
    layer = QuantLinear.from_float(weight, bias)
    if levels == 255 and layer.reduce_range:
        pytest.skip("the full 8-bit grid needs the GEMM's VNNI kernel (cpu feature 'vnni')")
    layer.reduce_range, layer.levels = levels == 127, levels
    x = INPUTS[kind](g)
    with torch.inference_mode():
        got = layer(x)
        exact = x @ dequantized(weight).T + bias  # the int8 weights in float, float activations
        one_row = LINEAR_DYNAMIC(x, layer.packed, layer.reduce_range) + bias
    low, high = float(x.min()), float(x.max())
    step = (max(high, 0.0) - min(low, 0.0)) / levels
    factor = 2.0 ** math.floor(math.log2(min(-low, high) / (step / 2)))
    one_row_expected = rounding_error(x, dequantized(weight), exact, step)
    assert 0.7 < rel(one_row, exact) / one_row_expected < 1.4
    assert rel(got, exact) < 1.4 * one_row_expected / factor
    weights_error = rel(x @ weight.T + bias, exact)  # ~0.5-0.8%: int8 weights
    assert weights_error > 3e-3
    assert rel(got, exact) < 0.1 * weights_error  # what is left is the weights' rounding


def test_split_rows_keeps_the_range_and_scales_the_residual_by_a_power_of_two():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 256, generator=g)
    stacked, factor = split_rows(x, 255)
    assert stacked.shape == (6, 256) and torch.equal(stacked[:3], x)
    assert factor >= 2 and math.frexp(factor)[0] == 0.5  # a power of two
    residual = stacked[3:] / factor
    step = activation_scale(float(x.min()), float(x.max()), 255)
    assert float(residual.abs().max()) <= step / 2 * (1 + 1e-6)  # a rounding residual on the grid
    assert float(stacked[3:].min()) >= float(x.min()) and float(stacked[3:].max()) <= float(x.max())
    assert torch.allclose(torch.round((x - residual) / step), (x - residual) / step, atol=1e-3)


def test_inputs_without_room_fall_back_to_one_row():
    positive = torch.rand(1, 64) + 0.5  # no negative side: a residual row would widen the range
    assert split_rows(positive, 255) == (positive, 0.0)
    zeros = torch.zeros(2, 64)
    stacked, factor = split_rows(zeros, 255)
    assert factor == 0.0 and stacked is zeros
    layer = QuantLinear.from_float(torch.randn(8, 64), torch.arange(8.0))
    with torch.inference_mode():
        assert torch.equal(layer(zeros), torch.arange(8.0).expand(2, 8))  # bias once, nothing else


@settings(max_examples=200, deadline=None)
@given(
    low=st.floats(-100, 0, allow_subnormal=False),
    high=st.floats(0, 100, allow_subnormal=False),
    frac=st.floats(0, 1),
)
def test_residual_factor_is_the_largest_fitting_power_of_two(low, high, frac):
    step = activation_scale(low, high, 255)
    largest = float(np.float32(frac * step / 2))  # a float32 residual, as the products have
    f = residual_factor(low, high, largest)
    room = min(-low, high)
    if f:
        assert 2 <= f <= 2**16 and math.frexp(f)[0] == 0.5
        assert f * largest <= room and (f == 2**16 or room < 2 * f * largest)
    else:
        assert largest == 0 or room < 2 * largest


def test_quantize_keeps_bias_out_of_the_packed_weight():
    """The bias is added once after the rows are combined (a packed bias would count twice)."""
    layer = nn.Linear(32, 16)
    q = QuantLinear.from_float(layer.weight, layer.bias)
    x = torch.randn(4, 32)
    with torch.inference_mode():
        exact = x @ dequantized(layer.weight.detach()).T + layer.bias.detach()
        assert rel(q(x), exact) < 1e-3


def test_two_rows_on_cpus_without_vnni_use_the_reduced_grid():
    """Without VNNI the GEMM quantizes activations to 7 bits (127 steps); the residual row must be
    taken on that grid, or it would not cancel the rounding (forced here on any CPU)."""
    g = torch.Generator().manual_seed(2)
    weight = torch.randn(256, 384, generator=g)
    layer = QuantLinear.from_float(weight, None)
    layer.reduce_range, layer.levels = True, 127
    x = torch.randn(3, 384, generator=g)
    with torch.inference_mode():
        exact = x @ dequantized(weight).T
        one_row = LINEAR_DYNAMIC(x, layer.packed, True)
        assert rel(layer.eager(x), exact) < 0.02 * rel(one_row, exact)
        layer.levels = 255  # the wrong grid: the residual no longer matches the GEMM's rounding
        assert rel(layer.eager(x), exact) > 0.1 * rel(one_row, exact)


def test_an_input_of_no_rows_gives_no_rows():
    """A prompt's empty text track (live text) multiplies no rows: with the native product too."""
    from kazeia import native

    layer = QuantLinear.from_float(torch.randn(8, 64), torch.arange(8.0), native.library())
    with torch.inference_mode():
        assert layer(torch.zeros(1, 0, 64)).shape == (1, 0, 8)


@needs_lib
def test_the_native_kernel_is_the_one_the_features_allow():
    have = cpu.enabled()
    assert LIB.int8_kernel() == (2 if "avx512" in have else 1 if "avx2" in have else 0)


def _native(rows: int, cols: int, bias: bool, seed: int) -> tuple[QuantLinear, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, cols, generator=g) * 0.05
    layer = QuantLinear.from_float(weight, torch.randn(rows, generator=g) if bias else None, LIB)
    assert layer.native
    return layer, weight


@needs_lib
@pytest.mark.parametrize(("rows", "cols"), [(4, 32), (36, 256), (132, 1024), (8, 8192 + 32), (12, 16384 + 96)])
@pytest.mark.parametrize("m", [1, 3, 4, 9])
def test_the_native_product_is_its_reference_arithmetic(rows, cols, m):
    """Bit for bit against `reference_product` (float64, exact integer sums), one thread or a team
    (a prompt's product), with and without bias, widths past one block of 32-bit lane sums."""
    layer, _ = _native(rows, cols, bias=m % 2 == 1, seed=rows + m)
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, cols, generator=g) * torch.logspace(-3, 3, m)[:, None]
    qweight, scales = layer.stored
    want = reference_product(x, qweight, scales, layer.bias)
    with torch.inference_mode():
        assert torch.equal(layer(x), want)
        with cpu.team(3):
            assert torch.equal(layer(x.repeat(3, 1)), want.repeat(3, 1))  # rows split over the team


@needs_lib
def test_the_native_product_at_the_ends_of_its_range():
    """Every weight and activation at its largest magnitude (sums far past 32 bits, exact), a zero
    row (the bias alone), a row that is not finite (NaN), and a tiny one."""
    cols = 8192 * 3
    qweight = torch.full((4, cols), 127, dtype=torch.int8)
    qweight[1] = -127
    scales = torch.tensor([1.0, 0.5, 2.0**-20, 3.0])
    layer = QuantLinear.from_int8(qweight, scales, torch.arange(4.0), LIB)
    x = torch.stack([torch.full((cols,), 5.0), torch.zeros(cols), torch.full((cols,), -1e-30), torch.zeros(cols)])
    x[3, 7] = math.inf
    with torch.inference_mode():
        y = layer(x)
    assert torch.equal(y[:3], reference_product(x[:3], qweight, scales, layer.bias))
    assert float(y[0, 0]) == pytest.approx(5.0 * 127 * cols, rel=1e-6)
    assert torch.equal(y[1], torch.arange(4.0))
    assert bool(torch.isnan(y[3]).all())


@needs_lib
@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 12), order=st.permutations(range(12)), seed=st.integers(0, 2**16))
def test_a_native_row_never_depends_on_the_others(m, order, seed):
    """Any rows, in any order and number: each row's result is its result alone."""
    layer, _ = _native(64, 320, bias=True, seed=7)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(12, 320, generator=g) * torch.logspace(-2, 2, 12)[:, None]
    picked = x[list(order[:m])]
    with torch.inference_mode():
        together = layer(picked)
        for i in range(m):
            assert torch.equal(together[i], layer(picked[i : i + 1])[0])


@needs_lib
@pytest.mark.parametrize("kind", list(INPUTS))
def test_the_native_product_leaves_only_the_weights_rounding(kind):
    """16-bit activation rows: the error against the int8 weights in float with exact activations
    is a small fraction of what the weights' own rounding costs."""
    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(384, 512, generator=g), torch.randn(384, generator=g)
    layer = QuantLinear.from_float(weight, bias, LIB)
    x = INPUTS[kind](g)
    with torch.inference_mode():
        got = layer(x)
    exact = x @ dequantized(weight).T + bias
    weights_error = rel(x @ weight.T + bias, exact)
    assert weights_error > 3e-3
    assert rel(got, exact) < 0.01 * weights_error


@needs_lib
def test_the_native_layout_holds_the_stored_values():
    """int8.c's interleaved layout is a reordering: `stored` gives back quantize_weight's values,
    and a shape int8.c does not take keeps the int8 GEMM."""
    weight = torch.randn(40, 96)
    qweight, scales = quantize_weight(weight)
    assert torch.equal(deinterleave(interleave(qweight)), qweight)
    assert not torch.equal(interleave(qweight), qweight)
    layer = QuantLinear.from_float(weight, None, LIB)
    stored = layer.stored
    assert torch.equal(stored[0], qweight) and torch.equal(stored[1], scales)
    odd = QuantLinear.from_float(torch.randn(6, 96), None, LIB)  # 6 rows: not in groups of 4
    assert not odd.native and odd.packed is not None
