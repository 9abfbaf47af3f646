"""The vocoder: parity with the reference decoder, streaming == offline, loading, weight scales, input
checks, each convolution against PyTorch's. Chunk invariance bit for bit: tests/test_vocoder_chunks.py."""

from __future__ import annotations

import contextlib
import itertools
import json
import pathlib

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import load_reference
from safetensors.torch import save_file

from kazeia import native
from kazeia.checkpoint import assign
from kazeia.config import CheckpointError, VocoderConfig
from kazeia.conv import Depthwise, SnakeBeta, Tiled, TiledLinear, TimeMajorConv, TimeMajorTransConv
from kazeia.matmul import PackedLinear, can_pack
from kazeia.testing.vocoder import random_vocoder_tensors, tiny_speech_tokenizer_config
from kazeia.vocoder import Vocoder, vocoder_tensors

FILES = pathlib.Path(__file__).resolve().parent.parent / "kazeia" / "reference_files"
REAL_CONFIG = FILES / "Qwen3-TTS-12Hz-0.6B-CustomVoice" / "speech_tokenizer" / "config.json"
TOL = 1e-5  # float32 max-abs difference on audio in [-1, 1]


class Setup:
    """One decoder config, its random released tensors, our vocoder and (lazily) the reference decoder."""

    def __init__(self, config: dict, root: pathlib.Path, seed: int = 0):
        self.config = config
        root.mkdir(parents=True, exist_ok=True)
        (root / "config.json").write_text(json.dumps(config))
        self.root = root
        self.cfg = VocoderConfig.from_file(root / "config.json")
        self.tensors = random_vocoder_tensors(self.cfg, torch.Generator().manual_seed(seed))
        self.vocoder = self.build()
        self._reference = None

    def build(self, dtype: torch.dtype = torch.float32) -> Vocoder:
        """Our vocoder of these tensors in `dtype`, as `Vocoder.load` leaves it (native where the
        library is there; tests monkeypatch `native.library` for the eager one)."""
        with torch.device("meta"):
            vocoder = Vocoder(self.cfg)
        assign(vocoder, vocoder_tensors(self.tensors), where="random", device="cpu", dtype=dtype)
        vocoder.prepare("cpu", dtype)
        return vocoder.eval()

    @property
    def reference(self):
        if self._reference is None:
            load_reference()
            from qwen_tts.core.tokenizer_12hz import configuration_qwen3_tts_tokenizer_v2 as C
            from qwen_tts.core.tokenizer_12hz import modeling_qwen3_tts_tokenizer_v2 as M
            from transformers.modeling_utils import no_init_weights

            with no_init_weights():
                ref = M.Qwen3TTSTokenizerV2Decoder(C.Qwen3TTSTokenizerV2DecoderConfig(**self.config["decoder_config"]))
            ref.load_state_dict({k.removeprefix("decoder."): v for k, v in self.tensors.items()}, strict=True)
            self._reference = ref.eval()
        return self._reference

    def codes(self, batch: int, frames: int, seed: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed)
        return torch.randint(0, self.cfg.codebook_size, (batch, frames, self.cfg.num_quantizers), generator=gen)

    def reference_decode(self, codes: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.reference(codes.transpose(1, 2))[:, 0]  # (B, T*1920)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Setup:
    real = json.loads(REAL_CONFIG.read_text())
    return Setup(tiny_speech_tokenizer_config(real), tmp_path_factory.mktemp("tiny_vocoder"))


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return (a - b).abs().max().item()


def close_or_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bits where the vocoder runs natively (any chunking gives the offline audio), else within TOL."""
    return torch.equal(a, b) if native.library() is not None else max_diff(a, b) <= TOL


def check_audible(audio: torch.Tensor) -> None:
    rms = audio.pow(2).mean().sqrt().item()
    clipped = (audio.abs() >= 1.0).float().mean().item()
    assert 0.02 < rms < 0.5, rms
    assert clipped < 0.01, clipped
    assert audio.std(dim=-1).min().item() > 0.01  # not constant or silent in any row


@pytest.mark.parametrize("batch, frames", [(1, 23), (2, 37)])
def test_matches_reference_full_decode(tiny: Setup, batch: int, frames: int):
    codes = tiny.codes(batch, frames, seed=frames)
    audio = tiny.vocoder(codes)
    assert audio.shape == (batch, frames * 1920)
    assert max_diff(audio, tiny.reference_decode(codes)) <= TOL


def test_matches_reference_beyond_offline_block(tiny: Setup):
    codes = tiny.codes(1, 310, seed=3)  # forward decodes 300 + 10 frames on one state
    assert max_diff(tiny.vocoder(codes), tiny.reference_decode(codes)) <= TOL


@pytest.mark.slow
def test_real_size_matches_reference(tmp_path):
    real = Setup(json.loads(REAL_CONFIG.read_text()), tmp_path)
    codes = real.codes(1, 3, seed=1)
    audio = real.vocoder(codes)
    assert max_diff(audio, real.reference_decode(codes)) <= TOL
    check_audible(audio)


@settings(max_examples=8, deadline=None)
@given(
    frames=st.integers(90, 160),
    sizes=st.lists(st.integers(1, 48), min_size=1, max_size=12),
    seed=st.integers(0, 2**16),
)
def test_streaming_equals_offline(tiny: Setup, frames: int, sizes: list[int], seed: int):
    codes = tiny.codes(1, frames, seed)
    state = tiny.vocoder.new_state(1)
    pieces, start, i = [], 0, 0
    while start < frames:
        n = sizes[i % len(sizes)]
        piece = tiny.vocoder.decode_chunk(codes[:, start : start + n], state)
        assert piece.shape == (1, min(n, frames - start) * 1920)
        pieces.append(piece)
        start, i = start + n, i + 1
    assert state.position == frames
    assert close_or_equal(torch.cat(pieces, dim=-1), tiny.vocoder(codes))


def test_streaming_long_batch_and_constant_state(tiny: Setup):
    codes = tiny.codes(2, 330, seed=5)
    state = tiny.vocoder.new_state(2)
    shapes = [t.shape for t in state.tails] + [c.k.shape for c in state.caches]
    bounds = [0, 1, 8, 8, 80, 240, 330]  # includes an empty chunk
    pieces = [tiny.vocoder.decode_chunk(codes[:, a:b], state) for a, b in itertools.pairwise(bounds)]
    assert [t.shape for t in state.tails] + [c.k.shape for c in state.caches] == shapes
    assert close_or_equal(torch.cat(pieces, dim=-1), tiny.vocoder(codes))


def test_a_chunk_pauses_between_its_stages_and_its_audio_does_not_change(tiny: Setup):
    """`pause` is called between the decoder's stages, once a stage, whatever it does meanwhile
    (here: another stream decodes), and the audio is the chunk's own."""
    codes, other = tiny.codes(1, 6, seed=3), tiny.codes(1, 24, seed=4)
    alone = tiny.vocoder.decode_chunk(codes, tiny.vocoder.new_state(1))
    interloper = tiny.vocoder.new_state(1)
    calls = []

    def pause() -> None:
        calls.append(len(calls))
        tiny.vocoder.decode_chunk(other[:, len(calls) - 1 : len(calls)], interloper)

    paused = tiny.vocoder.decode_chunk(codes, tiny.vocoder.new_state(1), pause)
    assert torch.equal(paused, alone)
    blocks = len(tiny.cfg.upsample_rates)
    assert len(calls) == len(tiny.cfg.upsampling_ratios) + 1 + blocks * 4  # each stage after the transformer


def test_reference_chunked_decode(tiny: Setup):
    vocoder, spf = tiny.vocoder, tiny.cfg.samples_per_frame
    short = tiny.codes(1, 120, seed=7)
    assert max_diff(vocoder.decode_reference_chunked(short), vocoder(short)) <= TOL
    codes = tiny.codes(1, 330, seed=8)
    chunked, full = vocoder.decode_reference_chunked(codes), vocoder(codes)
    with torch.no_grad():
        official = tiny.reference.chunked_decode(codes.transpose(1, 2))[:, 0]
    assert max_diff(chunked, official) <= TOL
    assert max_diff(chunked[:, : 300 * spf], full[:, : 300 * spf]) <= TOL
    assert max_diff(chunked[:, 300 * spf :], full[:, 300 * spf :]) > 1e-4


def test_random_weights_give_audible_audio(tiny: Setup):
    check_audible(tiny.vocoder(tiny.codes(2, 40, seed=11)))


def test_random_tensors_are_deterministic(tiny: Setup):
    again = random_vocoder_tensors(tiny.cfg, torch.Generator().manual_seed(0))
    other = random_vocoder_tensors(tiny.cfg, torch.Generator().manual_seed(1))
    assert again.keys() == tiny.tensors.keys()
    assert all(torch.equal(again[k], tiny.tensors[k]) for k in again)
    assert not torch.equal(other["decoder.pre_conv.conv.weight"], tiny.tensors["decoder.pre_conv.conv.weight"])
    assert all(k.startswith("decoder.") and v.dtype == torch.float32 for k, v in again.items())


def test_load_from_released_layout(tiny: Setup, tmp_path):
    encoder_name = "encoder.quantizer.semantic_residual_vector_quantizer.input_proj.weight"
    tensors = {**tiny.tensors, encoder_name: torch.ones(2)}
    (tmp_path / "config.json").write_text(json.dumps(tiny.config))
    save_file(tensors, str(tmp_path / "model.safetensors"))
    loaded = Vocoder.load(tmp_path)
    codes = tiny.codes(1, 5, seed=2)
    assert torch.equal(loaded(codes), tiny.vocoder(codes))
    assert max_diff(loaded(codes), tiny.reference_decode(codes)) <= TOL


def test_native_vocoder_runs_every_layer_natively(tiny: Setup):
    """Loaded on the CPU with the native library, every product is a `Tiled` one (each conv and
    transposed conv, the codebooks' projection, every linear), the depthwise convs, norms and
    activations native too, all in float32; only the pre-conv keeps its original weight."""
    if native.library() is None:
        pytest.skip("no native library here")
    vocoder, lib = tiny.vocoder, native.library()
    convs = [m for m in vocoder.modules() if isinstance(m, (TimeMajorConv, TimeMajorTransConv))]
    assert len(convs) == 2 + 2 + len(tiny.cfg.upsample_rates) * (1 + 3 * 2) + 1
    assert all(isinstance(m.native, Tiled) for m in convs)
    assert [m.conv.weight is not None for m in convs] == [m is vocoder.pre_conv for m in convs]
    linears = [m for m in vocoder.modules() if isinstance(m, TiledLinear)]
    assert len(linears) == 4 * tiny.cfg.num_layers + 2 + 2 * 2  # qkv, o, gate/up, down; in/out; ConvNeXt's
    assert not any(isinstance(m, torch.nn.Linear) for m in vocoder.modules())
    assert all(m.lib is lib for m in vocoder.modules() if isinstance(m, (SnakeBeta, Depthwise)))
    assert all(q.native is not None for q in (vocoder.quantizer.rvq_first, vocoder.quantizer.rvq_rest))
    assert all(t.dtype == torch.float32 for t in [*vocoder.parameters(), *vocoder.buffers()] if t.is_floating_point())


def test_missing_codebook_tensor_is_named(tiny: Setup):
    name = "decoder.quantizer.rvq_rest.vq.layers.14._codebook.cluster_usage"
    tensors = {k: v for k, v in tiny.tensors.items() if k != name}
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        vocoder_tensors(tensors)


@pytest.mark.parametrize(
    "codes, message",
    [
        (torch.full((1, 4, 16), -1), "0..2047"),
        (torch.full((1, 4, 16), 2048), "0..2047"),
        (torch.zeros(1, 4, 15, dtype=torch.long), r"\(B, T, 16\)"),
        (torch.zeros(1, 1, 4, 16, dtype=torch.long), r"\(B, T, 16\)"),
        (torch.zeros(4, 16), "integer"),
    ],
)
def test_bad_codes_are_rejected(tiny: Setup, codes: torch.Tensor, message: str):
    with pytest.raises(ValueError, match=message):
        tiny.vocoder(codes)
    with pytest.raises(ValueError, match=message):
        tiny.vocoder.decode_chunk(codes, tiny.vocoder.new_state(1))


def test_unbatched_codes_and_state_batch(tiny: Setup):
    codes = tiny.codes(1, 6, seed=4)
    assert torch.equal(tiny.vocoder(codes[0]), tiny.vocoder(codes)[0])
    with pytest.raises(ValueError, match="batch"):
        tiny.vocoder.decode_chunk(codes, tiny.vocoder.new_state(2))


@contextlib.contextmanager
def eager_vocoder():
    """Vocoders prepared inside are eager PyTorch (as without the native library)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(native, "library", lambda: None)
        yield


def native_or_skip():
    lib = native.library()
    if lib is None:
        pytest.skip("no native library here")
    return lib


def randomize(module: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / 4)


@pytest.mark.parametrize("positions", [1, 40, 300])
@pytest.mark.parametrize("native_path", [False, True])
def test_decoder_transposed_conv_is_conv_transpose1d(positions: int, native_path: bool):
    """`TimeMajorTransConv` in its polyphase form, eager and native, gives PyTorch's ConvTranspose1d,
    trimmed as the reference trims it, over the carried input and the new ones; the carried input
    moves on."""
    up = TimeMajorTransConv(12, 8, 6, 3)
    up.slot = 0
    randomize(up, 0)
    weight, bias = up.conv.weight.detach().clone(), up.conv.bias.detach().clone()
    if native_path:
        up.use_native(native_or_skip())
        assert up.conv.weight is None
    gen = torch.Generator().manual_seed(1)
    tail, x = torch.randn(1, up.keep, 12, generator=gen), torch.randn(1, positions, 12, generator=gen)  # time-major
    tails = [tail.clone()]
    with torch.no_grad():
        got = up(x, tails)
        full = F.conv_transpose1d(torch.cat((tail, x), 1).transpose(1, 2), weight, bias, stride=3)
    expected = full[..., 3 * up.keep : 3 * (up.keep + positions)].transpose(1, 2)  # (1, 3L, 8)
    assert got.shape == (1, 3 * positions, 8)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(tails[0], x[:, -up.keep :])


def test_eager_vocoder_matches_the_reference_and_the_native_one(tiny: Setup):
    """Without the native library the vocoder runs in PyTorch (its convs, attention, norms,
    SnakeBeta), within TOL of the reference and of the native vocoder."""
    codes = tiny.codes(1, 12, seed=9)
    with eager_vocoder():
        eager = tiny.build()
    assert not any(isinstance(m, (Tiled, TiledLinear)) for m in eager.modules())
    assert all(m.lib is None for m in eager.modules() if isinstance(m, SnakeBeta))
    packed = [m for m in eager.modules() if isinstance(m, PackedLinear)]  # oneDNN's, as the talker's
    assert len(packed) == (4 * tiny.cfg.num_layers + 2 + 2 * 2 if can_pack(torch.float32) else 0)
    audio = eager(codes)
    assert max_diff(audio, tiny.reference_decode(codes)) <= TOL
    assert max_diff(audio, tiny.vocoder(codes)) <= TOL


def test_eager_decoder_conv_weights_are_kept_in_the_layout_their_convs_read(tiny: Setup, tmp_path):
    """Loaded eager, every time-major conv's weight is laid out (C_out, k, C_in), which the conv
    reads without a per-call copy, with the released shape and values."""
    (tmp_path / "config.json").write_text(json.dumps(tiny.config))
    save_file(tiny.tensors, str(tmp_path / "model.safetensors"))
    with eager_vocoder():
        loaded = Vocoder.load(tmp_path)
    convs = [m for m in loaded.modules() if isinstance(m, TimeMajorConv)]
    assert len(convs) == 1 + 1 + 3 * 2 * len(tiny.cfg.upsample_rates) + 1
    for name, module in loaded.named_modules():
        if isinstance(module, TimeMajorConv):
            weight = module.conv.weight
            assert weight.unsqueeze(2).is_contiguous(memory_format=torch.channels_last), name
            assert torch.equal(weight, tiny.tensors[f"decoder.{name}.conv.weight"]), name


@pytest.mark.parametrize("kernel, dilation", [(7, 2), (1, 1), (3, 1)])
@pytest.mark.parametrize("batch, positions", [(1, 1), (2, 5), (1, 300)])
@pytest.mark.parametrize("native_path", [False, True])
def test_decoder_conv_is_conv1d(kernel: int, dilation: int, batch: int, positions: int, native_path: bool):
    """`TimeMajorConv`, eager and native, gives PyTorch's causal Conv1d over the carried and new
    inputs, plus a residual when given; the carried input moves on."""
    conv = TimeMajorConv(24, 40, kernel, dilation=dilation)
    conv.slot = 0
    randomize(conv, 2)
    conv.store_for_reading()
    weight, bias = conv.conv.weight.detach().clone(), conv.conv.bias.detach().clone()
    if native_path:
        conv.use_native(native_or_skip())
        assert conv.conv.weight is None and conv.shape == (24, 40, kernel)
    gen = torch.Generator().manual_seed(3)
    tail, x = torch.randn(batch, conv.keep, 24, generator=gen), torch.randn(batch, positions, 24, generator=gen)
    res = torch.randn(batch, positions, 40, generator=gen)
    tails = [tail.clone()]
    with torch.no_grad():
        got = conv(x, tails, res=res)
        expected = F.conv1d(torch.cat((tail, x), 1).transpose(1, 2), weight, bias, dilation=dilation)
    torch.testing.assert_close(got, expected.transpose(1, 2) + res, rtol=1e-5, atol=1e-5)
    if conv.keep:
        assert torch.equal(tails[0], torch.cat((tail, x), 1)[:, -conv.keep :])


@pytest.mark.parametrize("native_path", [False, True])
def test_depthwise_conv_is_grouped_conv1d(native_path: bool):
    conv = Depthwise(20, 7)
    conv.slot = 0
    randomize(conv, 4)
    if native_path:
        conv.use_native(native_or_skip())
    gen = torch.Generator().manual_seed(5)
    tail, x = torch.randn(2, conv.keep, 20, generator=gen), torch.randn(2, 9, 20, generator=gen)
    tails = [tail.clone()]
    with torch.no_grad():
        got = conv(x, tails)
        expected = F.conv1d(torch.cat((tail, x), 1).transpose(1, 2), conv.conv.weight, conv.conv.bias, groups=20)
    torch.testing.assert_close(got, expected.transpose(1, 2), rtol=1e-5, atol=1e-5)
    assert torch.equal(tails[0], x[:, -conv.keep :])
