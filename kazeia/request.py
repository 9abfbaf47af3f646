"""Synthesis requests: a call's text and options validated and names resolved to ids, before any work.

Scope: `Request` (everything a request's frames need besides the model), `Capabilities` (what one
checkpoint accepts: its kind, voices, languages, sampling defaults, tokenizer) and the functions that
turn a text and `SynthesisOptions` into a `Request`: `build_request` (which also plans a long text's
segments: kazeia/segment.py), `validate_options` (everything but the text) and `voice_fits` (a
cloned voice leaves room to speak). Every refusal is a `RequestError`, a ValueError naming the
argument at fault and the valid choices. Non-goals: prompt layouts (prompt.py), server limits
(server/params.py).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterable, Iterable
from dataclasses import dataclass, replace

from .config import ModelConfig
from .errors import RequestError, check_text
from .live import LiveText, TextFeed, as_feed
from .options import StreamOptions, SynthesisOptions
from .prompt import Conditioning, has_text, prompt_positions
from .sampling import SamplingOptions
from .segment import LongTextOptions, Part, plan
from .text import TextTokenizer
from .voices import Voice, VoiceModel

TextSource = str | Iterable[str] | AsyncIterable[str] | TextFeed
# Characters of one whole text at most (a long book, some 20 hours of speech): bounds the text a
# call holds and the segments it plans; servers set much lower limits (server/config.py).
MAX_TEXT_CHARS = 1 << 20


@dataclass(frozen=True)
class Capabilities:
    """What one loaded checkpoint accepts (kazeia/runtime.py makes it once)."""

    cfg: ModelConfig
    tokenizer: TextTokenizer
    defaults: SamplingOptions  # from the checkpoint's generation_config.json
    voice_model: VoiceModel | None  # Base checkpoints: the checkpoint a cloned Voice must come from
    codebook_size: int  # codes per codebook (2048): the range of a cloned voice's reference codes

    @property
    def model_type(self) -> str:
        return self.cfg.tts_model_type

    @property
    def voices(self) -> list[str]:
        """Preset speakers (CustomVoice checkpoints); empty for other kinds."""
        return sorted(self.cfg.talker.speaker_ids)

    @property
    def languages(self) -> list[str]:
        """Accepted `language` values: "auto" plus the checkpoint's languages (dialects come with speakers)."""
        dialects = {d for d in self.cfg.talker.speaker_dialects.values() if d}
        return ["auto"] + sorted(k for k in self.cfg.talker.language_ids if k not in dialects)


@dataclass(frozen=True)
class Request:
    """One validated synthesis request."""

    text_ids: tuple[int, ...]  # the assistant template's ids; () while the text is not known yet
    cond: Conditioning
    sampling: SamplingOptions  # the call's, the checkpoint's defaults filling the rest
    non_streaming_mode: bool  # the text layout (prompt.py)
    seed: int  # drives every random draw; the same seed gives the same bytes
    live: LiveText | None = None  # text still arriving (a text source rather than a string)
    prompt_positions: int = 0  # talker positions of the prompt (live text: without the text)
    position_limit: int | None = None  # a caller's bound on prompt + max_new_tokens (a server's)
    parts: tuple[Part, ...] = ()  # a whole text's segments, spoken one after the other (live text: none)
    long_text: LongTextOptions = LongTextOptions()  # segmentation and the runaway guard
    speed: float = 1.0  # pace of the audio (kazeia/speed.py); 1.0: the vocoder's samples untouched

    @property
    def guarded(self) -> bool:
        """Whether the runaway guard watches the segments (never with ignore_eos, which asks for
        exactly max_new_tokens - 1 frames)."""
        return self.long_text.guard and not self.sampling.ignore_eos


def validate_options(caps: Capabilities, options: SynthesisOptions) -> Request:
    """Everything but the text, checked against the checkpoint and resolved: a `Request` with no
    text ids yet (a random seed is drawn when none is given)."""
    cond = _conditioning(caps, options.voice, options.language, options.instruct)
    if options.long_text.carry_context and caps.model_type != "base":
        raise RequestError(
            "carry_context", f"carry_context needs a Base checkpoint's in-context layout; this is {caps.model_type}"
        )
    layout = options.non_streaming_mode
    if layout is None:
        layout = caps.model_type != "base"  # the reference's default per model type
    seed = options.seed if options.seed is not None else int.from_bytes(os.urandom(6), "little")
    sampling = replace(caps.defaults, **options.sampling)
    return Request((), cond, sampling, layout, seed, long_text=options.long_text, speed=float(options.speed))


def build_request(
    caps: Capabilities, text: TextSource, options: SynthesisOptions | None = None, position_limit: int | None = None
) -> Request:
    """A whole text, or a source of text still arriving (an iterable or async iterable of deltas,
    or a `TextFeed`, read from now on, within `text_timeout` and `text_deadline`: the options' where
    they are StreamOptions, else StreamOptions' defaults; its default layout is the one that reads
    the text while generating, `non_streaming_mode=False`), spoken with `options` (resolved by the
    caller: options.with_overrides). `position_limit`: prompt + max_new_tokens at most this (below the
    model's own positions), for each segment."""
    options = SynthesisOptions() if options is None else options
    if isinstance(text, str):
        check_text("text", text)
        if not text.strip():
            raise RequestError("text", "text is empty")
        if len(text) > MAX_TEXT_CHARS:
            raise RequestError("text", f"text has {len(text)} characters; at most {MAX_TEXT_CHARS} are accepted")
        base = validate_options(caps, options)
        ids = tuple(caps.tokenizer.assistant_ids(text))
        if not has_text(ids):
            raise RequestError("text", "text produced no tokens")
        return _planned(caps, replace(base, text_ids=ids, position_limit=position_limit), text)
    if isinstance(text, (bytes, bytearray)):
        raise RequestError("text", "text must be a string or a source of strings, not bytes")
    if not isinstance(text, (Iterable, AsyncIterable, TextFeed)):
        kind = type(text).__name__
        raise RequestError("text", f"text must be a string, an iterable or an async iterable of strings, not {kind}")
    if options.non_streaming_mode is None:
        options = replace(options, non_streaming_mode=False)
    base = bounded(caps, replace(validate_options(caps, options), position_limit=position_limit), 0)
    timing = options if isinstance(options, StreamOptions) else StreamOptions()
    live = LiveText(caps.tokenizer, as_feed(text), timing.text_timeout, deadline=timing.text_deadline)
    return replace(base, live=live)  # the feed is read from now on


def voice_fits(caps: Capabilities, voice: Voice, position_limit: int | None = None) -> None:
    """Whether `voice`'s prompt leaves room to speak a word: a RequestError (field "voice") when a
    one-token text and its first frame would not fit the talker's positions, or `position_limit`."""
    request = validate_options(caps, SynthesisOptions(voice=voice, max_new_tokens=2))
    bounded(caps, replace(request, position_limit=position_limit), 1)


def _planned(caps: Capabilities, request: Request, text: str) -> Request:
    """`request` with its segments (segment.plan), each bounded by the positions."""
    long_text = request.long_text
    sampling = request.sampling
    parts = plan(
        text, request.text_ids, caps.tokenizer, long_text, request.seed, sampling.max_new_tokens, request.guarded
    )
    first = bounded(caps, request, parts[0].text_tokens)
    for previous, part in zip(parts, parts[1:], strict=False):
        context = None
        if long_text.carry_context:  # at most the previous segment's frames join the prompt
            frames = sampling.max_new_tokens - 1 if previous.budget is None else previous.budget
            context = (previous.text_tokens, frames)
        bounded(caps, request, part.text_tokens, context)
    return replace(first, parts=parts)


def bounded(caps: Capabilities, request: Request, text_tokens: int, context: tuple[int, int] | None = None) -> Request:
    """`request` with its prompt's positions, once prompt + max_new_tokens fit the talker's
    positions (a RequestError naming the part that does not fit, before any work). `context`:
    (text tokens, frames) of a previous segment the prompt continues, in place of a voice's reference."""
    positions = prompt_positions(request.cond, text_tokens, request.non_streaming_mode, context)
    limit, whose = caps.cfg.talker.stack.max_positions, "the model's"
    if request.position_limit is not None and request.position_limit < limit:
        limit, whose = request.position_limit, "the allowed"
    wanted = request.sampling.max_new_tokens
    if positions >= limit:
        field = "text" if text_tokens else "voice"
        raise RequestError(field, f"the prompt takes {positions} positions; {whose} are {limit} in all")
    if positions + wanted > limit:
        raise RequestError(
            "max_new_tokens",
            f"max_new_tokens {wanted} after a prompt of {positions} positions exceeds {whose} {limit} "
            f"positions; ask for at most {limit - positions}",
        )
    return replace(request, prompt_positions=positions)


def check_clone(caps: Capabilities, ref_text, x_vector_only) -> None:
    """The arguments of `Engine.create_voice` besides the audio: a transcript that tokenizes for an
    ICL voice, none for an x-vector-only one."""
    if not isinstance(x_vector_only, bool):
        raise RequestError("x_vector_only", f"x_vector_only must be True or False, got {x_vector_only!r}")
    if x_vector_only and ref_text is not None:
        raise RequestError("ref_text", "ref_text is not used with x_vector_only=True; leave it out")
    if x_vector_only:
        return
    if not isinstance(ref_text, str) or not ref_text.strip():
        raise RequestError(
            "ref_text",
            "ref_text, the transcript of the reference audio, is required for ICL cloning (or pass x_vector_only=True)",
        )
    ref_text_ids(caps, ref_text)


def ref_text_ids(caps: Capabilities, ref_text: str) -> list[int]:
    """The tokens of a cloned voice's transcript (no template ids); none at all is an error."""
    check_text("ref_text", ref_text)
    ids = caps.tokenizer.text_ids(ref_text)
    if not ids:
        raise RequestError("ref_text", "ref_text produced no tokens")
    return ids


def _conditioning(caps: Capabilities, voice, language, instruct) -> Conditioning:
    t = caps.cfg.talker
    if caps.model_type == "base":
        clone, ref_ids, speaker = _cloned_voice(caps, voice), None, None
        if clone.ref_text is not None:  # ICL (a Voice has both its codes and transcript, or neither)
            ref_ids = tuple(ref_text_ids(caps, clone.ref_text))
    else:
        clone, ref_ids, speaker = None, None, _speaker(caps, voice)
    lang = "auto" if language is None else language
    if not isinstance(lang, str) or lang.strip().lower() not in caps.languages:
        raise RequestError("language", f"unknown language {language!r}; choose one of: {', '.join(caps.languages)}")
    lang = lang.strip().lower()
    language_id = None if lang == "auto" else t.language_ids[lang]
    dialect = t.speaker_dialects.get(speaker) if speaker else None
    if dialect and lang in ("chinese", "auto"):
        language_id = t.language_ids[dialect]  # eric -> Sichuan, dylan -> Beijing dialect
    speaker_id = t.speaker_ids[speaker] if speaker else None
    return Conditioning(language_id, speaker_id, _instruct(caps, instruct), clone, ref_ids)


def _cloned_voice(caps: Capabilities, voice) -> Voice:
    """A Base checkpoint's `voice=`: a `Voice`, or the path of a saved one."""
    if voice is None:
        raise RequestError(
            "voice",
            "this Base checkpoint clones voices: pass voice= a Voice from engine.create_voice(...) "
            "or the path of a saved voice file",
        )
    if isinstance(voice, (str, os.PathLike)):
        try:
            voice = Voice.load(voice)
        except ValueError as e:
            raise RequestError("voice", str(e)) from None
    elif not isinstance(voice, Voice):
        raise RequestError("voice", f"voice must be a Voice or the path of a voice file, got {type(voice).__name__}")
    loaded = caps.voice_model
    if loaded is None or voice.model != loaded:
        theirs = loaded.describe() if loaded is not None else "a checkpoint without a speaker encoder"
        raise RequestError(
            "voice",
            f"this voice was made with {voice.model.describe()}, but this engine loaded "
            f"{theirs}; create the voice again with this checkpoint",
        )
    codes, q, size = voice.ref_codes, caps.cfg.talker.num_code_groups, caps.codebook_size
    if codes is not None and (codes.shape[1] != q or int(codes.min()) < 0 or int(codes.max()) >= size):
        raise RequestError("voice", f"voice ref_codes must be (frames, {q}) codes in 0..{size - 1}")
    return voice


def _speaker(caps: Capabilities, voice) -> str | None:
    kind = caps.model_type
    if isinstance(voice, (Voice, os.PathLike)):
        raise RequestError("voice", f"cloned voices need a Base checkpoint; this is a {kind} checkpoint")
    if kind == "voice_design":
        if voice is not None:
            raise RequestError(
                "voice", "VoiceDesign checkpoints have no preset voices: describe the voice with instruct="
            )
        return None
    if voice is None:
        raise RequestError("voice", f"voice is required; choose one of: {', '.join(caps.voices)}")
    name = voice.strip().lower() if isinstance(voice, str) else voice
    if name not in caps.cfg.talker.speaker_ids:
        raise RequestError("voice", f"unknown voice {voice!r}; choose one of: {', '.join(caps.voices)}")
    return name


def _instruct(caps: Capabilities, instruct) -> tuple[int, ...] | None:
    if instruct is not None and not isinstance(instruct, str):
        raise RequestError("instruct", f"instruct must be a string, got {type(instruct).__name__}")
    if instruct is not None:
        check_text("instruct", instruct)
    given = bool(instruct and instruct.strip())
    kind = caps.model_type
    if given and kind == "base":
        raise RequestError("instruct", "Base checkpoints take no instruct; the voice comes from voice=")
    if kind == "voice_design" and not given:
        raise RequestError("instruct", "VoiceDesign checkpoints need instruct=, a description of the voice")
    if given and kind == "custom_voice" and caps.cfg.tts_model_size == "0b6":
        raise RequestError(
            "instruct", "the 0.6B CustomVoice checkpoint does not support instruct; use a 1.7B checkpoint"
        )
    return tuple(caps.tokenizer.instruct_ids(instruct)) if instruct is not None and given else None
