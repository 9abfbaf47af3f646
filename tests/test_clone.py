"""Voice cloning in the engine: voices as objects and files, streaming, bad input, the CLI."""

import json
import shutil

import numpy as np
import pytest
import torch
from clone_support import espeak
from safetensors.torch import load_file, save_file

from kazeia import CheckpointError, Engine, Voice
from kazeia.audio import write_audio
from kazeia.cli import main
from kazeia.voices import VoiceModel, icl_cut

REF_TEXT = "Hello, this is a reference voice for cloning."
TEXT = "Streaming a cloned voice should sound exactly like offline synthesis."


@pytest.fixture(scope="module")
def ref_wav(tmp_path_factory):
    return espeak(tmp_path_factory.mktemp("ref") / "ref.wav", REF_TEXT, "en", 59000)  # 34 frames at 24 kHz


@pytest.fixture(scope="module")
def voices(engines, ref_wav):
    """name -> (ICL voice, x-vector voice) of each Base checkpoint."""
    out = {}
    for name in ("0.6B-base", "1.7B-base"):
        engine = engines[name]
        out[name] = (engine.create_voice(ref_wav, ref_text=REF_TEXT), engine.create_voice(ref_wav, x_vector_only=True))
    return out


def test_voices_are_reusable_and_deterministic(engines, voices, ref_wav):
    engine, (icl, xvec) = engines["0.6B-base"], voices["0.6B-base"]
    again = engine.create_voice(ref_wav, ref_text=REF_TEXT)
    assert torch.equal(again.ref_codes, icl.ref_codes) and torch.equal(again.x_vector, icl.x_vector)
    assert torch.equal(xvec.x_vector, icl.x_vector) and xvec.ref_codes is None and xvec.ref_text is None
    assert (icl.mode, xvec.mode, icl.ref_frames, xvec.ref_frames) == ("icl", "x_vector", 34, 0)
    a = engine.synthesize("Hello.", voice=icl, seed=3, max_new_tokens=8)
    b = engine.synthesize("Hello.", voice=icl, seed=3, max_new_tokens=8)
    c = engine.synthesize("Hello.", voice=xvec, seed=3, max_new_tokens=8)
    assert a.audio.tobytes() == b.audio.tobytes()
    assert not np.array_equal(a.codes, c.codes), "ICL and x-vector prompts differ"


@pytest.mark.parametrize("mode", [0, 1], ids=["icl", "x_vector"])
def test_saved_voice_reloads_and_speaks_identically(engines, voices, tmp_path, mode):
    engine, voice = engines["1.7B-base"], voices["1.7B-base"][mode]
    path = tmp_path / "me.voice"
    voice.save(path)
    loaded = Voice.load(path)
    assert loaded.model == voice.model and loaded.ref_text == voice.ref_text and loaded.mode == voice.mode
    assert torch.equal(loaded.x_vector, voice.x_vector)
    assert (loaded.ref_codes is None) == (voice.ref_codes is None)
    if voice.ref_codes is not None:
        assert torch.equal(loaded.ref_codes, voice.ref_codes)
    options = dict(language="english", seed=11, max_new_tokens=12)
    original = engine.synthesize("Bonjour Kazeia.", voice=voice, **options)
    for again in (loaded, path, str(path)):  # a Voice, or the path of its file
        speech = engine.synthesize("Bonjour Kazeia.", voice=again, **options)
        assert speech.audio.tobytes() == original.audio.tobytes()
        np.testing.assert_array_equal(speech.codes, original.codes)


STREAM_CASES = [  # (checkpoint, 0: ICL / 1: x-vector voice, non_streaming_mode, first chunk, later chunks)
    ("0.6B-base", 0, False, 1, 4),
    ("0.6B-base", 0, False, 3, 2),
    ("1.7B-base", 0, True, 2, 7),
    ("0.6B-base", 1, False, 1, 4),
]


@pytest.mark.parametrize("name,mode,layout,first,rest", STREAM_CASES)
def test_streaming_equals_offline(engines, voices, name, mode, layout, first, rest):
    """Streams continue the vocoder after the reference's frames and never emit reference samples."""
    engine, voice = engines[name], voices[name][mode]
    options = dict(voice=voice, seed=21, max_new_tokens=30, non_streaming_mode=layout, ignore_eos=True)
    offline = engine.synthesize(TEXT, **options)
    with engine.stream(TEXT, first_chunk_frames=first, chunk_frames=rest, **options) as stream:
        chunks = list(stream)
    np.testing.assert_array_equal(stream.codes, offline.codes)
    audio = np.concatenate([c.audio for c in chunks])
    assert len(audio) == 1920 * len(offline.codes) == sum(1920 * c.frames for c in chunks)
    assert len(offline.audio) == len(audio)  # 34 reference frames + 29: the reference's cut is exact here
    np.testing.assert_array_equal(audio, offline.audio)


def test_stream_when_the_reference_cut_keeps_a_reference_sample(engines, voices):
    """34 reference + 22 generated frames: the reference package's float cut keeps the reference's
    last sample in front of the audio. `synthesize` reproduces it; a stream cannot know the final
    length when it starts, so it starts at the first generated sample: offline audio[1:]."""
    assert icl_cut(34, 56, 56 * 1920) == 34 * 1920 - 1
    engine, voice = engines["0.6B-base"], voices["0.6B-base"][0]
    options = dict(voice=voice, do_sample=False, subtalker_dosample=False, max_new_tokens=23, ignore_eos=True)
    offline = engine.synthesize(TEXT, **options)
    assert offline.codes.shape == (22, 16) and len(offline.audio) == 22 * 1920 + 1
    full = engine.decode(torch.cat((voice.ref_codes, torch.from_numpy(offline.codes))))  # reference + generated
    np.testing.assert_array_equal(offline.audio, full[34 * 1920 - 1 :])
    chunked = engine.synthesize(TEXT, reference_chunked_decode=True, **options)
    np.testing.assert_array_equal(chunked.audio, offline.audio)
    with engine.stream(TEXT, chunk_frames=5, **options) as stream:
        audio = np.concatenate([c.audio for c in stream])
    np.testing.assert_array_equal(audio, offline.audio[1:])


def test_kazeia_say_writes_synthesizes_audio_with_the_reference_sample_it_keeps(engines, voices, tiny_checkpoints,
                                                                              tmp_path):  # fmt: skip
    """`kazeia say` (without --stream) takes its audio where `synthesize` does (`Engine.assemble`):
    34 reference + 22 generated frames, where the reference's cut keeps the reference's last sample
    in front of the audio, give the same 16-bit samples, that sample included."""
    import soundfile

    engine, voice = engines["0.6B-base"], voices["0.6B-base"][0]
    options = dict(do_sample=False, subtalker_dosample=False, max_new_tokens=23, ignore_eos=True)
    offline = engine.synthesize(TEXT, voice=voice, **options)
    assert len(offline.audio) == 22 * 1920 + 1
    voice.save(tmp_path / "me.voice")
    out = tmp_path / "say.wav"
    args = ["--model", str(tiny_checkpoints["0.6B-base"]), "--voice", str(tmp_path / "me.voice"), "-o", str(out)]
    assert main(["say", TEXT, *args, "--greedy", "--max-new-tokens", "23", "--ignore-eos"]) == 0
    write_audio(tmp_path / "synthesized.wav", offline.audio)  # the same file writer
    written, rate = soundfile.read(out, dtype="int16")
    assert rate == 24000 and np.array_equal(written, soundfile.read(tmp_path / "synthesized.wav", dtype="int16")[0])


def test_voice_from_another_checkpoint_is_rejected(engines, voices, tmp_path):
    with pytest.raises(ValueError, match=r"made with a 0b6 Base checkpoint .* this engine loaded a 1b7"):
        engines["1.7B-base"].synthesize("Hello.", voice=voices["0.6B-base"][0])
    icl = voices["0.6B-base"][0]
    other = VoiceModel(icl.model.size, icl.model.width, "0" * 64)  # same size, other speaker encoder weights
    with pytest.raises(ValueError, match="create the voice again with this checkpoint"):
        engines["0.6B-base"].synthesize("Hello.", voice=Voice(icl.x_vector, icl.ref_codes, icl.ref_text, other))
    with pytest.raises(ValueError, match="cloned voices need a Base checkpoint"):
        engines["0.6B-custom"].synthesize("Hello.", voice=icl)
    with pytest.raises(ValueError, match="voice cloning needs a Base checkpoint"):
        engines["0.6B-custom"].create_voice(tmp_path / "x.wav", ref_text="x")


def test_bad_voice_files(engines, voices, tmp_path):
    engine, voice = engines["0.6B-base"], voices["0.6B-base"][0]
    good = tmp_path / "good.voice"
    voice.save(good)
    tensors = load_file(good)
    garbage, plain, wrong = tmp_path / "garbage.voice", tmp_path / "plain.voice", tmp_path / "wrong.voice"
    garbage.write_bytes(b"not a voice at all")
    save_file(tensors, plain)
    meta = {"format": "kazeia.voice/1", "mode": "x_vector", "ref_text": None, "model": voice.model.__dict__}
    save_file(tensors, wrong, metadata={"kazeia.voice": json.dumps(meta)})  # ICL tensors, x-vector mode
    cases = [
        (tmp_path / "missing.voice", "no voice file at"),
        (garbage, "is not a Kazeia voice file"),
        (plain, "not a Kazeia voice file"),
        (wrong, "do not match mode"),
    ]
    for path, message in cases:
        with pytest.raises(ValueError, match=message):
            Voice.load(path)
        with pytest.raises(ValueError, match=message):
            engine.synthesize("Hello.", voice=path)
    with pytest.raises(ValueError, match="cannot write voice file"):
        voice.save(tmp_path / "no" / "dir" / "me.voice")


def test_bad_clone_requests(engines, voices, ref_wav):
    engine, voice = engines["0.6B-base"], voices["0.6B-base"][0]
    cases = [
        (lambda: engine.synthesize("Hello."), "pass voice= a Voice"),
        (lambda: engine.synthesize("Hello.", voice=42), "voice must be a Voice"),
        (lambda: engine.synthesize("Hello.", voice=voice, instruct="Whisper."), "Base checkpoints take no instruct"),
        (lambda: engine.synthesize("Hello.", voice=voice, language="klingon"), "unknown language"),
        (lambda: engine.create_voice(ref_wav), "ref_text, the transcript of the reference audio, is required"),
        (lambda: engine.create_voice(ref_wav, ref_text="  "), "is required"),
        (lambda: engine.create_voice(ref_wav, ref_text="Hi", x_vector_only=True), "ref_text is not used"),
        (lambda: engine.create_voice(ref_wav, ref_text="Hi", x_vector_only="yes"), "x_vector_only must be"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()
    codes = voice.ref_codes.clone()
    codes[0, 3] = 2048
    with pytest.raises(ValueError, match="codes in 0..2047"):
        engine.synthesize("Hello.", voice=Voice(voice.x_vector, codes, voice.ref_text, voice.model))
    with pytest.raises(ValueError, match="needs both ref_codes and ref_text"):
        Voice(voice.x_vector, voice.ref_codes, None, voice.model)
    with pytest.raises(ValueError, match="x_vector has 5 values"):
        Voice(torch.zeros(5), None, None, voice.model)


def test_speaker_encoder_tensors_outside_a_base_checkpoint_are_unexpected(tiny_checkpoints, tmp_path):
    root = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoints["0.6B-custom"], root)
    tensors = load_file(root / "model.safetensors")
    tensors["speaker_encoder.fc.bias"] = torch.zeros(64)
    save_file(tensors, root / "model.safetensors")
    with pytest.raises(CheckpointError, match="unexpected tensor speaker_encoder.fc.bias"):
        Engine.load(root)


@pytest.mark.parametrize("tiny", [True, False], ids=["tiny", "real"])
def test_generated_encoder_tensors_match_the_reference_module_tree(tiny):
    """`encoder.*` names and shapes written for Base checkpoints == the reference speech tokenizer's."""
    from reference import load_reference

    load_reference()
    from qwen_tts.core.tokenizer_12hz.configuration_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2Config
    from qwen_tts.core.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2Model

    from kazeia.testing import CHECKPOINTS, FILES
    from kazeia.testing.clone import encoder_tensors, tiny_encoder_config
    from kazeia.testing.vocoder import tiny_speech_tokenizer_config

    cfg = json.loads((FILES / CHECKPOINTS[("0.6B", "base")] / "speech_tokenizer" / "config.json").read_text())
    if tiny:
        cfg = tiny_encoder_config(tiny_speech_tokenizer_config(cfg))
    with torch.device("meta"):
        ref = Qwen3TTSTokenizerV2Model(Qwen3TTSTokenizerV2Config(**cfg))
    expected = {k: tuple(v.shape) for k, v in ref.state_dict().items() if k.startswith("encoder.")}
    assert {k: tuple(v.shape) for k, v in encoder_tensors(cfg, None).items()} == expected


def test_base_checkpoint_without_speaker_encoder_tensors(tiny_checkpoints, tmp_path):
    root = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoints["0.6B-base"], root)
    tensors = load_file(root / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if k != "speaker_encoder.asp.conv.bias"}, root / "model.safetensors")
    with pytest.raises(CheckpointError, match="missing tensor speaker_encoder.asp.conv.bias"):
        Engine.load(root)
    save_file({k: v for k, v in tensors.items() if not k.startswith("speaker_encoder.")}, root / "model.safetensors")
    with pytest.raises(CheckpointError, match="model.safetensors: missing tensor speaker_encoder."):
        Engine.load(root)
    save_file(tensors, root / "model.safetensors")
    codec = load_file(root / "speech_tokenizer" / "model.safetensors")
    key = "encoder.quantizer.acoustic_residual_vector_quantizer.layers.7.codebook.embed_sum"
    save_file({k: v for k, v in codec.items() if k != key}, root / "speech_tokenizer" / "model.safetensors")
    with pytest.raises(CheckpointError, match=f"missing tensor {key}"):
        Engine.load(root)
    key = "encoder.encoder_transformer.layers.1.mlp.fc2.weight"
    save_file({k: v for k, v in codec.items() if k != key}, root / "speech_tokenizer" / "model.safetensors")
    with pytest.raises(CheckpointError, match=f"missing tensor {key}"):
        Engine.load(root)


def test_cli_creates_a_voice_and_speaks_with_it(tiny_checkpoints, engines, ref_wav, tmp_path, capsys):
    model = str(tiny_checkpoints["0.6B-base"])
    voice_file, out = tmp_path / "me.voice", tmp_path / "out.wav"
    create = ["voices", "create", "--model", model, "--audio", str(ref_wav), "--text", REF_TEXT, "-o", str(voice_file)]
    assert main(create) == 0
    assert "ICL voice" in capsys.readouterr().err
    say = ["say", "Hello.", "--model", model, "--voice", str(voice_file), "--seed", "4", "--max-new-tokens", "6"]
    assert main(say + ["-o", str(out)]) == 0
    import soundfile as sf

    audio, rate = sf.read(out, dtype="float32")
    expected = engines["0.6B-base"].synthesize("Hello.", voice=voice_file, seed=4, max_new_tokens=6).audio
    assert rate == 24000 and np.max(np.abs(audio - expected)) < 1 / 16000
    assert main(["voices", "--model", model]) == 0
    assert "model type: base" in capsys.readouterr().out
    bad = [
        ["voices", "create", "--model", model, "--audio", str(ref_wav), "-o", str(tmp_path / "x.voice")],
        ["voices", "create", "--model", model, "--text", "Hi"],
        ["voices", "--model", model, "--audio", str(ref_wav)],
        ["say", "Hello.", "--model", model, "--voice", str(tmp_path / "missing.voice")],
    ]
    for argv in bad:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("kazeia: error: ") and err.count("\n") == 1, err


@pytest.mark.parametrize("non_streaming_mode", [False, True])
def test_prompt_positions_are_known_before_the_prompt_is_built(engines, voices, non_streaming_mode):
    """`prompt_positions` (what bounds a request by the model's positions) counts exactly the
    positions `build_prompt` lays out, for every kind of checkpoint, voice and layout."""
    from kazeia.prompt import build_prompt

    cases = [(engines["0.6B-base"], dict(voice=v)) for v in voices["0.6B-base"]]
    cases += [(engines["1.7B-custom"], dict(voice="eric", instruct="Slowly.", language="chinese"))]
    cases += [(engines["0.6B-custom"], dict(voice="serena")), (engines["1.7B-design"], dict(instruct="Deep."))]
    for engine, options in cases:
        request = engine.request(
            "Counting the positions, one by one.", non_streaming_mode=non_streaming_mode, **options
        )
        prompt = build_prompt(engine.model, request.text_ids, request.cond, non_streaming_mode)
        assert request.prompt_positions == prompt.embeds.shape[1], options


def test_a_voice_whose_prompt_exceeds_the_positions_is_refused(engines, voices):
    engine = engines["0.6B-base"]
    with pytest.raises(ValueError, match=r"max_new_tokens 32750 after a prompt of \d+ positions"):
        engine.synthesize("Too long.", voice=voices["0.6B-base"][0], max_new_tokens=32750)
