"""Request bodies -> validated engine requests, or an `ApiError` naming the field at fault.

The speech body takes OpenAI's fields (`model`, `input`, `voice`, `instructions`, `response_format`,
`speed`, `stream_format`) and Kazeia's extensions (`stream`, `language`, `seed`, `non_streaming_mode`
and every `SamplingOptions` field under its own name). A WebSocket session takes the same voice, `speed` and
extension fields. Unknown fields are refused, never ignored. The engine does the model-specific
validation (voices, languages, option types); this module adds the server's `Limits`, and on Base
checkpoints turns a `voice` name into the saved voice of that name (never into a file path).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..engine import Engine
from ..errors import check_text
from ..live import TextFeed
from ..options import SynthesisOptions
from ..request import Request, validate_options
from .bodies import check_length, check_tokens, refuse_unknown
from .config import Limits, ServerConfig
from .errors import ApiError, from_engine
from .formats import UNSUPPORTED, AudioFormat
from .wire import shown

if TYPE_CHECKING:
    from .store import VoiceStore

# Request fields: every SynthesisOptions field under its own name, but those named otherwise (OpenAI's
# `instructions`), `voice` (a name here, resolved apart: `resolve_voice`) and `long_text` (not offered).
RENAMED = {"instruct": "instructions"}
ENGINE_FIELDS = tuple(n for n in SynthesisOptions.names() if n not in (*RENAMED, "voice", "long_text"))
SESSION_FIELDS = ("voice", *RENAMED.values(), *ENGINE_FIELDS)
SPEECH_FIELDS = ("model", "input", "response_format", "stream_format", "stream", *SESSION_FIELDS)
STREAM_FORMATS = ("audio", "sse")
CAPPED = {  # option -> the Limits field bounding it from above
    "max_new_tokens": "max_new_tokens",
    "temperature": "max_temperature",
    "subtalker_temperature": "max_temperature",
    "repetition_penalty": "max_repetition_penalty",
}


@dataclass(frozen=True)
class SpeechBody:
    """The validated body of a `POST /v1/audio/speech`: the engine request and how to send its audio."""

    request: Request  # what the worker generates
    audio_format: AudioFormat  # how its audio is encoded
    stream_format: str  # "audio" (the encoded bytes) or "sse" (base64 events)
    stream: bool = True  # False: the whole audio in one response, with its finish reason in a header


def speech_body(
    body: dict, engine: Engine, config: ServerConfig, formats: dict[str, AudioFormat], voices: VoiceStore | None
) -> SpeechBody:
    refuse_unknown(body, SPEECH_FIELDS)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, f"model must be a string, got {shown(model)}", param="model")
    if model is not None and model != config.model_name and model not in config.model_aliases:
        aliases = f" (also answering to {', '.join(config.model_aliases)})" if config.model_aliases else ""
        raise ApiError(
            404,
            f"unknown model {shown(model)}; this server serves {config.model_name!r}{aliases}",
            param="model",
            code="model_not_found",
        )
    text = _string(body, "input", config.limits.max_input_chars, required=True)
    audio_format = _format(body.get("response_format"), formats)
    stream_format = body.get("stream_format", "audio")
    if stream_format not in STREAM_FORMATS:
        raise ApiError(
            400,
            f"unknown stream_format {stream_format!r}; choose one of: {', '.join(STREAM_FORMATS)}",
            param="stream_format",
        )
    stream = body.get("stream", True)
    if not isinstance(stream, bool):
        raise ApiError(400, f"stream must be true or false, got {json.dumps(stream)}", param="stream")
    if not stream and stream_format == "sse":
        raise ApiError(
            400, 'stream false sends the whole audio at once; it takes stream_format "audio"', param="stream"
        )
    options = session_options(body, engine, config.limits, voices, check=False)
    return SpeechBody(prepare(engine, text, options, voices, config), audio_format, stream_format, stream)


def session_options(body: dict, engine: Engine, limits: Limits, voices: VoiceStore | None, check: bool = True) -> dict:
    """Voice and generation options (the keyword arguments of `Engine.request` but the text); the
    voice stays a name here (it is looked up when a text is accepted).

    `check=True` also validates them (voice, language, option values: `request.validate_options`),
    so that a WebSocket session is refused when it is set, not at its first text.
    """
    if check:
        refuse_unknown(body, SESSION_FIELDS, "session")
    options = {name: body[name] for name in ENGINE_FIELDS if name in body and body[name] is not None}
    if options.get("ignore_eos") is True and not limits.allow_ignore_eos:
        raise ApiError(
            400,
            "ignore_eos is not offered by this server (it makes frames past the end of speech, for "
            "benchmarks; a server started with --allow-ignore-eos takes it)",
            param="ignore_eos",
            code="unsupported_parameter",
        )
    options["voice"] = _voice(body.get("voice"))
    options["instruct"] = _string(body, "instructions", limits.max_instructions_chars)
    _apply_limits(options, limits)
    options.setdefault("max_new_tokens", min(limits.max_new_tokens, engine.defaults.max_new_tokens))
    if check:
        resolved = {**options, "voice": resolve_voice(engine, options.get("voice"), voices)}
        _engine_call(lambda: validate_options(engine.runtime.caps, SynthesisOptions(**resolved)))
    return options


def session_fields(options: SynthesisOptions) -> dict:
    """Options as the request fields that set them (those given: not None), for a server's defaults."""
    given = {RENAMED.get(name, name): getattr(options, name) for name in ("instruct", *ENGINE_FIELDS)}
    return {name: value for name, value in given.items() if value is not None}


def prepare(
    engine: Engine, text: str | TextFeed, options: dict, voices: VoiceStore | None, config: ServerConfig
) -> Request:
    """What the worker will speak: a whole text, or a live text's feed (checked as it arrives: an
    empty one fails the utterance, so do a pause over `text_timeout` and a text not ended within
    `text_deadline`), validated with its options, held to the server's token and position limits,
    its seed fixed."""
    limits = config.limits
    if isinstance(text, str):  # tokens first: the most specific refusal for a text too long
        _engine_call(check_text, "text", text)
        check_tokens("input", len(engine.tokenizer.text_ids(text)), limits.max_input_tokens)
    resolved = {**options, "voice": resolve_voice(engine, options.get("voice"), voices)}
    request: Request = _engine_call(
        lambda: engine.request(
            text,
            SynthesisOptions(**resolved),
            position_limit=limits.max_positions,
            text_timeout=config.text_timeout,
            text_deadline=config.text_deadline,
        )
    )
    check_tokens("instructions", len(request.cond.instruct_ids or ()), limits.max_instructions_tokens)
    if request.live is not None:  # a live text is held to the same tokens as it arrives
        request.live.max_tokens = limits.max_input_tokens
    return request


def resolve_voice(engine: Engine, voice: str | None, voices: VoiceStore | None):
    """The `voice=` the engine gets: a preset name as it is; on a Base checkpoint the saved `Voice`."""
    if engine.model_type != "base" or voices is None:
        return voice
    if voice is None:
        raise ApiError(
            400,
            "voice is required: this Base (voice-clone) checkpoint speaks with saved voices; name one "
            f"({voices.describe()}) or create one with POST /v1/audio/voices",
            param="voice",
            code="missing_parameter",
        )
    return voices.get(voice)


def _engine_call(call, *args, **kwargs):
    try:
        return call(*args, **kwargs)
    except ValueError as e:
        raise from_engine(e) from None


def _string(body: dict, name: str, max_chars: int, required: bool = False) -> str | None:
    value = body.get(name)
    if value is None:
        if required:
            raise ApiError(400, f"{name} is required", param=name, code="missing_parameter")
        return None
    if not isinstance(value, str):
        raise ApiError(400, f"{name} must be a string, got {type(value).__name__}", param=name)
    check_length(name, len(value), max_chars)
    return value


def _voice(value) -> str | None:
    """A preset name, OpenAI's `{"id": name}` form, or nothing (VoiceDesign: `""` or absent)."""
    if isinstance(value, dict) and set(value) == {"id"}:
        value = value["id"]
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise ApiError(400, f'voice must be a string or {{"id": name}}, got {json.dumps(value)}', param="voice")
    return value


def _format(value, formats: dict[str, AudioFormat]) -> AudioFormat:
    if value is None:
        value = "mp3" if "mp3" in formats else "wav"  # OpenAI's default when this libsndfile has it
    if isinstance(value, str) and value in formats:
        return formats[value]
    why = " (no AAC encoder without ffmpeg)" if value in UNSUPPORTED else ""
    raise ApiError(
        400,
        f"unsupported response_format {value!r}{why}; choose one of: {', '.join(formats)}",
        param="response_format",
        code="unsupported_format",
    )


def _apply_limits(options: dict, limits: Limits) -> None:
    """Refuse options above the server's limits."""
    for name, limit_name in CAPPED.items():
        value, bound = options.get(name), getattr(limits, limit_name)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue  # absent or of the wrong type: the engine says what is wrong
        if value > bound:
            raise ApiError(
                400,
                f"{name} must be at most {bound} on this server, got {value!r}",
                param=name,
                code="above_server_limit",
            )
