"""The options of a synthesis call: frozen dataclasses, one described field per option.

`SynthesisOptions` says what to speak with and how: the voice, language, instruction, seed, text
layout, pace, long-text handling and the sampling options (None there takes the checkpoint's
generation_config.json value). `StreamOptions` adds how a stream cuts its audio into chunks and how
long a text still arriving may take. `Engine.synthesize(text, options, **overrides)` and
`Engine.stream(...)` apply keyword overrides with `dataclasses.replace` (`resolve`); the `kazeia`
command's flags and the server's request fields are made from these fields, so a new option is a
field here plus the one place that uses it. Values are checked as the options are made (a
RequestError naming the field); what depends on the checkpoint (voices, languages, positions) is
checked when a request is built (kazeia/request.py).

Non-goals: server limits (server/params.py), what each sampling option does (sampling.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace
from typing import TypeVar

from .described import Described, option
from .errors import RequestError
from .sampling import MAX_SEED, SamplingOptions
from .segment import LongTextOptions
from .speed import check_speed
from .voices import Voice

SAMPLING_FIELDS = SamplingOptions.names()  # the fields below that the checkpoint's defaults fill


@dataclass(frozen=True)
class SynthesisOptions(Described):
    """How one text is spoken. Every field has a default; the same options and seed give the same
    bytes."""

    voice: str | os.PathLike | Voice | None = option(
        None, "preset speaker (CustomVoice: see `kazeia voices`) or a cloned voice / voice file (Base)", str
    )
    language: str | None = option(None, "language name or auto (default: auto)", str)
    instruct: str | None = option(None, "style instruction (1.7B CustomVoice) or voice description (VoiceDesign)", str)
    seed: int | None = option(None, "drives every random draw: the same seed, the same audio (default: random)", int)
    non_streaming_mode: bool | None = option(
        None, "text layout: all of the text in the prompt (default: on; off for Base checkpoints, live text)", bool
    )
    speed: float = option(1.0, "pace of the speech, 0.25-4.0, the pitch kept (1.0: the vocoder's samples untouched)")
    long_text: LongTextOptions = option(LongTextOptions(), "how a long text is cut into segments and each is guarded")
    # Sampling, named as the reference's: None takes the checkpoint's generation_config.json value.
    do_sample: bool | None = option(None, "talker: sample codebook 0 (off: greedy argmax)", bool)
    temperature: float | None = option(None, "talker logits are divided by this before top-k/top-p", float)
    top_k: int | None = option(None, "keep the k most likely codebook-0 tokens (0: no limit)", int)
    top_p: float | None = option(None, "nucleus: keep the smallest set with this probability mass (1.0: off)", float)
    repetition_penalty: float | None = option(
        None, ">1 discourages repeating generated codebook-0 tokens (1.0: off)", float
    )
    max_new_tokens: int | None = option(
        None, "talker tokens incl. the final EOS/cut-off one: at most this - 1 frames (80 ms each)", int
    )
    subtalker_dosample: bool | None = option(None, "code predictor: sample codebooks 1..15 (off: greedy)", bool)
    subtalker_temperature: float | None = option(None, "code predictor: temperature", float)
    subtalker_top_k: int | None = option(None, "code predictor: top-k (0: no limit)", int)
    subtalker_top_p: float | None = option(None, "code predictor: top-p (1.0: off)", float)
    ignore_eos: bool | None = option(None, "never sample EOS: exactly max_new_tokens - 1 frames (benchmarks)", bool)

    def __post_init__(self) -> None:
        seed = self.seed
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < MAX_SEED):
            raise RequestError("seed", f"seed must be an integer in [0, 2**63), got {seed!r}")
        layout = self.non_streaming_mode
        if layout is not None and not isinstance(layout, bool):
            raise RequestError("non_streaming_mode", f"non_streaming_mode must be True or False, got {layout!r}")
        try:
            check_speed(self.speed)
        except ValueError as e:
            raise RequestError("speed", str(e)) from None
        if not isinstance(self.long_text, LongTextOptions):
            kind = type(self.long_text).__name__
            raise RequestError("long_text", f"long_text must be LongTextOptions, got {kind}")
        SamplingOptions(**self.sampling)  # each value given, checked (a RequestError naming its field)

    @property
    def sampling(self) -> dict:
        """The sampling options given (not None), by name."""
        return {name: getattr(self, name) for name in SAMPLING_FIELDS if getattr(self, name) is not None}


@dataclass(frozen=True)
class StreamOptions(SynthesisOptions):
    """`SynthesisOptions` and how a stream delivers its audio. The chunking changes latency and
    overhead, never the sound (kazeia/streaming.py's `ChunkSchedule`)."""

    first_chunk_frames: int = option(1, "frames (80 ms each) in the first chunk: the first audio's latency")
    chunk_frames: int = option(4, "frames in each later chunk, reached one frame more a chunk")
    max_chunk_frames: int | None = option(
        None, "frames a later chunk may take when its consumer has fallen behind (default: chunk_frames)", int
    )
    text_timeout: float | None = option(30.0, "live text: seconds it may go without new text (None: no limit)")
    text_deadline: float | None = option(
        None, "live text: seconds, from the first wait for it, within which it must end (None: none)", float
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("text_timeout", "text_deadline"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
                raise RequestError(name, f"{name} must be a number of seconds > 0 or None, got {value!r}")


Options = TypeVar("Options", bound=SynthesisOptions)


def resolve(kind: type[Options], options: SynthesisOptions | None, overrides: dict) -> Options:
    """`options` (None: the defaults) as `kind`, with `overrides` applied (`dataclasses.replace`).
    SynthesisOptions given where StreamOptions are wanted keep their fields and take the stream's
    defaults. An unknown override is a RequestError naming it and the valid ones."""
    if options is None:
        options = kind()
    elif not isinstance(options, SynthesisOptions):
        raise RequestError("options", f"options must be SynthesisOptions, got {type(options).__name__}")
    unknown = sorted(set(overrides) - set(kind.names()))
    if unknown:
        raise RequestError(unknown[0], f"unknown option {unknown[0]!r}; valid options: {', '.join(kind.names())}")
    if not isinstance(options, kind):
        options = kind(**{f.name: getattr(options, f.name) for f in fields(options)})
    return replace(options, **overrides) if overrides else options
