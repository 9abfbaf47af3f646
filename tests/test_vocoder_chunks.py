"""The vocoder's audio has the same bits whatever the chunking, the thread count or the batch.

Where the vocoder runs natively (kazeia/native; every ISA level, tests/test_cpu.py), every output
sample is computed by the same arithmetic in the same order whatever chunk it falls in: one offline
decode and any split of the same codes into chunks (single frames, odd sizes, ramps, random splits,
a state carried over from earlier frames as an ICL voice's priming) give equal float32 audio, hence
equal 16-bit PCM, for float32, bfloat16 and float16 vocoders. The product kernel (conv.c's `vconv`)
is checked alone too: a position's outputs do not depend on the other positions, rows or threads of
the call.
"""

from __future__ import annotations

import json
import pathlib

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from kazeia import native
from kazeia.audio import pcm16
from kazeia.checkpoint import assign
from kazeia.config import VocoderConfig
from kazeia.conv import FLOAT32, NARROW_BF16, PAIRS_BF16, Tiled
from kazeia.testing.vocoder import random_vocoder_tensors, tiny_speech_tokenizer_config
from kazeia.vocoder import OFFLINE_BLOCK, Vocoder, VocoderState, vocoder_tensors
from kazeia.voices import copy_state

REAL_CONFIG = (
    pathlib.Path(__file__).resolve().parent.parent
    / "kazeia/reference_files/Qwen3-TTS-12Hz-0.6B-CustomVoice/speech_tokenizer/config.json"
)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
FRAMES = 75  # more than two offline blocks of OFFLINE_BLOCK frames, and past the 72-frame attention window

pytestmark = pytest.mark.skipif(native.library() is None, reason="no native library: eager PyTorch")


@pytest.fixture(scope="module")
def vocoders(tmp_path_factory) -> dict[torch.dtype, Vocoder]:
    """A tiny random vocoder in each dtype, as `Vocoder.load` leaves it."""
    config = tmp_path_factory.mktemp("tiny_vocoder") / "config.json"
    config.write_text(json.dumps(tiny_speech_tokenizer_config(json.loads(REAL_CONFIG.read_text()))))
    cfg = VocoderConfig.from_file(config)
    tensors = vocoder_tensors(random_vocoder_tensors(cfg, torch.Generator().manual_seed(0)))
    made = {}
    for dtype in DTYPES:
        with torch.device("meta"):
            vocoder = Vocoder(cfg)
        assign(vocoder, tensors, where="random", device="cpu", dtype=dtype)
        vocoder.prepare("cpu", dtype)
        made[dtype] = vocoder.eval()
    return made


def codes(frames: int, seed: int, batch: int = 1) -> torch.Tensor:
    return torch.randint(0, 2048, (batch, frames, 16), generator=torch.Generator().manual_seed(seed))


def chunked(vocoder: Vocoder, codes: torch.Tensor, sizes: list[int], state: VocoderState | None = None) -> torch.Tensor:
    """Decode `codes` (B, T, 16) in chunks of sizes[0], sizes[1], ... (the last size repeating)."""
    state = vocoder.new_state(codes.shape[0]) if state is None else state
    pieces, start, i = [], 0, 0
    while start < codes.shape[1]:
        n = sizes[min(i, len(sizes) - 1)]
        pieces.append(vocoder.decode_chunk(codes[:, start : start + n], state))
        start, i = start + n, i + 1
    return torch.cat(pieces, dim=-1)


def assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype == torch.float32
    assert torch.equal(a, b), f"{int((a != b).sum())} samples differ, by up to {(a - b).abs().max().item():.3g}"
    assert pcm16(a.numpy()) == pcm16(b.numpy())


SCHEDULES = {
    **{f"every {n}": [n] for n in (1, 2, 3, 4, 5, 7, 13, 32)},
    "first 1 then 7": [1, 7],
    "ramp": [1, 2, 4, 8, 16, 32],
    "catch-up": [1, 4, 4, 33, 2, 64],
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("schedule", list(SCHEDULES), ids=list(SCHEDULES))
def test_any_chunk_schedule_gives_the_offline_bits(vocoders, dtype, schedule):
    vocoder, frames = vocoders[dtype], codes(FRAMES, seed=1)
    assert_same(chunked(vocoder, frames, SCHEDULES[schedule]), vocoder(frames))


@settings(max_examples=10, deadline=None)
@given(
    frames=st.integers(1, 100),
    sizes=st.lists(st.integers(1, 40), min_size=1, max_size=16),
    seed=st.integers(0, 2**16),
    dtype=st.sampled_from(DTYPES),
)
def test_random_splits_give_the_offline_bits(vocoders, frames, sizes, seed, dtype):
    vocoder, frames = vocoders[dtype], codes(frames, seed)
    assert_same(chunked(vocoder, frames, sizes), vocoder(frames))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_thread_count_does_not_change_the_bits(vocoders, dtype):
    vocoder, frames = vocoders[dtype], codes(2 * OFFLINE_BLOCK, seed=2)
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(vocoder(frames))
            outs.append(chunked(vocoder, frames, [5]))
    finally:
        torch.set_num_threads(before)
    for out in outs[1:]:
        assert_same(out, outs[0])


def test_a_primed_state_continues_with_the_offline_bits(vocoders):
    """An ICL voice's audio: the reference frames decoded once (as `voices.Priming` does), then the
    generated frames streamed from a copy of that state, give the bits of one offline decode."""
    vocoder = vocoders[torch.float32]
    reference, generated = codes(37, seed=3), codes(29, seed=4)
    primed = vocoder.new_state()
    vocoder.decode_blocks(reference, primed)
    whole = vocoder(torch.cat((reference, generated), dim=1))[:, 37 * 1920 :]
    for sizes in ([1], [3, 8], [32]):
        assert_same(chunked(vocoder, generated, sizes, copy_state(primed)), whole)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_stream_decoded_in_a_batch_has_its_own_bits(vocoders, dtype):
    vocoder, frames = vocoders[dtype], codes(20, seed=5, batch=2)
    both = chunked(vocoder, frames, [3])
    for b in range(2):
        assert_same(both[b : b + 1], vocoder(frames[b : b + 1]))


# -- the product kernel alone ------------------------------------------------------------------------
WEIGHTS = ["float32", "bfloat16", "narrow"]  # as given; a bfloat16 vocoder's (`half`); rounded to bfloat16


def tiled(n: int, taps: int, cin: int, dilation: int, seed: int, weights: str) -> tuple[Tiled, torch.Tensor]:
    """A random `Tiled` of `weights` (WEIGHTS) and its weight (n, taps, cin) with the values the
    product multiplies (bfloat16 ones but for float32)."""
    gen = torch.Generator().manual_seed(seed)
    weight, bias = torch.randn(n, taps, cin, generator=gen) / (taps * cin) ** 0.5, torch.randn(n, generator=gen)
    half, narrow = weights == "bfloat16", weights == "narrow"
    product = Tiled(native.library(), weight.bfloat16().float() if half else weight, bias, dilation, half, narrow)
    return product, weight if weights == "float32" else weight.bfloat16().float()


@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("n", [1, 3, 5, 16, 24, 40, 72, 96, 100, 200])
def test_every_panel_shape_is_conv1d(n, weights):
    """Any number of output channels (every panel width and remainder, and the dot products of
    very few channels), batch, dilation and residual: PyTorch's conv1d within float rounding (of
    the inputs rounded to bfloat16 where the product takes bfloat16 pairs)."""
    product, weight = tiled(n, 3, 20, 2, seed=n, weights=weights)
    gen = torch.Generator().manual_seed(1)
    x, res = torch.randn(2, 4 + 37, 20, generator=gen), torch.randn(2, 37, n, generator=gen)
    pairs = product.format == PAIRS_BF16 and n * 4 > native.library().vconv_lanes()
    seen = x.bfloat16().float() if pairs else x
    expected = F.conv1d(seen.transpose(1, 2), weight.transpose(1, 2), product.bias, dilation=2).transpose(1, 2) + res
    torch.testing.assert_close(product(x, res), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n, taps, cin", [(1, 3, 20), (5, 2, 33), (40, 3, 20), (200, 1, 72), (768, 2, 384)])
def test_narrow_weights_give_the_bits_of_float32_products_of_their_rounding(n, taps, cin):
    """Weights stored as bfloat16 and widened as read (`narrow`, and a bfloat16 vocoder's where
    the build has no bfloat16 pairs) multiply in float32 in the same order: the bits of the float32
    product of the weights rounded to bfloat16, with bias and residual, at every panel shape (and
    for the dot products of very few channels)."""
    lib = native.library()
    product, rounded = tiled(n, taps, cin, 3, seed=n, weights="narrow")
    wide = Tiled(lib, rounded, product.bias, 3)
    assert product.format == NARROW_BF16
    if n * 4 > lib.vconv_lanes():  # the panels hold half the bytes (a dot-product layer keeps float32 rows)
        assert product.weight.numel() * 2 == wide.weight.numel()
    gen = torch.Generator().manual_seed(2)
    x, res = torch.randn(2, (taps - 1) * 3 + 29, cin, generator=gen), torch.randn(2, 29, n, generator=gen)
    assert torch.equal(product(x, res), wide(x, res))
    if not lib.vconv_pairs(cin):  # a bfloat16 vocoder's product: narrow too, so the same bits
        half, _ = tiled(n, taps, cin, 3, seed=n, weights="bfloat16")
        assert half.format == NARROW_BF16 and torch.equal(half(x, res), wide(x, res))


@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("n, taps, cin, dilation", [(96, 7, 96, 9), (1, 7, 96, 1), (768, 2, 384, 1), (500, 1, 72, 1)])
def test_a_position_does_not_depend_on_the_call(n, taps, cin, dilation, weights):
    """A position's outputs are the same bits computed in any window of positions, in a batch with
    other rows, at any thread count (the work is split over threads from ~1 M multiply-adds or 256
    KiB of weights each: a single position of the 2.4 MB (768, 2, 384) is split by its panels)."""
    product, _ = tiled(n, taps, cin, dilation, seed=7, weights=weights)
    keep, length = (taps - 1) * dilation, 700
    x = torch.randn(3, keep + length, cin, generator=torch.Generator().manual_seed(8))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        whole = product(x)
        for threads in (2, 3):  # blocks of positions evened out for the threads: other blocks
            torch.set_num_threads(threads)
            assert torch.equal(product(x), whole)
            for start, end in ((0, 1), (5, 6), (13, 400), (333, 700)):
                assert torch.equal(product(x[1:2, start : end + keep]), whole[1:2, start:end])
    finally:
        torch.set_num_threads(before)


def test_a_bfloat16_vocoder_takes_bfloat16_pairs_where_the_cpu_has_them(vocoders):
    """... and else stores its weights as bfloat16 (the bits of float32 products, half the bytes)."""
    lib = native.library()
    has_pairs = bool(lib.vconv_pairs(2))  # the build has AVX512_BF16 (KAZEIA_ISA with bf16)
    products = [m for m in vocoders[torch.bfloat16].modules() if isinstance(m, Tiled)]
    assert all(p.format == (PAIRS_BF16 if has_pairs and p.cin % 2 == 0 else NARROW_BF16) for p in products)
    others = [m for dtype in (torch.float32, torch.float16) for m in vocoders[dtype].modules() if isinstance(m, Tiled)]
    assert all(p.format == FLOAT32 for p in others)
