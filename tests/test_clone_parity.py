"""Voice cloning against the reference (qwen-tts 0.1.1) on the same random Base checkpoints.

The reference audio is real speech from espeak-ng at 22050 Hz, so both sides resample it to
24 kHz (the reference with librosa, Kazeia with soxr directly). Checked: the speech-tokenizer codes
are identical, the x-vectors agree within 1e-4, and greedy generation gives identical codes and
audio within 1e-4, with the reference part cut off at the same sample, in ICL and x-vector-only
mode and both text layouts, for 0.6B-like and 1.7B-like checkpoints.
"""

import numpy as np
import pytest
import torch
from clone_support import espeak, frames_at_24k
from reference import load_reference, run_reference

from kazeia import Engine
from kazeia.audio import load_reference_audio

LONG, SHORT = 59000, 26460  # reference samples at 22050 Hz: 34 and 15 code frames at 24 kHz
LONG_TEXT = "Hello, this is a reference voice for cloning."
SHORT_TEXT = "Hello there."
TARGET = "The quick brown fox jumps over the lazy dog."
LONG_TARGET = "The quick brown fox jumps over the lazy dog, then runs far away into the green forest."


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    root = tmp_path_factory.mktemp("refs")
    return {
        "long": espeak(root / "long.wav", LONG_TEXT, "en", LONG),
        "short": espeak(root / "short.wav", SHORT_TEXT, "en", SHORT),
        "other": espeak(root / "other.wav", "Bonjour, je suis une autre voix.", "fr+f3", LONG),
    }


@pytest.fixture(scope="module")
def reference(tiny_checkpoints):
    qwen_tts = load_reference()
    torch.manual_seed(0)
    return {
        name: qwen_tts.Qwen3TTSModel.from_pretrained(str(tiny_checkpoints[name]), dtype=torch.float32)
        for name in ("0.6B-base", "1.7B-base")
    }


@pytest.fixture(scope="module")
def clone_engines(tiny_checkpoints):
    names = ("0.6B-base", "1.7B-base")
    return {name: Engine.load(tiny_checkpoints[name], tokenizer_regex="reference-local") for name in names}


@pytest.mark.parametrize("name", ["0.6B-base", "1.7B-base"])
def test_encoder_codes_and_x_vectors_match_the_reference(reference, clone_engines, refs, name):
    engine, vectors = clone_engines[name], []
    for key in ("long", "other"):
        item = reference[name].create_voice_clone_prompt(str(refs[key]), ref_text=LONG_TEXT)[0]
        voice = engine.create_voice(refs[key], ref_text=LONG_TEXT)
        assert voice.ref_codes.shape == (frames_at_24k(LONG), 16)
        np.testing.assert_array_equal(voice.ref_codes.numpy(), item.ref_code.numpy())
        assert torch.max(torch.abs(voice.x_vector - item.ref_spk_embedding)) <= 1e-4
        # The random encoders behave: codes vary in every codebook, x-vectors have a sane scale.
        assert min(len(set(voice.ref_codes[:, q].tolist())) for q in range(16)) >= 10
        assert 0.3 < float(voice.x_vector.pow(2).mean().sqrt()) < 3
        vectors.append(voice.x_vector)
    cosine = torch.nn.functional.cosine_similarity(vectors[0], vectors[1], dim=0)
    assert cosine < 0.98, "two different speakers should give clearly different x-vectors"


def _run_reference(ref, options, **kwargs):
    return run_reference(ref, "generate_voice_clone", options, **kwargs)


# (checkpoint, reference audio, ICL?, non_streaming_mode, target text, language, max_new_tokens)
CASES = [
    ("0.6B-base", "long", True, False, TARGET, "English", 23),  # 34 + 22 frames: the cut keeps 1 reference sample
    ("0.6B-base", "long", True, True, TARGET, "English", 24),
    ("0.6B-base", "short", True, False, LONG_TARGET, "English", 24),  # text track longer than the codec track
    ("0.6B-base", "long", False, False, TARGET, "French", 24),
    ("1.7B-base", "long", True, False, TARGET, "English", 24),
    ("1.7B-base", "short", True, True, LONG_TARGET, "Auto", 24),
    ("1.7B-base", "short", True, False, LONG_TARGET, "Auto", 24),
    ("1.7B-base", "other", False, True, TARGET, "English", 24),
]


@pytest.mark.parametrize("name,ref_key,icl,layout,text,language,limit", CASES, ids=[f"case{i}" for i in range(8)])
def test_greedy_clone_parity(reference, clone_engines, refs, name, ref_key, icl, layout, text, language, limit):
    greedy = dict(do_sample=False, subtalker_dosample=False, max_new_tokens=limit)
    ref_text = (LONG_TEXT if ref_key != "short" else SHORT_TEXT) if icl else None
    ref_codes, ref_wav = _run_reference(
        reference[name],
        greedy,
        text=text,
        language=language,
        ref_audio=str(refs[ref_key]),
        ref_text=ref_text,
        x_vector_only_mode=not icl,
        non_streaming_mode=layout,
    )
    voice = clone_engines[name].create_voice(refs[ref_key], ref_text=ref_text, x_vector_only=not icl)
    speech = clone_engines[name].synthesize(text, voice=voice, language=language, non_streaming_mode=layout, **greedy)
    np.testing.assert_array_equal(speech.codes, ref_codes)
    assert len(ref_codes) == limit - 1, "the random checkpoint should not stop early"
    assert speech.audio.shape == ref_wav.shape
    assert np.max(np.abs(speech.audio - ref_wav)) <= 1e-4
    assert np.sqrt(np.mean(ref_wav**2)) > 1e-3
    kept = len(ref_wav) - 1920 * len(ref_codes)  # reference samples the reference's cut leaves in front
    assert kept == (1 if (icl and voice.ref_frames == 34 and len(ref_codes) == 22) else 0)


def test_sampled_icl_parity_with_the_same_seed(reference, clone_engines, refs):
    """The reference samples from the global CPU RNG, seeded with the seed that drives the engine."""
    options = dict(max_new_tokens=20, temperature=0.8, top_k=30, subtalker_temperature=0.7, subtalker_top_k=40)
    audio, rate = load_reference_audio(refs["long"], 22050), 22050  # an (array, sample_rate) reference
    torch.manual_seed(5)
    ref_codes, ref_wav = _run_reference(
        reference["0.6B-base"], options, text=TARGET, language="English", ref_audio=(audio, rate), ref_text=LONG_TEXT
    )
    voice = clone_engines["0.6B-base"].create_voice((audio, rate), ref_text=LONG_TEXT)
    speech = clone_engines["0.6B-base"].synthesize(TARGET, voice=voice, language="English", seed=5, **options)
    np.testing.assert_array_equal(speech.codes, ref_codes)
    assert np.max(np.abs(speech.audio - ref_wav)) <= 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("size", ["0.6B", "1.7B"])
def test_real_size_encoders_match_the_reference(refs, tmp_path, size):
    """At the released dimensions: identical codes, x-vectors within 1e-4 (a few GB of RAM, ~1 min)."""
    import json
    import shutil

    load_reference()  # registers stand-ins for the reference's unused audio deps before its imports
    from qwen_tts.core.models.configuration_qwen3_tts import Qwen3TTSSpeakerEncoderConfig
    from qwen_tts.core.models.modeling_qwen3_tts import Qwen3TTSSpeakerEncoder, mel_spectrogram
    from qwen_tts.inference.qwen3_tts_tokenizer import Qwen3TTSTokenizer
    from safetensors.torch import save_file

    from kazeia.config import SpeakerEncoderConfig
    from kazeia.encoder import Encoder
    from kazeia.speaker import SpeakerEncoder
    from kazeia.testing import CHECKPOINTS, FILES, model_config
    from kazeia.testing.clone import encoder_tensors, speaker_tensors

    source = FILES / CHECKPOINTS[(size, "base")] / "speech_tokenizer"
    for name in ("config.json", "preprocessor_config.json"):
        shutil.copyfile(source / name, tmp_path / name)
    codec = encoder_tensors(json.loads((source / "config.json").read_text()), torch.Generator().manual_seed(1))
    save_file(codec, tmp_path / "model.safetensors")
    cfg = model_config(size, "base", tiny=False)
    speaker = speaker_tensors(cfg, torch.Generator().manual_seed(2))
    (tmp_path / "talker.json").write_text(json.dumps(cfg))
    save_file(speaker, tmp_path / "speaker.safetensors")
    ours_codec = Encoder.load(tmp_path)
    ours_speaker = SpeakerEncoder.load(
        SpeakerEncoderConfig.from_file(tmp_path / "talker.json"), tmp_path / "speaker.safetensors"
    )
    torch.manual_seed(0)
    ref_codec = Qwen3TTSTokenizer.from_pretrained(str(tmp_path), dtype=torch.float32)
    ref_speaker = Qwen3TTSSpeakerEncoder(Qwen3TTSSpeakerEncoderConfig(**cfg["speaker_encoder_config"])).eval()
    ref_speaker.load_state_dict({k.removeprefix("speaker_encoder."): v for k, v in speaker.items()})
    for key in ("long", "other"):
        audio = torch.from_numpy(load_reference_audio(refs[key]))[None]
        np.testing.assert_array_equal(
            ours_codec(audio)[0].numpy(), ref_codec.encode(str(refs[key])).audio_codes[0].numpy()
        )
        with torch.inference_mode():
            mel = mel_spectrogram(audio, 1024, 128, 24000, 256, 1024, 0, 12000).transpose(1, 2)
            assert torch.max(torch.abs(ours_speaker(audio) - ref_speaker(mel))) <= 1e-4
