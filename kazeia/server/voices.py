"""Voices: the list a client picks from, and the saved voices of a Base (voice-clone) checkpoint.

`GET /v1/audio/voices` lists a CustomVoice checkpoint's preset speakers, or a Base checkpoint's
saved voices. On a Base checkpoint, `POST /v1/audio/voices` (multipart: `name`, `audio`, optional
`ref_text` and `x_vector_only`) clones the voice of the uploaded reference audio with
`Engine.create_voice` and saves it as `NAME.voice` in the voices directory; `DELETE
/v1/audio/voices/NAME` removes it. Files outlive the process, so a restarted server on the same
directory offers the same voices.

A request's `voice` on a Base checkpoint is only ever a name: it must match `NAME_PATTERN` (so it
cannot hold a path separator or `..`) and is looked up in that one directory. Names are case-
insensitive (kept in lower case), like the preset speakers.
"""

from __future__ import annotations

import asyncio
import difflib
import logging
import os
import re
import threading
from pathlib import Path
from urllib.parse import parse_qsl

import python_multipart  # noqa: F401  (needed by Starlette's form parser: fail at import, not at upload)
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser

from ..audio import ReferenceLimitError, load_reference_audio
from ..engine import Engine
from ..errors import RequestError
from ..voices import Voice
from .bodies import check_tokens, read_body, refuse_unknown
from .config import Limits
from .errors import ApiError
from .state import server_state

log = logging.getLogger("kazeia.server")
router = APIRouter()
ROUTE = "/v1/audio/voices"
NAME_PATTERN = re.compile(r"[a-z0-9][a-z0-9_-]{0,63}")
NAME_RULE = "1 to 64 letters, digits, '_' or '-', starting with a letter or digit"
SUFFIX = ".voice"
UPLOAD_FIELDS = ("name", "audio", "ref_text", "x_vector_only")


def voice_name(value, param: str = "name") -> str:
    """A client's voice name, checked and in lower case; anything else is a 400."""
    if not isinstance(value, str):
        raise ApiError(400, f"{param} must be a string", param=param)
    name = value.strip().lower()
    if not NAME_PATTERN.fullmatch(name):
        raise ApiError(400, f"{param} {value!r} is not a valid voice name: use {NAME_RULE}", param=param)
    return name


class VoiceStore:
    """The voices directory of a Base checkpoint: `NAME.voice` files written by `Voice.save`.

    Loaded voices are cached per file (modification time, size, inode), so a request does not read
    the file again, and a file replaced or removed by hand is noticed. Thread-safe: voices are
    created in a helper thread, one at a time, while the event loop reads.
    """

    def __init__(self, directory: Path, engine: Engine, limits: Limits):
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"cannot create the voices directory {directory}: {e}") from None
        if not directory.is_dir() or not os.access(directory, os.W_OK | os.X_OK):
            raise ValueError(f"the voices directory {directory} is not a writable directory")
        self.directory, self.engine, self.limits = directory, engine, limits
        self._lock = threading.Lock()  # the cache and the names being created
        self._creating: set[str] = set()
        self._encoding = threading.Lock()  # one reference audio encoded at a time
        self._cache: dict[str, tuple[tuple[int, int, int], Voice]] = {}

    def path(self, name: str) -> Path:
        return self.directory / f"{name}{SUFFIX}"

    def names(self) -> list[str]:
        """Names of the voice files in the directory (files with other names are left alone)."""
        found = (p.name[: -len(SUFFIX)] for p in self.directory.glob(f"*{SUFFIX}") if p.is_file())
        return sorted(n for n in found if NAME_PATTERN.fullmatch(n))

    def describe(self, near: str | None = None) -> str:
        """For messages: how many voices are saved and, for an unknown `near`, a few close names
        (never the whole list, which may be long)."""
        names = self.names()
        if not names:
            return "no voices are saved yet"
        close = difflib.get_close_matches(near, names, n=3, cutoff=0.6) if near else []
        hint = f"; close matches: {', '.join(close)}" if close else ""
        count = f"{len(names)} saved voice{'s' if len(names) > 1 else ''}"
        return f"{count} (GET {ROUTE} lists them){hint}"

    def _load(self, name: str) -> Voice | None:
        """The saved voice `name` (a checked name), None if there is none; ValueError if unreadable."""
        path = self.path(name)
        try:
            st = path.stat()
        except FileNotFoundError:
            with self._lock:
                self._cache.pop(name, None)
            return None
        key = (st.st_mtime_ns, st.st_size, st.st_ino)
        with self._lock:
            hit = self._cache.get(name)
        if hit is not None and hit[0] == key:
            return hit[1]
        voice = Voice.load(path)
        with self._lock:
            self._cache[name] = (key, voice)
        return voice

    def get(self, name: str) -> Voice:
        """The saved voice a request names; an unknown or malformed name is a 400 (never a path)."""
        key = name.strip().lower()
        voice = None
        if NAME_PATTERN.fullmatch(key):
            try:
                voice = self._load(key)
            except ValueError as e:
                log.warning("saved voice %r cannot be read: %s", key, e)
                raise ApiError(
                    500, f"the saved voice {key!r} cannot be read (see the server log)", code="voice_unreadable"
                ) from None
        if voice is None:
            raise ApiError(400, f"unknown voice {name!r}; {self.describe(key)}", param="voice")
        return voice

    def entries(self) -> list[dict]:
        """The voices this checkpoint can speak with; unreadable files and voices made with another
        checkpoint are left out (and logged)."""
        out = []
        for name in self.names():
            try:
                voice = self._load(name)
            except ValueError as e:
                log.warning("saved voice %r cannot be read: %s", name, e)
                continue
            if voice is None:  # removed meanwhile
                continue
            if voice.model != self.engine.cloner.model:
                log.debug("saved voice %r was made with %s; not listed", name, voice.model.describe())
                continue
            out.append(self.entry(name, voice))
        return out

    def entry(self, name: str, voice: Voice) -> dict:
        try:
            created = int(self.path(name).stat().st_mtime)
        except OSError:
            created = None
        entry = {"id": name, "name": name, "object": "voice", "kind": "saved", "mode": voice.mode}
        return {**entry, "ref_text": voice.ref_text, "ref_frames": voice.ref_frames, "created": created}

    def create(self, name: str, audio: bytes, ref_text: str | None, x_vector_only: bool) -> dict:
        """Clone and save a voice (blocking: run it in a thread); 409 if the name is taken."""
        with self._lock:
            if name in self._creating or self.path(name).exists():
                raise _exists(name)
            self._check_room()
            self._creating.add(name)
        try:
            with self._encoding:
                voice = self._clone(audio, ref_text, x_vector_only)
            with self._lock:
                if self.path(name).exists():  # put there by hand meanwhile
                    raise _exists(name)
                try:
                    voice.save(self.path(name))
                except ValueError as e:
                    log.error("cannot save voice %r: %s", name, e)
                    raise ApiError(500, f"the voice {name!r} could not be saved (see the server log)") from None
            log.info("voice %r created (%s, %d reference frames)", name, voice.mode, voice.ref_frames)
            return self.entry(name, voice)
        finally:
            with self._lock:
                self._creating.discard(name)

    def _check_room(self) -> None:
        """Saved voices are bounded in number and in bytes on disk (Limits.max_voices[_bytes])."""
        files = [p for p in self.directory.glob(f"*{SUFFIX}") if p.is_file()]
        size = sum(p.stat().st_size for p in files)
        if len(files) + len(self._creating) >= self.limits.max_voices or size >= self.limits.max_voices_bytes:
            most, mib = self.limits.max_voices, self.limits.max_voices_bytes >> 20
            raise ApiError(
                409,
                f"this server keeps at most {most} voices and {mib} MiB of them "
                f"({len(files)} voices, {size >> 20} MiB now); delete one first",
                param="name",
                code="too_many_voices",
            )

    def _clone(self, data: bytes, ref_text: str | None, x_vector_only: bool) -> Voice:
        rate = self.engine.cloner.encoder.cfg.sample_rate
        try:
            if ref_text is not None:
                tokens = len(self.engine.tokenizer.text_ids(ref_text)) if isinstance(ref_text, str) else 0
                check_tokens("ref_text", tokens, self.limits.max_ref_text_tokens)
            # Bounded from its header before a sample is decoded (duration, rate, channels, size).
            audio = load_reference_audio(data, rate, max_seconds=self.limits.max_reference_s)
            voice = self.engine.create_voice((audio, rate), ref_text=ref_text, x_vector_only=x_vector_only)
            # Its prompt must leave room to speak under the server's position limit.
            self.engine.request("-", voice=voice, max_new_tokens=2, position_limit=self.limits.max_positions)
            return voice
        except ValueError as e:
            param = e.field if isinstance(e, RequestError) else "audio"
            code = "audio_too_long" if isinstance(e, ReferenceLimitError) and e.too_long else "invalid_value"
            raise ApiError(400, str(e), param=param, code=code) from None

    def delete(self, name: str) -> None:
        with self._lock:
            if name in self._creating:
                raise ApiError(409, f"the voice {name!r} is being created; try again", param="name", code="busy")
            try:
                self.path(name).unlink()
            except FileNotFoundError:
                raise ApiError(404, f"unknown voice {name!r}; {self.describe(name)}", code="voice_not_found") from None
            self._cache.pop(name, None)
        log.info("voice %r deleted", name)


def _exists(name: str) -> ApiError:
    return ApiError(
        409,
        f"a voice named {name!r} already exists; delete it first (DELETE {ROUTE}/{name}) or choose another name",
        param="name",
        code="voice_exists",
    )


# -- routes ----------------------------------------------------------------------------------
@router.get(ROUTE)
async def voices(request: Request) -> dict:
    """Preset speakers or saved voices, plus what a client needs to build a request."""
    s = server_state(request)
    engine = s.engine
    instructions = engine.model_type == "voice_design" or engine.cfg.tts_model_size != "0b6"
    if s.voices is not None:
        data = await asyncio.to_thread(s.voices.entries)  # reads files
    else:
        data = [{"id": v, "name": v, "object": "voice", "kind": "preset"} for v in engine.voices]
    return {
        "object": "list",
        "data": data,
        "model_type": engine.model_type,
        "languages": engine.languages,
        "formats": list(s.formats),
        "supports_instructions": instructions,
        "supports_voice_creation": s.voices is not None,
    }


@router.post(ROUTE)
async def create_voice(request: Request) -> JSONResponse:
    s = server_state(request)
    if s.voices is None:
        raise ApiError(
            400,
            f"voice cloning needs a Base checkpoint; this server serves a {s.engine.model_type} checkpoint",
            code="unsupported_model",
        )
    content_type = request.headers.get("content-type", "").lower()
    if not content_type.startswith(("multipart/form-data", "application/x-www-form-urlencoded")):
        raise ApiError(
            415,
            "send a voice as multipart/form-data with the fields name, audio (a file) and, optionally, "
            "ref_text and x_vector_only",
            code="unsupported_media_type",
        )
    body = await read_body(request, s.config.limits.max_upload_bytes)
    name, audio, ref_text, x_vector_only = await _upload(request, body)
    entry = await asyncio.to_thread(s.voices.create, name, audio, ref_text, x_vector_only)
    return JSONResponse(entry, status_code=201)


@router.delete(ROUTE + "/{name}")
async def delete_voice(request: Request, name: str) -> dict:
    s = server_state(request)
    if s.voices is None:
        raise ApiError(
            404,
            f"this server has no saved voices: it serves a {s.engine.model_type} checkpoint",
            code="voice_not_found",
        )
    key = voice_name(name, "name")
    s.voices.delete(key)
    return {"id": key, "object": "voice", "deleted": True}


async def _upload(request: Request, body: bytes) -> tuple[str, bytes, str | None, bool]:
    """The fields of a voice upload: (name, audio bytes, ref_text, x_vector_only)."""

    async def chunks():
        yield body

    form = None
    try:
        if request.headers.get("content-type", "").lower().startswith("multipart/form-data"):
            parser = MultiPartParser(request.headers, chunks(), max_files=1, max_fields=8, max_part_size=64 * 1024)
            form = await parser.parse()
            items: list[tuple[str, object]] = list(form.multi_items())
        else:  # a form without the file (the body is bounded already): parsed to say what is missing
            items = list(parse_qsl(body.decode("utf-8", "replace"), keep_blank_values=True, max_num_fields=8))
    except MultiPartException as e:
        raise ApiError(400, f"the multipart body cannot be read: {e.message}", code="invalid_multipart") from None
    except ValueError as e:  # parse_qsl: too many fields
        raise ApiError(400, f"the form cannot be read: {e}", code="invalid_multipart") from None
    try:
        fields: dict[str, object] = {}
        for key, value in items:
            refuse_unknown({key: value}, UPLOAD_FIELDS, "a voice upload")
            if key in fields:
                raise ApiError(400, f"the field {key!r} is given twice", param=key)
            fields[key] = value
        if "name" not in fields:
            raise ApiError(400, "name is required", param="name", code="missing_parameter")
        if not isinstance(fields["name"], str):
            raise ApiError(400, "name must be a text field, not a file", param="name")
        name = voice_name(fields["name"])
        audio = fields.get("audio")
        if audio is None:
            raise ApiError(400, "audio, the reference audio file, is required", param="audio", code="missing_parameter")
        if not isinstance(audio, UploadFile):
            raise ApiError(400, "audio must be a file (multipart file field)", param="audio")
        data = await audio.read()
        ref_text = fields.get("ref_text")
        if ref_text is not None and not isinstance(ref_text, str):
            raise ApiError(400, "ref_text must be a text field, not a file", param="ref_text")
        if ref_text is not None and not ref_text.strip():
            ref_text = None  # an empty form field is an absent one
        return name, data, ref_text, _flag(fields.get("x_vector_only"))
    finally:
        if form is not None:
            await form.close()


def _flag(value) -> bool:
    if value is None:
        return False
    if isinstance(value, str) and value.strip().lower() in ("true", "1", "yes", "on", "false", "0", "no", "off", ""):
        return value.strip().lower() in ("true", "1", "yes", "on")
    shown = "a file" if not isinstance(value, str) else repr(value)
    raise ApiError(400, f"x_vector_only must be true or false, got {shown}", param="x_vector_only")
