"""The saved voices of a Base (voice-clone) checkpoint: `NAME.voice` files in one directory.

`VoiceStore` clones a voice from uploaded reference audio (`Engine.create_voice`), saves it as
`NAME.voice` (written to a temporary name, then renamed), lists, loads and deletes them. Files outlive
the process, so a restarted server on the same directory offers the same voices. A request's `voice`
on a Base checkpoint is only ever a name: it must match `NAME_PATTERN` (so it cannot hold a path
separator or `..`) and is looked up in that one directory. Names are case-insensitive (kept in lower
case), like the preset speakers. Non-goals: the HTTP routes (server/voices.py).
"""

from __future__ import annotations

import difflib
import logging
import os
import re
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..audio import ReferenceLimitError
from ..engine import Engine
from ..errors import RequestError
from ..request import voice_fits
from ..voices import Voice
from .bodies import check_tokens
from .config import Limits
from .errors import ApiError

log = logging.getLogger("kazeia.server")
ROUTE = "/v1/audio/voices"
NAME_PATTERN = re.compile(r"[a-z0-9][a-z0-9_-]{0,63}")
NAME_RULE = "1 to 64 letters, digits, '_' or '-', starting with a letter or digit"
SUFFIX = ".voice"


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
        # One reference audio encoded at a time, in a thread of its own: an upload waiting for its
        # turn holds none of the event loop's helper threads (voice lists, shutdown use them).
        self.encoder = ThreadPoolExecutor(1, thread_name_prefix="kazeia-voices")
        self._encoding = threading.Lock()  # (and one at a time when `create` is called otherwise)
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
            if voice.model != self.engine.runtime.cloner.model:
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
        """Clone and save a voice (blocking: run it in `self.encoder`, one at a time); 409 if the
        name is taken, by this process or any other sharing the directory."""
        with self._lock:
            if name in self._creating or self.path(name).exists():
                raise _exists(name)
            self._check_room()
            self._creating.add(name)
        try:
            with self._encoding:
                voice = self._clone(audio, ref_text, x_vector_only)
            self._publish(name, voice)
            log.info("voice %r created (%s, %d reference frames)", name, voice.mode, voice.ref_frames)
            return self.entry(name, voice)
        finally:
            with self._lock:
                self._creating.discard(name)

    def _publish(self, name: str, voice: Voice) -> None:
        """Write the voice whole under a private name, then give it its name with a hard link, which
        fails if the name exists: of processes creating one name at once, exactly one succeeds. The
        count is checked again once it is there; a voice over the limits is taken back (409)."""
        part = self.directory / f".{name}.{uuid.uuid4().hex}.part"  # never listed (no SUFFIX)
        try:
            try:
                voice.save(part)
                os.link(part, self.path(name))
            except FileExistsError:
                raise _exists(name) from None
            except (OSError, ValueError) as e:
                log.error("cannot save voice %r: %s", name, e)
                raise ApiError(500, f"the voice {name!r} could not be saved (see the server log)") from None
        finally:
            part.unlink(missing_ok=True)
        try:
            self._check_room(new=name)
        except ApiError:
            self.path(name).unlink(missing_ok=True)
            raise

    def _check_room(self, new: str | None = None) -> None:
        """Saved voices are bounded in number and in bytes on disk (Limits.max_voices[_bytes]), counted
        from the directory, so that every process sharing it keeps one bound. `new`: a voice just
        given its name, checked again against the others (two processes may have passed at once)."""
        skip = self.path(new) if new else None
        files = [p for p in self.directory.glob(f"*{SUFFIX}") if p.is_file() and p != skip]
        size = sum(_size(p) for p in files)
        pending = 0 if new else len(self._creating)
        if len(files) + pending >= self.limits.max_voices or size >= self.limits.max_voices_bytes:
            most, mib = self.limits.max_voices, self.limits.max_voices_bytes >> 20
            raise ApiError(
                409,
                f"this server keeps at most {most} voices and {mib} MiB of them "
                f"({len(files)} voices, {size >> 20} MiB now); delete one first",
                param="name",
                code="too_many_voices",
            )

    def _clone(self, data: bytes, ref_text: str | None, x_vector_only: bool) -> Voice:
        try:
            if ref_text is not None:
                tokens = len(self.engine.tokenizer.text_ids(ref_text)) if isinstance(ref_text, str) else 0
                check_tokens("ref_text", tokens, self.limits.max_ref_text_tokens)
            # Decoded once, bounded from its header before a sample is decoded (duration, rate, channels, size).
            voice = self.engine.create_voice(
                data, ref_text=ref_text, x_vector_only=x_vector_only, max_seconds=self.limits.max_reference_s
            )
            voice_fits(self.engine.runtime.caps, voice, self.limits.max_positions)  # room to speak
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


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:  # deleted by another process meanwhile
        return 0


def _exists(name: str) -> ApiError:
    return ApiError(
        409,
        f"a voice named {name!r} already exists; delete it first (DELETE {ROUTE}/{name}) or choose another name",
        param="name",
        code="voice_exists",
    )
