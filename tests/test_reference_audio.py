"""Reference audio for cloning: formats, mix-down, resampling, rejected input; the mel filterbank."""

import io

import librosa
import numpy as np
import pytest
import soundfile as sf
import torch
from clone_support import ESPEAK_RATE, espeak

from kazeia.audio import MIN_REFERENCE_S, load_reference_audio, resample
from kazeia.speaker import FMAX, FMIN, N_FFT, N_MELS, LogMel, mel_filterbank


@pytest.fixture(scope="module")
def speech(tmp_path_factory):
    path = espeak(tmp_path_factory.mktemp("speech") / "speech.wav", "Reference audio in every format.", "en", 44100)
    audio, rate = sf.read(path, dtype="float32")
    return path, audio, rate


def test_lossless_sources_give_the_same_audio(speech, tmp_path):
    path, audio, rate = speech
    expected = librosa.resample(audio, orig_sr=rate, target_sr=24000)  # what the reference computes
    flac = tmp_path / "speech.flac"
    sf.write(flac, audio, rate, subtype="PCM_16")
    pcm = (audio * 32768).round().astype(np.int16)
    sources = [path, str(path), flac, path.read_bytes(), io.BytesIO(path.read_bytes()), (audio, rate), (pcm, rate)]
    for source in sources:
        got = load_reference_audio(source)
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, expected)
    assert ESPEAK_RATE != 24000  # so resampling ran


@pytest.mark.parametrize("fmt,subtype", [("OGG", "VORBIS"), ("MP3", "MPEG_LAYER_III")])
def test_lossy_formats(speech, tmp_path, fmt, subtype):
    path, audio, rate = speech
    if fmt not in sf.available_formats():
        pytest.skip(f"this libsndfile cannot write {fmt}")
    lossy = tmp_path / f"speech.{fmt.lower()}"
    sf.write(lossy, audio, rate, format=fmt, subtype=subtype)
    got = load_reference_audio(lossy)
    expected = load_reference_audio(path)
    assert abs(len(got) - len(expected)) < 0.1 * 24000  # codec padding aside, the same length
    n = min(len(got), len(expected))
    rms = lambda x: float(np.sqrt(np.mean(x**2)))  # noqa: E731
    assert abs(rms(got[:n]) - rms(expected[:n])) < 0.2 * rms(expected[:n])


def test_channels_are_averaged(speech, tmp_path):
    _, audio, rate = speech
    stereo = np.stack((audio, 0.5 * audio[::-1]), axis=1)
    expected = resample(stereo.mean(axis=1).astype(np.float32), rate, 24000)
    wav = tmp_path / "stereo.wav"
    sf.write(wav, stereo, rate, subtype="FLOAT")
    np.testing.assert_array_equal(load_reference_audio(wav), expected)
    np.testing.assert_array_equal(load_reference_audio((stereo, rate)), expected)


def test_24k_audio_is_not_resampled():
    audio = (0.1 * np.sin(np.arange(30000) / 7)).astype(np.float32)
    np.testing.assert_array_equal(load_reference_audio((audio, 24000)), audio)


def test_bad_reference_audio(tmp_path):
    loud = (0.3 * np.sin(np.arange(48000) / 5)).astype(np.float32)
    empty_wav, text = tmp_path / "empty.wav", tmp_path / "notes.wav"
    sf.write(empty_wav, np.zeros(0, np.float32), 16000)
    text.write_text("this is not audio")
    short = int(MIN_REFERENCE_S * 16000) - 1
    nan = loud.copy()
    nan[100] = np.nan
    cases = [
        (tmp_path / "missing.wav", "no such file"),
        (text, "cannot read reference audio"),
        (b"RIFF garbage", "cannot read reference audio"),
        (empty_wav, "is empty"),
        ((np.zeros(0, np.float32), 16000), "is empty"),
        ((np.zeros((48000, 0), np.float32), 16000), "0 channels"),
        ((loud[:short], 16000), "too short"),
        ((np.zeros(48000, np.float32), 16000), "silent"),
        ((1e-5 * loud, 16000), "silent"),
        ((nan, 16000), "NaN or infinite"),
        ((1e20 * loud, 16000), "samples of magnitude 3e\\+19; audio samples lie in \\[-1, 1\\]"),
        ((loud, 0), "sample rate must be a positive integer"),
        ((loud, 16000.0), "sample rate must be a positive integer"),
        ((loud, True), "sample rate must be a positive integer"),
        ((loud.reshape(1, 2, -1), 16000), "must have shape"),
        ((loud.astype(np.uint8), 16000), "float or signed integer"),
        ((loud, 16000, 1), "must be \\(array, sample_rate\\)"),
        (loud, "must be a path, bytes"),
        (42, "must be a path, bytes"),
    ]
    for source, message in cases:
        with pytest.raises(ValueError, match=message):
            load_reference_audio(source)


def test_what_a_header_declares_is_bounded_before_decoding(tmp_path):
    """Audio bombs: a small file declaring a tiny rate, many channels, or a long duration is refused
    from its header (before decoding or resampling, which would take GBs); so is an array."""
    noise = np.random.default_rng(0).standard_normal(1_000_000).astype(np.float32) * 0.1
    cases = {
        "slow.wav": (noise[:500_000], 100, "declares 100 Hz; accepted: 8000 to 192000"),
        "one-hertz.wav": (noise[:200_000], 1, "declares 1 Hz"),
        "channels.wav": (np.tile(noise[:50_000, None], (1, 9)), 16000, "has 9 channels; accepted: 1 to 8"),
        "long.flac": (noise[: 61 * 16000], 16000, "is 61.0 s long; the limit is 60 s"),
    }
    for name, (audio, rate, message) in cases.items():
        path = tmp_path / name
        sf.write(path, audio, rate, subtype="PCM_16")
        for source in (path, path.read_bytes()):
            with pytest.raises(ValueError, match=message):
                load_reference_audio(source)
    with pytest.raises(ValueError, match="is 5.0 s long; the limit is 3 s"):
        load_reference_audio((noise[:80_000], 16000), max_seconds=3)
    huge = np.broadcast_to(np.float32(0.1), (59 * 192_000, 8))  # 360 MiB as float32, none allocated
    with pytest.raises(ValueError, match="would decode to 346 MiB; the limit is 64 MiB"):
        load_reference_audio((huge, 192_000))


@pytest.mark.parametrize("rate", [8000, 16000, 22050, 44100, 48000])
def test_resampling_matches_librosa(rate):
    audio = np.random.default_rng(rate).standard_normal(rate + 123).astype(np.float32) * 0.1
    expected = librosa.resample(audio, orig_sr=rate, target_sr=24000)
    np.testing.assert_array_equal(resample(audio, rate, 24000), expected)


@pytest.mark.parametrize(
    "sr,n_fft,n_mels,fmin,fmax",
    [(24000, N_FFT, N_MELS, FMIN, FMAX), (16000, 512, 80, 20.0, 7600.0), (22050, 2048, 64, 0.0, 4000.0)],
)
def test_mel_filterbank_matches_librosa(sr, n_fft, n_mels, fmin, fmax):
    ours = mel_filterbank(sr, n_fft, n_mels, fmin, fmax)
    theirs = librosa.filters.mel(sr=sr, n_fft=n_fft, n_mels=n_mels, fmin=fmin, fmax=fmax)
    assert ours.dtype == theirs.dtype == np.float32
    np.testing.assert_array_equal(ours, theirs)


def test_log_mel_matches_the_reference_front_end(speech):
    from reference import load_reference

    load_reference()
    from qwen_tts.core.models.modeling_qwen3_tts import mel_spectrogram

    audio = torch.from_numpy(load_reference_audio(speech[0]))[None]
    theirs = mel_spectrogram(
        audio, n_fft=1024, num_mels=128, sampling_rate=24000, hop_size=256, win_size=1024, fmin=0, fmax=12000
    )
    ours = LogMel(24000)(audio)
    assert ours.shape == theirs.shape == (1, 128, (audio.shape[1] + 768 - 1024) // 256 + 1)
    assert torch.max(torch.abs(ours - theirs)) <= 1e-5


def test_a_voice_never_holds_a_non_finite_embedding():
    """Made from audio or read from a file, an x-vector with NaN would make every prompt NaN."""
    from kazeia.voices import Voice, VoiceModel

    model = VoiceModel("0b6", 4, "0" * 64)
    Voice(torch.zeros(4), None, None, model)
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="NaN or infinite"):
            Voice(torch.tensor([0.0, bad, 0.0, 0.0]), None, None, model)
