"""The int8 vocoder (`vocoder_dtype="int8"`): exact integer products, chunk invariance, quality.

conv8.c's `vconv8` is held to an independent computation of its definition in PyTorch (rows and
weights quantized, integer sums in int64, the float steps in their order): equal bits, so every
kernel (AVX-512 VNNI, AVX2, portable; tests/test_cpu.py reruns this file at each level) gives the
same bits. A whole int8 vocoder gives the same audio bits whatever the chunking and thread count,
and stays within an SNR floor of the float32 vocoder (a kernel that dropped a tap, a scale or the
VNNI offset's correction falls far below it).
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest
import torch

from kazeia import Engine, native
from kazeia.checkpoint import assign
from kazeia.config import VocoderConfig
from kazeia.conv import FLOAT32, NARROW_BF16, PAIRS_BF16, Tiled, Tiled8, TiledLinear
from kazeia.testing.vocoder import random_vocoder_tensors, tiny_speech_tokenizer_config
from kazeia.vocoder import Vocoder, vocoder_tensors

REAL_CONFIG = (
    pathlib.Path(__file__).resolve().parent.parent
    / "kazeia/reference_files/Qwen3-TTS-12Hz-0.6B-CustomVoice/speech_tokenizer/config.json"
)
SNR_FLOOR_DB = 25.0  # the tiny random vocoder's int8 audio against float32 (~33 dB on every kernel)

pytestmark = pytest.mark.skipif(native.library() is None, reason="no native library: the int8 vocoder needs it")


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows (..., K) float32 -> codes (..., K) int64 in -127..127 and scales (...,) float32, each row alone."""
    most = x.abs().amax(-1)
    inv = torch.where(most > 0, torch.tensor(127.0) / most, torch.zeros_like(most))
    codes = torch.round(x * inv[..., None]).clamp(-127, 127).long()
    return codes, most / torch.tensor(127.0)


def reference(x, weight, bias, res, dilation):
    """vconv8's definition: x (B, keep + L, C), weight (N, taps, C) -> (B, L, N) float32."""
    n, taps, cin = weight.shape
    qw, sw = quantize_rows(weight.reshape(n, taps * cin))
    qw = qw.view(n, taps, cin)
    qx, sx = quantize_rows(x)
    L = x.shape[1] - (taps - 1) * dilation
    f = torch.zeros(x.shape[0], L, n)
    for tap in range(taps):
        rows = slice(tap * dilation, tap * dilation + L)
        sums = (qx[:, rows] @ qw[:, tap].T).float()  # exact: |sum| < 2^24 here
        f = f + sums * sx[:, rows, None]
    y = f * sw
    if bias is not None:
        y = y + bias
    return y if res is None else y + res


@pytest.mark.parametrize(
    ("batch", "length", "cin", "n", "taps", "dilation", "extras"),
    [
        (1, 37, 96, 96, 7, 3, True),
        (2, 13, 50, 33, 7, 1, True),  # cin not a multiple of 4, n not of any vector width
        (1, 64, 192, 40, 1, 1, False),
        (3, 5, 7, 130, 2, 1, True),
        (2, 151, 64, 70, 7, 2, True),  # big enough for 3 threads: their positions split within and across entries
        (2, 300, 256, 40, 3, 2, True),  # enough rows for their quantization to be split over threads
    ],
)
def test_vconv8_equals_its_definition_bit_for_bit(batch, length, cin, n, taps, dilation, extras):
    lib = native.library()
    g = torch.Generator().manual_seed(cin * 1000 + n)
    weight = torch.randn(n, taps, cin, generator=g) / cin**0.5
    bias = torch.randn(n, generator=g) if extras else None
    keep = (taps - 1) * dilation
    x = torch.randn(batch, keep + length, cin, generator=g) * torch.rand(batch, keep + length, 1, generator=g) * 4
    x[0, keep] = 0  # a row of zeros: scale 0, codes 0
    res = torch.randn(batch, length, n, generator=g) if extras else None
    conv = Tiled8(lib, weight, bias, dilation)
    want = reference(x, weight, bias, res, dilation)
    for threads in (1, 3):
        torch.set_num_threads(threads)
        try:
            got = conv(x, res)
        finally:
            torch.set_num_threads(1)
        assert torch.equal(got, want), (threads, (got - want).abs().max())
    # a position's output does not depend on the other positions of the call
    start = length // 2
    part = conv(x[:, start:], None if res is None else res[:, start:])
    assert torch.equal(part, want[:, start:])


def test_vconv8_refuses_what_it_cannot_take():
    conv = Tiled8(native.library(), torch.randn(4, 3, 8), None)
    with pytest.raises(ValueError, match="vconv8 refused"):
        conv(torch.randn(1, 1, 8))  # fewer rows than the taps carry


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Vocoder, Vocoder]:
    """A tiny random vocoder in float32 and in int8, as `Vocoder.load` leaves them."""
    config = tmp_path_factory.mktemp("tiny_vocoder") / "config.json"
    config.write_text(json.dumps(tiny_speech_tokenizer_config(json.loads(REAL_CONFIG.read_text()))))
    cfg = VocoderConfig.from_file(config)
    tensors = vocoder_tensors(random_vocoder_tensors(cfg, torch.Generator().manual_seed(0)))
    made = []
    for int8 in (False, True):
        with torch.device("meta"):
            vocoder = Vocoder(cfg)
        assign(vocoder, tensors, where="random", device="cpu", dtype=torch.float32)
        vocoder.prepare("cpu", torch.float32, int8=int8)
        made.append(vocoder.eval())
    return made[0], made[1]


def codes(frames: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 2048, (1, frames, 16), generator=torch.Generator().manual_seed(seed))


def chunked(vocoder: Vocoder, c: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    state, pieces, at = vocoder.new_state(), [], 0
    for size in sizes:
        pieces.append(vocoder.decode_chunk(c[:, at : at + size], state))
        at += size
    return torch.cat(pieces, dim=-1)


def test_int8_vocoder_has_the_same_bits_whatever_the_chunking_and_threads(pair):
    _, int8 = pair
    c = codes(40, seed=3)
    offline = int8(c)
    rng = np.random.default_rng(0)
    random_sizes = []
    while sum(random_sizes) < 40:
        random_sizes.append(int(rng.integers(1, 9)))
    random_sizes[-1] -= sum(random_sizes) - 40
    for threads in (1, 2):
        torch.set_num_threads(threads)
        try:
            for sizes in ([1] * 40, [3] * 13 + [1], [7, 1, 32], random_sizes):
                assert torch.equal(chunked(int8, c, sizes), offline), (threads, sizes)
        finally:
            torch.set_num_threads(1)


def test_int8_vocoder_stays_close_to_float32(pair):
    float32, int8 = pair
    c = codes(24, seed=5)
    want, got = float32(c), int8(c)
    assert not torch.equal(got, want)  # the integer products are in use
    snr = 10 * torch.log10(want.pow(2).mean() / (got - want).pow(2).mean())
    assert snr >= SNR_FLOOR_DB, float(snr)


def test_int8_vocoder_layers(pair):
    """The layer plan (kazeia/vocoder.py's `prepare`): int8 products for the residual units of the
    blocks after the first; bfloat16 pairs for the first block's and for the later blocks'
    transposed convolutions where the build has them (else float32); bfloat16 weights for the
    transformer's and ConvNeXt's linears; float32 elsewhere, as in the float32 vocoder."""
    float32, int8 = pair
    assert all(m.format == FLOAT32 for m in float32.modules() if isinstance(m, Tiled))
    first, later = int8.decoder[1], int8.decoder[2:-2]
    units = [m for m in later.modules() if hasattr(m, "native") and isinstance(m.native, Tiled8)]
    assert len(units) == 6 * len(later)  # two convolutions in each of three units a block
    linears = [m.tiled for m in int8.modules() if isinstance(m, TiledLinear)]
    assert len(linears) > 0 and all(t.format == NARROW_BF16 for t in linears)
    pairs = PAIRS_BF16 if native.library().vconv_pairs(2) else FLOAT32
    unit_convs = [conv.native for unit in first.block[2:] for conv in (unit.conv1, unit.conv2)]
    transposed = [block.block[1].native for block in later]
    assert len(unit_convs) == 6 and len(transposed) == len(later) > 0
    assert all(t.format == pairs for t in unit_convs + transposed)
    paired = unit_convs + transposed
    others = [m for m in int8.modules() if isinstance(m, Tiled) and not any(m is t for t in linears + paired)]
    assert len(others) > 0 and all(t.format == FLOAT32 for t in others)


def test_engine_takes_the_int8_vocoder(tiny_checkpoints, engines):
    path = tiny_checkpoints["0.6B-custom"]
    engine = Engine.load(path, vocoder_dtype="int8")
    kinds = {type(m.native).__name__ for m in engine.vocoder.modules() if hasattr(m, "native")}
    assert kinds == {"Tiled", "Tiled8"}
    options = dict(voice="serena", seed=1, max_new_tokens=6)
    speech, exact = (
        engine.synthesize("Hello there.", **options),
        engines["0.6B-custom"].synthesize("Hello there.", **options),
    )
    np.testing.assert_array_equal(speech.codes, exact.codes)  # the vocoder never changes generation
    assert torch.equal(engine.vocoder(torch.from_numpy(speech.codes)), torch.from_numpy(speech.audio))
    assert not np.array_equal(speech.audio, exact.audio)
    with pytest.raises(ValueError, match="vocoder_dtype 'int9'"):
        Engine.load(path, vocoder_dtype="int9")
