"""Voices over HTTP: the list a client picks from, and a Base checkpoint's saved voices.

`GET /v1/audio/voices` lists a CustomVoice checkpoint's preset speakers, or a Base checkpoint's
saved voices. On a Base checkpoint, `POST /v1/audio/voices` (multipart: `name`, `audio`, optional
`ref_text` and `x_vector_only`) clones the voice of the uploaded reference audio and saves it
(server/store.py); `DELETE /v1/audio/voices/NAME` removes it.
"""

from __future__ import annotations

import asyncio
from urllib.parse import parse_qsl

import python_multipart  # noqa: F401  (needed by Starlette's form parser: fail at import, not at upload)
from fastapi import APIRouter, Request, Response
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser

from .bodies import read_body, refuse_unknown
from .errors import ApiError
from .state import server_state
from .store import ROUTE, voice_name
from .wire import dumps

router = APIRouter()
UPLOAD_FIELDS = ("name", "audio", "ref_text", "x_vector_only")


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
async def create_voice(request: Request) -> Response:
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
    limits = s.config.limits
    if s.uploads.locked():  # each holds its body (up to max_upload_bytes) until it is encoded
        raise ApiError(
            503,
            f"{limits.max_uploads} voice uploads are under way; try again shortly",
            code="busy",
            headers={"Retry-After": "5"},
        )
    async with s.uploads:
        body = await read_body(request, limits.max_upload_bytes, limits.max_body_s)
        name, audio, ref_text, x_vector_only = await _upload(request, body)
        del body
        loop = asyncio.get_running_loop()
        entry = await loop.run_in_executor(s.voices.encoder, s.voices.create, name, audio, ref_text, x_vector_only)
    return Response(dumps(entry), status_code=201, media_type="application/json")


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
