"""Engine behaviour on tiny random checkpoints: determinism, independence, options, bad input."""

import os
import random

import numpy as np
import pytest
import torch

from kazeia import Engine, RequestError, SamplingOptions
from kazeia.frame import voiced_cache, voiced_key
from kazeia.lru import LRU
from kazeia.prompt import build_prompt

SHORT = dict(max_new_tokens=12)


def test_same_seed_same_bytes_different_seed_different_codes(engines):
    engine = engines["0.6B-custom"]
    a = engine.synthesize("Hello world.", voice="serena", language="english", seed=7, **SHORT)
    b = engine.synthesize("Hello world.", voice="serena", language="english", seed=7, **SHORT)
    c = engine.synthesize("Hello world.", voice="serena", language="english", seed=8, **SHORT)
    assert a.audio.tobytes() == b.audio.tobytes()
    assert np.array_equal(a.codes, b.codes)
    assert a.metrics.seed == 7
    assert not np.array_equal(a.codes[: len(c.codes)], c.codes[: len(a.codes)])


def test_calls_are_independent(engines):
    engine = engines["0.6B-custom"]
    first = engine.synthesize("One two three.", voice="ryan", seed=1, **SHORT)
    engine.synthesize("Something else entirely, much longer than before.", voice="vivian", seed=2, max_new_tokens=30)
    engines["1.7B-custom"].synthesize("Other engine.", voice="aiden", seed=3, **SHORT)
    again = engine.synthesize("One two three.", voice="ryan", seed=1, **SHORT)
    assert first.audio.tobytes() == again.audio.tobytes()


@pytest.mark.parametrize(
    "name,kwargs",
    [
        ("0.6B-custom", dict(voice="serena", language="english")),
        ("0.6B-custom", dict(voice="ryan", non_streaming_mode=False)),
        ("1.7B-custom", dict(voice="vivian", language="English", instruct="Speak with excitement.")),
        ("1.7B-design", dict(instruct="A deep, calm male voice.", language="English")),
    ],
)
def test_a_voices_prompt_positions_are_kept_and_give_the_same_bits(engines, name, kwargs):
    """Two texts in one voice share their prompts' voice positions (Prompt.voiced: instruct, role,
    control, speaker) and differ right after. The talker's keys and values there, kept from the
    first prompt, give the second the same cache and first codes, bit for bit, as computing them."""
    engine = engines[name]
    jobs = []
    for text in ("Hello world.", "Something else entirely."):
        request = engine.request(text, seed=3, do_sample=True, max_new_tokens=8, **kwargs)
        part = request.parts[0]
        prompt = build_prompt(engine.model, part.text_ids, request.cond, request.non_streaming_mode)
        jobs.append((prompt, request.sampling, part.seed))
    first, second = jobs[0][0], jobs[1][0]
    n = second.voiced
    assert 0 < n == first.voiced < second.embeds.shape[1]
    assert torch.equal(first.embeds[:, :n], second.embeds[:, :n])
    assert not torch.equal(first.embeds[:, n], second.embeds[:, n])
    step = engine.runtime.step
    cache = step.voiced

    def prefill(prompt, options, seed):
        return step.prefill(prompt, options, torch.Generator().manual_seed(seed))

    with torch.inference_mode():
        cache.clear()
        computed = prefill(*jobs[1])
        cache.clear()
        prefill(*jobs[0])  # keeps the voice's positions
        assert cache.get(voiced_key(second.embeds[:, :n])) is not None
        kept = prefill(*jobs[1])
    assert torch.equal(computed[1], kept[1])
    length = second.embeds.shape[1]
    for ours, theirs in zip(kept[0].cache.layers, computed[0].cache.layers, strict=True):
        assert torch.equal(ours.k[:, :, :length], theirs.k[:, :, :length])
        assert torch.equal(ours.v[:, :, :length], theirs.v[:, :, :length])


def test_the_voiced_cache_keeps_to_its_bound_least_recently_used_first_out():
    def entry(value: float):
        layers = [(torch.full((1, 2, 3, 4), value), torch.full((1, 2, 3, 4), value))]
        return voiced_key(torch.full((1, 3, 4), value)), layers

    one = sum(k.nbytes + v.nbytes for k, v in entry(0.0)[1]) + len(entry(0.0)[0][2])
    size = voiced_cache()._size  # the voice cache's own measure of an entry
    cache = LRU(2 * one, size)
    (a, la), (b, lb), (c, lc), (d, ld) = (entry(v) for v in (1.0, 2.0, 3.0, 4.0))
    cache.put(a, la)
    cache.put(b, lb)
    assert cache.get(a) is la  # now the most recently used
    cache.put(c, lc)  # b goes
    assert cache.get(b) is None and cache.get(a) is la and cache.get(c) is lc and cache.total == 2 * one
    tiny = LRU(one - 1, size)
    tiny.put(d, ld)  # larger than the whole bound: not kept
    assert tiny.get(d) is None and tiny.total == 0


def test_global_rng_untouched(engines):
    torch_state, py_state, np_state = torch.get_rng_state(), random.getstate(), np.random.get_state()
    engines["0.6B-custom"].synthesize("Hello.", voice="serena", seed=3, **SHORT)
    assert torch.equal(torch_state, torch.get_rng_state())
    assert py_state == random.getstate()
    assert np.array_equal(np_state[1], np.random.get_state()[1])


def test_output_shapes_and_metrics(engines):
    speech = engines["1.7B-design"].synthesize("Welcome.", instruct="A warm voice.", seed=5, max_new_tokens=9)
    frames = speech.codes.shape[0]
    assert 1 <= frames <= 8  # max_new_tokens counts the final EOS/cut-off token too
    assert speech.codes.shape == (frames, 16) and speech.codes.dtype == np.int64
    assert speech.codes.min() >= 0 and speech.codes.max() < 2048
    assert speech.audio.dtype == np.float32 and speech.audio.shape == (frames * 1920,)
    assert speech.sample_rate == 24000
    m = speech.metrics
    assert m.frames == frames and m.audio_s == pytest.approx(frames * 0.08)
    assert m.rtf == pytest.approx(m.wall_s / m.audio_s)
    assert 0 < m.prefill_s <= m.generation_s <= m.wall_s
    assert m.ttfb_s == m.wall_s and m.chunks == 1  # offline: all audio arrives at the end


def test_greedy_runs_to_the_token_limit_or_eos(engines):
    speech = engines["0.6B-custom"].synthesize(
        "Count.", voice="serena", do_sample=False, subtalker_dosample=False, max_new_tokens=10
    )
    assert speech.codes.shape[0] <= 9


def test_voices_and_languages(engines):
    custom = engines["0.6B-custom"]
    expected = ["serena", "vivian", "uncle_fu", "ryan", "aiden", "ono_anna", "sohee", "eric", "dylan"]
    assert custom.voices == sorted(expected)
    assert custom.languages[0] == "auto"
    assert "beijing_dialect" not in custom.languages and "french" in custom.languages
    assert len(custom.languages) == 11
    assert engines["1.7B-design"].voices == []


def test_voice_and_language_are_case_insensitive(engines):
    engine = engines["0.6B-custom"]
    a = engine.synthesize("Hi.", voice="SERENA", language="French", seed=4, **SHORT)
    b = engine.synthesize("Hi.", voice="serena", language="french", seed=4, **SHORT)
    assert np.array_equal(a.codes, b.codes)


def test_defaults_come_from_generation_config(engines):
    d = engines["0.6B-custom"].defaults
    assert d == SamplingOptions(
        do_sample=True,
        temperature=0.9,
        top_k=50,
        top_p=1.0,
        repetition_penalty=1.05,
        max_new_tokens=8192,
        subtalker_dosample=True,
        subtalker_temperature=0.9,
        subtalker_top_k=50,
        subtalker_top_p=1.0,
    )


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_reduced_precision_loads_and_runs(tiny_checkpoints, dtype):
    engine = Engine.load(tiny_checkpoints["0.6B-custom"], dtype=dtype)
    assert engine.model.talker.codec_head.weight.dtype == getattr(torch, dtype)
    speech = engine.synthesize("Hello.", voice="serena", seed=1, **SHORT)
    assert speech.codes.shape[0] >= 1 and np.isfinite(speech.audio).all()


BAD_INPUTS = [
    ("0.6B-custom", dict(text=""), "text is empty"),
    ("0.6B-custom", dict(text="   \n\t"), "text is empty"),
    ("0.6B-custom", dict(text=None), "text must be a string"),
    ("0.6B-custom", dict(voice="nobody"), "unknown voice 'nobody'; choose one of: aiden"),
    ("0.6B-custom", dict(voice=None), "voice is required; choose one of"),
    ("0.6B-custom", dict(language="klingon"), "unknown language 'klingon'; choose one of: auto"),
    ("0.6B-custom", dict(language="beijing_dialect"), "unknown language"),
    ("0.6B-custom", dict(instruct="Be happy."), "does not support instruct"),
    ("0.6B-custom", dict(colour="blue"), "unknown option 'colour'; valid options: voice, language"),
    ("0.6B-custom", dict(temperature=0), "temperature must be a number >= 0.001"),
    ("0.6B-custom", dict(temperature=1e-300), "temperature must be a number >= 0.001"),
    ("0.6B-custom", dict(subtalker_temperature=float("inf")), "subtalker_temperature must be a number >= 0.001"),
    ("0.6B-custom", dict(repetition_penalty=1e-300), "repetition_penalty must be a number >= 0.001"),
    ("0.6B-custom", dict(text="Hello \ud800 there."), "text is not valid Unicode"),
    ("0.6B-custom", dict(max_new_tokens=40000), "max_new_tokens 40000 after a prompt of"),
    ("0.6B-custom", dict(top_p=1.5), "top_p must be a number in (0, 1]"),
    ("0.6B-custom", dict(top_k=-1), "top_k must be an integer >= 0"),
    ("0.6B-custom", dict(top_k=2.5), "top_k must be an integer >= 0"),
    ("0.6B-custom", dict(max_new_tokens=1), "max_new_tokens must be an integer >= 2"),
    ("0.6B-custom", dict(repetition_penalty=float("nan")), "repetition_penalty must be a number >= 0.001"),
    ("0.6B-custom", dict(do_sample="yes"), "do_sample must be True or False"),
    ("0.6B-custom", dict(seed=-1), "seed must be an integer"),
    ("0.6B-custom", dict(seed="7"), "seed must be an integer"),
    ("0.6B-custom", dict(non_streaming_mode="no"), "non_streaming_mode must be True or False"),
    ("1.7B-design", dict(voice=None, instruct=None), "need instruct="),
    ("1.7B-design", dict(voice=None, instruct="  "), "need instruct="),
    ("1.7B-design", dict(instruct="Calm \udfff.", voice=None), "instruct is not valid Unicode"),
    ("1.7B-design", dict(voice="serena", instruct="Calm."), "have no preset voices"),
]


# The argument each refusal is about: the one the case sets, but for the VoiceDesign cases.
FIELDS = {"need instruct=": "instruct", "have no preset voices": "voice"}


def test_stream_options_are_checked_when_made_and_refused_where_nothing_streams(engines):
    """A bad chunk schedule is a RequestError naming its field as the options are made; a schedule
    given to `synthesize`, which does not stream, is refused rather than ignored."""
    from kazeia import StreamOptions

    for fields, name in (
        (dict(chunk_frames=0), "chunk_frames"),
        (dict(first_chunk_frames=True), "first_chunk_frames"),
        (dict(chunk_frames=4, max_chunk_frames=3), "max_chunk_frames"),
    ):
        with pytest.raises(RequestError) as err:
            StreamOptions(**fields)
        assert err.value.field == name
    engine = engines["0.6B-custom"]
    with pytest.raises(RequestError, match="chunk_frames applies to streams only"):
        engine.synthesize("Hello.", StreamOptions(voice="serena", chunk_frames=3), **SHORT)
    plain = StreamOptions(voice="serena", seed=3, **SHORT)  # the stream's fields at their defaults
    assert np.array_equal(
        engine.synthesize("Hello.", plain).codes, engine.synthesize("Hello.", voice="serena", seed=3, **SHORT).codes
    )


@pytest.mark.parametrize("name,kwargs,message", BAD_INPUTS, ids=[m for _, _, m in BAD_INPUTS])
def test_bad_input_is_a_clear_value_error(engines, name, kwargs, message):
    call = dict(text="Hello.", voice="serena", **SHORT)
    call.update(kwargs)
    with pytest.raises(RequestError) as err:  # a ValueError that names its argument
        engines[name].synthesize(**call)
    assert isinstance(err.value, ValueError) and message in str(err.value)
    field = next((f for key, f in FIELDS.items() if key in message), next(iter(kwargs)))
    assert err.value.field == field


def test_bad_load_options(tiny_checkpoints):
    path = tiny_checkpoints["0.6B-custom"]
    with pytest.raises(ValueError, match="unknown dtype 'float8'; choose one of: float32, bfloat16, float16"):
        Engine.load(path, dtype="float8")
    with pytest.raises(ValueError, match="unknown device"):
        Engine.load(path, device="gpu-please")
    with pytest.raises(ValueError, match="choose"):
        Engine.load(path, tokenizer_regex="perl")


def test_offline_audio_is_one_decode_of_the_codes_made_beside_generation(engines):
    """synthesize decodes blocks while the next frames are generated; the audio is exactly the
    offline decode of all its codes (the same blocks on the same state), and the same bytes again."""
    engine = engines["0.6B-custom"]
    options = dict(voice="serena", seed=11, max_new_tokens=70)  # > 2 vocoder blocks of 32 frames
    speech = engine.synthesize("Side by side, the same audio.", **options)
    assert speech.codes.shape[0] > 64
    np.testing.assert_array_equal(speech.audio, engine.decode(torch.from_numpy(speech.codes)))
    again = engine.synthesize("Side by side, the same audio.", **options)
    assert again.audio.tobytes() == speech.audio.tobytes()


def test_each_stage_gets_half_the_cores_by_default(tiny_checkpoints):
    from kazeia.placement import stage_threads

    try:
        Engine.load(tiny_checkpoints["0.6B-custom"])
        assert torch.get_num_threads() == stage_threads() == max(1, len(os.sched_getaffinity(0)) // 2)
        Engine.load(tiny_checkpoints["0.6B-custom"], threads=3)
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(stage_threads())
