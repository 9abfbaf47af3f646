"""Synthesis requests: inputs validated and names resolved to ids, before any generation.

Scope: `Request` (everything `generate.frames` needs besides the model), `Rules` (what one
checkpoint accepts: its kind, voices, languages, sampling defaults, tokenizer) and the pure
functions that turn a call's arguments into a `Request`: `validate_options` (everything but the
text) and `build_request`, which also cuts a long text into the segments spoken one after the
other (`Part`s: kazeia/segment.py). Every refusal is a `RequestError`, a ValueError naming the argument at
fault and the valid choices. Non-goals: prompt layouts (prompt.py), server limits (server/params.py).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterable, Iterable
from dataclasses import dataclass, replace

from .config import ModelConfig
from .errors import RequestError, check_text
from .live import LiveText, TextFeed, as_feed
from .prompt import CLOSING_IDS, ROLE_IDS, Conditioning, has_text, prompt_positions
from .sampling import SamplingOptions
from .segment import LongTextOptions, split_text
from .speed import check_speed
from .text import TextTokenizer
from .voices import Voice, VoiceModel

TextSource = str | Iterable[str] | AsyncIterable[str] | TextFeed
MAX_SEED = 2**63
TEMPLATE_IDS = ROLE_IDS + CLOSING_IDS  # the assistant template's ids around the text tokens
# Characters of one whole text at most (a long book, some 20 hours of speech): bounds the text a
# call holds and the segments it plans; servers set much lower limits (server/config.py).
MAX_TEXT_CHARS = 1 << 20
SEED_STEP = 0x9E3779B97F4A7C15  # segment k speaks with seed + k * SEED_STEP (mod 2**63): distinct, reproducible


@dataclass(frozen=True)
class Rules:
    """What one loaded checkpoint accepts (built once by `Engine.load`)."""

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
class Part:
    """One segment of a whole text, as the talker speaks it."""

    text: str  # the segment's text (the whole text, as given, when it is one segment)
    text_ids: tuple[int, ...]  # its assistant template's ids
    seed: int  # its own seed, derived from the request's (segment 0: the request's seed itself)
    budget: int | None  # the runaway guard's frame budget (None: only max_new_tokens bounds it)

    @property
    def text_tokens(self) -> int:
        return len(self.text_ids) - TEMPLATE_IDS


@dataclass(frozen=True)
class Request:
    """One validated synthesis request."""

    text_ids: tuple[int, ...]  # the assistant template's ids; () while the text is not known yet
    cond: Conditioning
    options: SamplingOptions
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
        return self.long_text.guard and not self.options.ignore_eos


def validate_options(
    rules: Rules,
    voice: str | os.PathLike | Voice | None = None,
    language: str | None = None,
    instruct: str | None = None,
    seed: int | None = None,
    non_streaming_mode: bool | None = None,
    speed: float = 1.0,
    **sampling,
) -> Request:
    """Everything but the text, checked and resolved: a `Request` with no text ids yet (a random
    seed is drawn when none is given)."""
    try:
        speed = check_speed(speed)
    except ValueError as e:
        raise RequestError("speed", str(e)) from None
    cond = _conditioning(rules, voice, language, instruct)
    options = _sampling(rules.defaults, sampling)
    if non_streaming_mode is None:
        non_streaming_mode = rules.model_type != "base"  # the reference's default per model type
    if not isinstance(non_streaming_mode, bool):
        raise RequestError(
            "non_streaming_mode", f"non_streaming_mode must be True or False, got {non_streaming_mode!r}"
        )
    if seed is None:
        seed = int.from_bytes(os.urandom(6), "little")
    elif isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < MAX_SEED:
        raise RequestError("seed", f"seed must be an integer in [0, 2**63), got {seed!r}")
    return Request((), cond, options, non_streaming_mode, seed, speed=speed)


def build_request(
    rules: Rules,
    text: TextSource,
    text_timeout: float | None = 30.0,
    text_deadline: float | None = None,
    position_limit: int | None = None,
    long_text: LongTextOptions | None = None,
    **options,
) -> Request:
    """A whole text, or a source of text still arriving (an iterable or async iterable of deltas,
    or a `TextFeed`, read from now on; `text_timeout`: seconds it may go without new text, None for
    no limit; `text_deadline`: seconds, from when generation starts waiting for it, within which it
    must end, None for none; its default layout is the one that reads the text while generating,
    `non_streaming_mode=False`), with `options` as `validate_options` takes them.
    `position_limit`: prompt + max_new_tokens at most this (below the model's own positions), for
    each segment. `long_text`: how a whole text is segmented and guarded (defaults: LongTextOptions())."""
    if long_text is None:
        long_text = LongTextOptions()
    elif not isinstance(long_text, LongTextOptions):
        raise RequestError("long_text", f"long_text must be LongTextOptions, got {type(long_text).__name__}")
    if isinstance(text, str):
        check_text("text", text)
        if not text.strip():
            raise RequestError("text", "text is empty")
        if len(text) > MAX_TEXT_CHARS:
            raise RequestError("text", f"text has {len(text)} characters; at most {MAX_TEXT_CHARS} are accepted")
        base = validate_options(rules, **options)
        ids = rules.tokenizer.assistant_ids(text)
        if not has_text(ids):
            raise RequestError("text", "text produced no tokens")
        request = replace(base, text_ids=tuple(ids), position_limit=position_limit, long_text=long_text)
        return _planned(rules, request, text)
    if isinstance(text, (bytes, bytearray)):
        raise RequestError("text", "text must be a string or a source of strings, not bytes")
    if not isinstance(text, (Iterable, AsyncIterable, TextFeed)):
        kind = type(text).__name__
        raise RequestError("text", f"text must be a string, an iterable or an async iterable of strings, not {kind}")
    for name, value in (("text_timeout", text_timeout), ("text_deadline", text_deadline)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
            raise RequestError(name, f"{name} must be a number of seconds > 0 or None, got {value!r}")
    if options.get("non_streaming_mode") is None:
        options["non_streaming_mode"] = False
    base = validate_options(rules, **options)
    base = bounded(rules, replace(base, position_limit=position_limit, long_text=long_text), 0)
    live = LiveText(rules.tokenizer, as_feed(text), text_timeout, deadline=text_deadline)  # starts reading it
    return replace(base, live=live)


def _planned(rules: Rules, request: Request, text: str) -> Request:
    """`request` with its segments (one for a text within the budget, or with segmentation off),
    each bounded by the positions, with its seed and frame budget."""
    options, long_text = request.options, request.long_text
    if long_text.carry_context and rules.model_type != "base":
        raise RequestError(
            "carry_context", f"carry_context needs a Base checkpoint's in-context layout; this is {rules.model_type}"
        )
    texts = [text]
    if long_text.segment and len(request.text_ids) - TEMPLATE_IDS > long_text.segment_tokens:
        count = lambda piece: len(rules.tokenizer.text_ids(piece))  # noqa: E731
        texts = [piece.strip() for piece in split_text(text, long_text.segment_tokens, count)]
    parts: list[Part] = []
    for k, piece in enumerate(texts):
        ids = tuple(request.text_ids) if len(texts) == 1 else tuple(rules.tokenizer.assistant_ids(piece))
        budget = long_text.frame_budget(len(ids) - TEMPLATE_IDS) if request.guarded else None
        if budget is not None and budget >= options.max_new_tokens - 1:
            budget = None  # max_new_tokens comes first
        seed = (request.seed + k * SEED_STEP) % MAX_SEED
        parts.append(Part(piece, ids, seed, budget))
    first = bounded(rules, request, parts[0].text_tokens)
    for previous, part in zip(parts, parts[1:], strict=False):
        context = None
        if long_text.carry_context:  # at most the previous segment's frames join the prompt
            frames = options.max_new_tokens - 1 if previous.budget is None else previous.budget
            context = (previous.text_tokens, frames)
        bounded(rules, request, part.text_tokens, context)
    return replace(first, parts=tuple(parts))


def bounded(rules: Rules, request: Request, text_tokens: int, context: tuple[int, int] | None = None) -> Request:
    """`request` with its prompt's positions, once prompt + max_new_tokens fit the talker's
    positions (a RequestError naming the part that does not fit, before any work). `context`:
    (text tokens, frames) of a previous segment the prompt continues, in place of a voice's reference."""
    positions = prompt_positions(request.cond, text_tokens, request.non_streaming_mode, context)
    limit, whose = rules.cfg.talker.stack.max_positions, "the model's"
    if request.position_limit is not None and request.position_limit < limit:
        limit, whose = request.position_limit, "the allowed"
    wanted = request.options.max_new_tokens
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


def ref_text_ids(rules: Rules, ref_text: str) -> list[int]:
    """The tokens of a cloned voice's transcript (no template ids); none at all is an error."""
    check_text("ref_text", ref_text)
    ids = rules.tokenizer.text_ids(ref_text)
    if not ids:
        raise RequestError("ref_text", "ref_text produced no tokens")
    return ids


def _conditioning(rules: Rules, voice, language, instruct) -> Conditioning:
    t = rules.cfg.talker
    if rules.model_type == "base":
        clone, ref_ids, speaker = _cloned_voice(rules, voice), None, None
        if clone.ref_text is not None:  # ICL (a Voice has both its codes and transcript, or neither)
            ref_ids = tuple(ref_text_ids(rules, clone.ref_text))
    else:
        clone, ref_ids, speaker = None, None, _speaker(rules, voice)
    lang = "auto" if language is None else language
    if not isinstance(lang, str) or lang.strip().lower() not in rules.languages:
        raise RequestError("language", f"unknown language {language!r}; choose one of: {', '.join(rules.languages)}")
    lang = lang.strip().lower()
    language_id = None if lang == "auto" else t.language_ids[lang]
    dialect = t.speaker_dialects.get(speaker) if speaker else None
    if dialect and lang in ("chinese", "auto"):
        language_id = t.language_ids[dialect]  # eric -> Sichuan, dylan -> Beijing dialect
    speaker_id = t.speaker_ids[speaker] if speaker else None
    return Conditioning(language_id, speaker_id, _instruct(rules, instruct), clone, ref_ids)


def _cloned_voice(rules: Rules, voice) -> Voice:
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
    loaded = rules.voice_model
    if loaded is None or voice.model != loaded:
        theirs = loaded.describe() if loaded is not None else "a checkpoint without a speaker encoder"
        raise RequestError(
            "voice",
            f"this voice was made with {voice.model.describe()}, but this engine loaded "
            f"{theirs}; create the voice again with this checkpoint",
        )
    codes, q, size = voice.ref_codes, rules.cfg.talker.num_code_groups, rules.codebook_size
    if codes is not None and (codes.shape[1] != q or int(codes.min()) < 0 or int(codes.max()) >= size):
        raise RequestError("voice", f"voice ref_codes must be (frames, {q}) codes in 0..{size - 1}")
    return voice


def _speaker(rules: Rules, voice) -> str | None:
    kind = rules.model_type
    if isinstance(voice, (Voice, os.PathLike)):
        raise RequestError("voice", f"cloned voices need a Base checkpoint; this is a {kind} checkpoint")
    if kind == "voice_design":
        if voice is not None:
            raise RequestError(
                "voice", "VoiceDesign checkpoints have no preset voices: describe the voice with instruct="
            )
        return None
    if voice is None:
        raise RequestError("voice", f"voice is required; choose one of: {', '.join(rules.voices)}")
    name = voice.strip().lower() if isinstance(voice, str) else voice
    if name not in rules.cfg.talker.speaker_ids:
        raise RequestError("voice", f"unknown voice {voice!r}; choose one of: {', '.join(rules.voices)}")
    return name


def _instruct(rules: Rules, instruct) -> tuple[int, ...] | None:
    if instruct is not None and not isinstance(instruct, str):
        raise RequestError("instruct", f"instruct must be a string, got {type(instruct).__name__}")
    if instruct is not None:
        check_text("instruct", instruct)
    given = bool(instruct and instruct.strip())
    kind = rules.model_type
    if given and kind == "base":
        raise RequestError("instruct", "Base checkpoints take no instruct; the voice comes from voice=")
    if kind == "voice_design" and not given:
        raise RequestError("instruct", "VoiceDesign checkpoints need instruct=, a description of the voice")
    if given and kind == "custom_voice" and rules.cfg.tts_model_size == "0b6":
        raise RequestError(
            "instruct", "the 0.6B CustomVoice checkpoint does not support instruct; use a 1.7B checkpoint"
        )
    return tuple(rules.tokenizer.instruct_ids(instruct)) if instruct is not None and given else None


def _sampling(defaults: SamplingOptions, sampling: dict) -> SamplingOptions:
    names = SamplingOptions.names()
    unknown = sorted(set(sampling) - set(names))
    if unknown:
        raise RequestError(unknown[0], f"unknown option {unknown[0]!r}; valid options: {', '.join(names)}")
    return replace(defaults, **{k: v for k, v in sampling.items() if v is not None})
