"""A loaded engine's one-off costs, paid before its first listener: `warm_up`.

The first utterance after loading is slower than the ones after it: kernels, thread pools and
allocations meet their first call, and each voice's prompt positions (the talker over a preset
speaker's or a description's control rows) are computed once, then kept in the engine's voice cache
(kazeia/frame.py, `voiced_cache`). Measured on a 2-vCPU Zen 3 at int4 (benchmarks/first_audio.py,
a 3-sentence text): the first stream after loading heard in 665-719 ms, the next ones in 457-463,
95 ms of the difference the voice's positions. A listener who happens to be a server's first, or
the first to pick a voice, should not pay that: `kazeia serve` (also each Ray replica) and
`kazeia wyoming` call `warm_up` before they take a request (ServerConfig.warm_up, `--no-warm-up`).

What runs: one short stream of the first voice to its first chunk (every stage once: prompt,
prefill, code predictor, vocoder), then the first frame of each other preset speaker (their prompt
positions into the voice cache), all with the given options' language and instruction. Nothing of
it reaches a later request's bytes: the voice cache holds exactly what a request would compute (a
voice's positions always run apart from the text's), and every run draws from its own seeded
generator.

Non-goals: Base checkpoints' cloned voices (a request brings its reference; one is warmed only
when the options hold it, as a `Voice` or its file), and other languages (each speaker and language
is cached on first use).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .options import SynthesisOptions

if TYPE_CHECKING:
    from .engine import Engine

TEXT = "Hello."
DESCRIPTION = "A clear, calm voice."  # what a VoiceDesign checkpoint speaks with when the options give none


def warm_up(engine: Engine, options: SynthesisOptions | None = None) -> list:
    """Run the engine once per voice a request may name without bringing one (module docstring):
    `options.voice` if set, else every preset speaker, else the model's own (VoiceDesign, with
    `options.instruct` or DESCRIPTION). Returns the voices warmed, as given (None for a described
    voice); none for a Base checkpoint whose options hold no voice. Errors are the engine's (a voice
    or option it refuses)."""
    options = options or SynthesisOptions()
    if options.voice is not None:
        voices: list = [options.voice]
    elif engine.voices:
        voices = list(engine.voices)
    elif engine.model_type == "voice_design":
        voices = [None]
    else:
        return []
    fixed: dict = dict(seed=0, max_new_tokens=2)
    if engine.model_type == "voice_design" and options.instruct is None:
        fixed["instruct"] = DESCRIPTION
    with engine.stream(TEXT, options, voice=voices[0], first_chunk_frames=1, **fixed) as stream:
        next(stream, None)
    for voice in voices[1:]:
        frames = engine.frames(engine.request(TEXT, options, voice=voice, **fixed))
        try:
            next(frames, None)
        finally:
            frames.close()  # type: ignore[attr-defined]
    return voices
