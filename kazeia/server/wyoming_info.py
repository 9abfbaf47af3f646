"""What the Wyoming server offers and how it reads its clients (server/wyoming.py speaks the events).

`Catalog`: the `info` answer (one TtsProgram, its voices and their languages), and a request's
`voice` (name, language, speaker) mapped onto Kazeia's voice and language with the server's defaults.
`read_event`: one event off the connection, bounded in size, a malformed one refused without losing
the events after it. `announce`: the service on the LAN over mDNS (zeroconf). Non-goals: anything
but text to speech.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from wyoming.event import Event
from wyoming.info import Attribution, Info, TtsProgram, TtsVoice

from .. import __version__
from ..engine import Engine
from .bodies import check_values, json_object
from .config import ServerConfig, WyomingSettings
from .errors import ApiError
from .params import session_fields, session_options

if TYPE_CHECKING:
    from .store import VoiceStore

log = logging.getLogger("kazeia.wyoming")
PROGRAM = "kazeia"  # the TtsProgram's name; a request's voice.name may also name it (then: the default voice)
DESIGN_VOICE = "designed"  # the one voice of a VoiceDesign checkpoint: the one its --instruct describes
QWEN = Attribution(name="Qwen team, Alibaba Cloud (Qwen3-TTS)", url="https://github.com/QwenLM/Qwen3-TTS")
# Kazeia's language names -> the ISO 639-1 codes Home Assistant lists languages by.
LANGUAGE_CODES = {
    "chinese": "zh",
    "english": "en",
    "french": "fr",
    "german": "de",
    "italian": "it",
    "japanese": "ja",
    "korean": "ko",
    "portuguese": "pt",
    "russian": "ru",
    "spanish": "es",
}


class Catalog:
    """The voices and languages of one engine, as Wyoming names them, and the server's defaults
    (checked once, at start: a bad default is a ValueError before any client connects)."""

    def __init__(self, engine: Engine, config: ServerConfig, settings: WyomingSettings, voices: VoiceStore | None):
        self.engine, self.config, self.settings, self.voices = engine, config, settings, voices
        self.languages = [lang for lang in engine.languages if lang != "auto"]
        no_voice = engine.model_type == "base" and self.default_voice() is None  # none saved yet
        try:
            given = settings.options
            language = None if given.language is None else self.language(given.language)
            body = {**session_fields(given), "language": language}
            voice = None if no_voice else self.voice(None, None)
            options = session_options({**body, "voice": voice}, engine, config.limits, voices, check=not no_voice)
        except ApiError as error:
            raise ValueError(error.message) from None
        options.pop("voice")
        self.defaults = options

    def code(self, language: str) -> str:
        return LANGUAGE_CODES.get(language, language)

    def language(self, value: str) -> str:
        """Kazeia's name for a Wyoming language: a name ("english"), a code ("en", "en-US", "en_GB") or auto."""
        wanted = value.strip().lower().replace("_", "-")
        if wanted == "auto" or wanted in self.languages:
            return wanted
        for name in self.languages:
            if self.code(name) == wanted.split("-")[0]:
                return name
        choices = ", ".join(f"{self.code(name)} ({name})" for name in self.languages)
        raise ApiError(400, f"unknown language {value!r}; choose one of: {choices}, or auto", param="language")

    def names(self) -> list[str]:
        """The voices' names, in the order `info` lists them."""
        if self.engine.model_type == "voice_design":
            return [DESIGN_VOICE]
        return self.voices.names() if self.voices is not None else self.engine.voices

    def default_voice(self) -> str | None:
        """The server's --voice, else the first voice listed (None: a Base checkpoint with none saved)."""
        names = self.names()
        return self.settings.options.voice or (names[0] if names else None)

    def voice(self, name: str | None, speaker: str | None) -> str | None:
        """The voice a request names (its speaker, else its name, else the server's default), as
        the engine's `voice=` takes it (a VoiceDesign checkpoint's is None: --instruct describes it)."""
        if name is not None and speaker is not None and name.strip().lower() not in (speaker.strip().lower(), PROGRAM):
            raise ApiError(400, f"voice {name!r} has no speaker {speaker!r}: each voice is one speaker", param="voice")
        wanted = speaker if speaker is not None else name
        if wanted is None or wanted.strip().lower() == PROGRAM:
            wanted = self.default_voice()
        if self.engine.model_type == "voice_design":
            if wanted.strip().lower() != DESIGN_VOICE:  # type: ignore[union-attr]  (names() has one)
                raise ApiError(400, f"unknown voice {wanted!r}; this VoiceDesign checkpoint speaks {DESIGN_VOICE!r}")
            return None
        if wanted is None and self.voices is not None:
            where = self.voices.directory
            raise ApiError(400, f"no voice is saved in {where} yet: `kazeia voices create` one there", param="voice")
        return wanted

    def options(self, data: dict) -> dict:
        """The engine options of a synthesize or synthesize-start event: its voice and language
        over the server's defaults. Fields the protocol has and this server does not use
        (`context`) are left alone, as Wyoming asks of servers; plain text only."""
        text_format = data.get("text_format")
        if text_format not in (None, "text"):
            raise ApiError(400, f"text_format {text_format!r} is not supported: send plain text", param="text_format")
        voice = data.get("voice") or {}
        if not isinstance(voice, dict):
            raise ApiError(400, "voice must be an object of name, language and speaker", param="voice")
        for key in ("name", "language", "speaker"):
            if voice.get(key) is not None and not isinstance(voice[key], str):
                raise ApiError(400, f"voice.{key} must be a string", param=f"voice.{key}")
        options = {**self.defaults, "voice": self.voice(voice.get("name"), voice.get("speaker"))}
        if voice.get("language") is not None:
            options["language"] = self.language(voice["language"])
        # One layout for a whole text and a streamed one (the one live text reads as it arrives),
        # so that Home Assistant hears the same utterance either way.
        options.setdefault("non_streaming_mode", False)
        return options

    def info(self) -> Info:
        """The answer to describe (reads the saved voices' files: call it in a thread)."""
        codes = [self.code(name) for name in self.languages]
        voices = [
            TtsVoice(name=name, attribution=QWEN, installed=True, description=about, version=None, languages=codes)
            for name, about in self._voices()
        ]
        program = TtsProgram(
            name=PROGRAM,
            attribution=QWEN,
            installed=True,
            description=f"Qwen3-TTS {self.config.model_name} in Kazeia: speaks text while it is still arriving",
            version=__version__,
            voices=voices,
            supports_synthesize_streaming=True,
        )
        return Info(tts=[program])

    def _voices(self) -> list[tuple[str, str]]:
        """(name, description) of each voice."""
        if self.engine.model_type == "voice_design":
            return [(DESIGN_VOICE, f"Designed: {self.settings.options.instruct}")]
        if self.voices is not None:
            return [(e["name"], f"Cloned voice {e['name']} ({e['mode']})") for e in self.voices.entries()]
        return [(name, name.replace("_", " ").title()) for name in self.engine.voices]


async def read_event(reader: asyncio.StreamReader, limit: int, max_chars: int | None = None) -> Event | None:
    """The next event, or None once the client has closed the connection. An event that is not
    well formed or over `limit` bytes (data and payload), or with a string over `max_chars` outside
    its text (`bodies.json_object`), is an ApiError once its bytes have been read past, so the event
    after it can still be read."""
    line = await _line(reader)
    if line is None:
        return None
    header = json_object(line, "event header")
    sizes = [header.get("data_length") or 0, header.get("payload_length") or 0]
    if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in sizes):
        raise ApiError(400, "data_length and payload_length must be whole numbers of bytes", code="invalid_event")
    if sum(sizes) > limit:
        await _skip(reader, sum(sizes))
        raise ApiError(413, f"an event of {sum(sizes)} bytes; the limit is {limit}", code="event_too_large")
    extra = await reader.readexactly(sizes[0]) if sizes[0] else b""
    payload = await reader.readexactly(sizes[1]) if sizes[1] else None
    kind, data = header.get("type"), header.get("data") or {}
    if not isinstance(kind, str) or not isinstance(data, dict):
        raise ApiError(400, "an event needs a type (a string) and data (an object)", code="invalid_event")
    if extra:
        data = {**data, **json_object(extra, "event data")}
    check_values(data, max_chars)
    return Event(kind, data, payload)


async def _line(reader: asyncio.StreamReader) -> bytes | None:
    """One header line (the reader's limit bounds it: a longer one is dropped piece by piece)."""
    try:
        return await reader.readuntil(b"\n")
    except asyncio.IncompleteReadError:  # the end of the stream, possibly within a line
        return None
    except asyncio.LimitOverrunError as overrun:
        consumed = overrun.consumed
    while True:  # drop what is buffered, up to the newline when it is already there
        await reader.readexactly(consumed)
        try:
            await reader.readuntil(b"\n")
            break
        except asyncio.LimitOverrunError as overrun:
            consumed = overrun.consumed
    raise ApiError(413, "an event header line is too long", code="event_too_large")


async def _skip(reader: asyncio.StreamReader, count: int) -> None:
    """Read past `count` bytes without keeping them."""
    while count > 0:
        chunk = await reader.read(min(count, 1 << 16))
        if not chunk:
            raise asyncio.IncompleteReadError(b"", count)
        count -= len(chunk)


async def announce(uri: str, name: str) -> None:
    """Register the TCP service over mDNS for Home Assistant's discovery (the zeroconf package)."""
    from urllib.parse import urlsplit

    parts = urlsplit(uri)
    if parts.scheme != "tcp" or parts.port is None:
        raise ValueError("--zeroconf announces a tcp:// URI with a port")
    try:
        from wyoming.zeroconf import HomeAssistantZeroconf
    except ImportError:
        raise ValueError("--zeroconf needs the zeroconf package (LGPL-2.1): pip install zeroconf") from None
    host = parts.hostname if parts.hostname not in ("0.0.0.0", "::", "") else None
    await HomeAssistantZeroconf(parts.port, name or None, host).register_server()
    log.info("announced over zeroconf as %s", name or "this machine")
