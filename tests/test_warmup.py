"""kazeia/warmup.py: what a warm-up runs, that it leaves every later request's bytes as they were,
and that the servers run it before their first request unless told not to."""

from __future__ import annotations

import numpy as np
import pytest

from kazeia import Engine
from kazeia.audio import write_audio
from kazeia.errors import RequestError
from kazeia.options import SynthesisOptions
from kazeia.warmup import warm_up

TEXT = "A short sentence to speak."


def _speech(engine: Engine, voice, **options) -> np.ndarray:
    return engine.synthesize(TEXT, voice=voice, seed=5, do_sample=True, max_new_tokens=10, **options).audio


def test_a_warm_up_caches_every_preset_voice_and_changes_no_later_byte(tiny_checkpoints):
    cold, warm = (Engine.load(tiny_checkpoints["0.6B-custom"]) for _ in range(2))
    assert len(warm.runtime.step.voiced) == 0
    assert warm_up(warm) == warm.voices
    assert len(warm.runtime.step.voiced) == len(warm.voices)  # one prompt-position entry per speaker
    for voice in (warm.voices[0], warm.voices[-1]):
        assert np.array_equal(_speech(warm, voice), _speech(cold, voice))
    # The cache is keyed by the voice's exact positions: a request in another language computes its own.
    before = len(warm.runtime.step.voiced)
    language = next(lang for lang in warm.languages if lang != "auto")
    voice = warm.voices[0]
    assert np.array_equal(_speech(warm, voice, language=language), _speech(cold, voice, language=language))
    assert len(warm.runtime.step.voiced) == before + 1


def test_a_warm_up_takes_the_options_voice_and_language(tiny_checkpoints):
    engine = Engine.load(tiny_checkpoints["0.6B-custom"])
    language = next(lang for lang in engine.languages if lang != "auto")
    assert warm_up(engine, SynthesisOptions(voice=engine.voices[1], language=language)) == [engine.voices[1]]
    assert len(engine.runtime.step.voiced) == 1
    with pytest.raises(RequestError, match="voice"):  # an option the engine refuses is its error, at start
        warm_up(engine, SynthesisOptions(voice="nobody-by-this-name"))


def test_a_designed_voice_is_warmed_and_a_cloned_one_only_when_given(tiny_checkpoints, tmp_path):
    design = Engine.load(tiny_checkpoints["1.7B-design"])
    assert warm_up(design) == [None]
    assert len(design.runtime.step.voiced) == 1
    base = Engine.load(tiny_checkpoints["0.6B-base"])
    assert warm_up(base) == []  # a request brings its own voice
    assert len(base.runtime.step.voiced) == 0
    reference = tmp_path / "reference.wav"
    write_audio(reference, np.random.default_rng(0).uniform(-0.3, 0.3, 24000).astype(np.float32))
    voice = base.create_voice(reference, x_vector_only=True)
    cold = _speech(Engine.load(tiny_checkpoints["0.6B-base"]), voice)
    assert warm_up(base, SynthesisOptions(voice=voice)) == [voice]
    assert len(base.runtime.step.voiced) == 1
    assert np.array_equal(_speech(base, voice), cold)


@pytest.mark.parametrize("warm", [True, False])
def test_the_http_server_warms_up_before_its_first_request_unless_told_not_to(tiny_checkpoints, warm):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from kazeia.server import ServerConfig, create_app

    engine = Engine.load(tiny_checkpoints["0.6B-custom"])
    with TestClient(create_app(engine, ServerConfig("tiny", warm_up=warm))) as client:
        assert len(engine.runtime.step.voiced) == (len(engine.voices) if warm else 0)
        assert client.get("/health").status_code == 200


def test_the_warm_up_setting_is_checked_and_flagged():
    pytest.importorskip("fastapi")
    from kazeia.cli import build_parser
    from kazeia.server import ServerConfig
    from kazeia.server.commands import server_config

    with pytest.raises(ValueError, match="warm_up must be True or False"):
        ServerConfig("m", warm_up="yes")  # type: ignore[arg-type]
    for command in ("serve", "wyoming"):
        parse = build_parser().parse_args
        assert server_config(parse([command, "--model", "m"]), None).warm_up is True
        assert server_config(parse([command, "--model", "m", "--no-warm-up"]), None).warm_up is False
