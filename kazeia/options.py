"""The options of a synthesis call: frozen dataclasses, one described field per option.

`SynthesisOptions` says what to speak with and how: the voice, language, instruction, seed, text
layout, pace, long-text handling and the sampling options (None there takes the checkpoint's
generation_config.json value). `StreamOptions` adds how a stream cuts its audio into chunks and how
long a text still arriving may take. `Engine.synthesize(text, options, **overrides)` and
`Engine.stream(...)` apply keyword overrides with `dataclasses.replace` (`with_overrides`); the `kazeia`
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


RAMP_HOLD = 3  # chunks of each size on a stream's way to `chunk_frames` (ChunkSchedule)


@dataclass(frozen=True)
class ChunkSchedule:
    """Frames per chunk of a stream: `first` for the first chunk (latency), then `rest` (overhead),
    reached one frame at a time, each size held for `RAMP_HOLD` chunks: with first 1 and rest 4 the
    chunks hold 1, 2, 2, 2, 3, 3, 3, 4, 4, ... frames. The ramp is for a player that starts with a
    short buffer (160-250 ms). A chunk's first sample is heard only after its last frame is
    generated and the whole chunk decoded, so each frame more a chunk delays it by about a frame's
    generation and a frame's decode; a stream generated faster than real time wins back the
    difference with every frame played, and holding each size for a few chunks lets it win that
    back before the next step. Where a frame's generation and decode together take well over
    80 ms (int4 on an AVX2 core: ~66 + ~57 ms) one frame more every chunk (1, 2, 3, 4) ran dry
    once early on, ~0.09 s with 160 ms buffered (BENCHMARKS.md, "long dry s").

    `most` lets a later chunk catch up: when its consumer has fallen behind and more frames than
    its size are already waiting, the chunk takes them too, up to `most` (None, the default:
    exactly its size). The vocoder decodes a longer chunk faster per frame (BENCHMARKS.md), so a
    consumer that the vocoder holds back (many streams on few cores) catches up, while one that
    keeps up still gets the sizes above. No schedule changes the codes or the audio: the vocoder
    gives the same bits whatever the chunks (docs/design.md)."""

    first: int = 1
    rest: int = 4
    most: int | None = None

    def __post_init__(self) -> None:
        for name, value in (("first_chunk_frames", self.first), ("chunk_frames", self.rest)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise RequestError(name, f"{name} must be an integer >= 1, got {value!r}")
        most = self.most
        if most is not None and (isinstance(most, bool) or not isinstance(most, int) or most < self.rest):
            message = f"max_chunk_frames must be an integer >= chunk_frames ({self.rest}) or None, got {most!r}"
            raise RequestError("max_chunk_frames", message)

    def size(self, index: int) -> int:
        """Frames in chunk `index` (0 the first)."""
        return self.first if index == 0 else min(self.rest, self.first + (index + RAMP_HOLD - 1) // RAMP_HOLD)

    def limit(self, index: int) -> int:
        """The most frames chunk `index` may take when they are already waiting."""
        if index == 0 or self.most is None:
            return self.size(index)
        return self.most


@dataclass(frozen=True)
class StreamOptions(SynthesisOptions):
    """`SynthesisOptions` and how a stream delivers its audio. The chunking changes latency and
    overhead, never the sound (`ChunkSchedule`)."""

    first_chunk_frames: int = option(1, "frames (80 ms each) in the first chunk: the first audio's latency")
    chunk_frames: int = option(4, "frames in each later chunk, reached one frame at a time (ChunkSchedule)")
    max_chunk_frames: int | None = option(
        None, "frames a later chunk may take when its consumer has fallen behind (default: chunk_frames)", int
    )
    text_timeout: float | None = option(30.0, "live text: seconds it may go without new text (None: no limit)")
    text_deadline: float | None = option(
        None, "live text: seconds, from the first wait for it, within which it must end (None: none)", float
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        _ = self.schedule  # a bad chunk schedule is refused as the options are made
        for name in ("text_timeout", "text_deadline"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
                raise RequestError(name, f"{name} must be a number of seconds > 0 or None, got {value!r}")

    @property
    def schedule(self) -> ChunkSchedule:
        """The chunk schedule these options ask for."""
        return ChunkSchedule(self.first_chunk_frames, self.chunk_frames, self.max_chunk_frames)


Options = TypeVar("Options", bound=SynthesisOptions)


def with_overrides(kind: type[Options], options: SynthesisOptions | None, overrides: dict) -> Options:
    """`options` (None: the defaults) as `kind`, with `overrides` applied (`dataclasses.replace`).
    SynthesisOptions given where StreamOptions are wanted keep their fields and take the stream's
    defaults; StreamOptions given where only SynthesisOptions apply (`Engine.synthesize`) must
    leave the stream's fields at their defaults. An unknown override, or a stream field set for a
    call that does not stream, is a RequestError naming it."""
    if options is None:
        options = kind()
    elif not isinstance(options, SynthesisOptions):
        raise RequestError("options", f"options must be SynthesisOptions, got {type(options).__name__}")
    names = kind.names()
    unknown = sorted(set(overrides) - set(names))
    if unknown:
        raise RequestError(unknown[0], f"unknown option {unknown[0]!r}; valid options: {', '.join(names)}")
    if type(options) is not kind:
        for extra in fields(options):
            if extra.name not in names and getattr(options, extra.name) != extra.default:
                raise RequestError(extra.name, f"{extra.name} applies to streams only (Engine.stream), not here")
        options = kind(**{name: getattr(options, name) for name in names if hasattr(options, name)})
    return replace(options, **overrides) if overrides else options
