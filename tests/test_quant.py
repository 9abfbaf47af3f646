"""int8 products (kazeia/quant.py): two activation rows make the product as accurate as its int8
weights, where one 8-bit row adds an activation error of the same size again."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from kazeia.quant import LINEAR_DYNAMIC, QuantLinear, activation_scale, residual_factor, split_rows


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
