"""Reading what a client sends: bounded bodies, JSON objects, and the one rule for unknown fields.

Shared by the HTTP routes and the WebSocket so that each refusal is written once: a body over its
byte limit is a 413, one that is not JSON (or too deeply nested to parse) a 400, a JSON endpoint
called without `Content-Type: application/json` a 415 (a browser's cross-site "simple request"
cannot set that type without asking first), an unknown field a 400 naming it.
"""

from __future__ import annotations

import json
import math

import anyio
from starlette.requests import Request as HttpRequest

from .errors import ApiError
from .wire import shown, text


async def read_body(request: HttpRequest, limit: int, seconds: float) -> bytes:
    """The whole request body, refused with 413 as soon as it is known to be over `limit` bytes,
    and with 408 if it has not all arrived within `seconds` (a body trickled in forever would hold
    its connection and its handler)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the request body is {declared} bytes; the limit is {limit}", code="body_too_large")
    chunks, size, whole = [], 0, False
    with anyio.move_on_after(seconds):
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"the request body is over the limit of {limit} bytes", code="body_too_large")
            chunks.append(chunk)
        whole = True  # (not `cancelled_caught`: anyio 3, the floor, lacks it)
    if not whole:
        raise ApiError(408, f"the request body did not arrive within {seconds:g} s", code="body_timeout")
    return b"".join(chunks)


def require_json(request: HttpRequest) -> None:
    """A JSON endpoint's body must say it is JSON."""
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type != "application/json":
        shown = media_type or "none"
        raise ApiError(
            415, f"send the body as Content-Type: application/json (got {shown})", code="unsupported_media_type"
        )


# Fields holding a text, bounded by limits of their own (characters and tokens); every other string
# (names, formats, keys) is bounded by `max_chars` in `json_object`.
TEXT_FIELDS = ("input", "instructions", "text")


def json_object(raw: bytes | str, what: str = "request body", max_chars: int | None = None) -> dict:
    """Parse a JSON object; anything else is a 400, and so is a number that is not finite or
    (with `max_chars`) a string or key longer than that outside TEXT_FIELDS: checked before any
    other work looks at a value, so no name of a megabyte reaches a lookup or a message."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise ApiError(400, f"the {what} is nested too deeply", code="invalid_json") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an integer over Python's digit limit
        raise ApiError(400, f"the {what} is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the {what} must be a JSON object, got {type(body).__name__}", code="invalid_json")
    check_values(body, max_chars)
    return body


def check_values(body: dict, max_chars: int | None) -> None:
    """A 400 naming the field of the first number that is not finite (Python's reader takes NaN,
    Infinity and -Infinity, and 1e400 reads as infinity: no field takes one), or of the first
    string or key over `max_chars` characters outside TEXT_FIELDS."""
    stack: list[tuple[str, str, str, object]] = [(text(k), text(k), k, v) for k, v in body.items()]
    while stack:  # (the top-level field, where the value lies in it, its own key, the value)
        field, path, key, value = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            spelled = "NaN" if math.isnan(value) else ("-Infinity" if value < 0 else "Infinity")
            message = f"{shown(path)} is {spelled}; numbers must be finite"
            raise ApiError(400, message, param=field, code="invalid_number")
        if max_chars is not None and key not in TEXT_FIELDS:
            for string, what in ((key, "a key"), (value, "the value")):
                if isinstance(string, str) and len(string) > max_chars:
                    message = f"{what} of {shown(path)} is {len(string)} characters long; at most {max_chars} here"
                    raise ApiError(400, message, param=field, code="string_above_max_length")
        if isinstance(value, dict):
            stack += [(field, f"{path}.{text(str(k))}", str(k), v) for k, v in value.items()]
        elif isinstance(value, list):
            stack += [(field, f"{path}[{i}]", "", v) for i, v in enumerate(value)]


def refuse_unknown(body: dict, known: tuple[str, ...], where: str = "", ignore: tuple[str, ...] = ()) -> None:
    """A 400 naming the first field of `body` that is neither `known` nor in `ignore`."""
    for name in body:
        if name not in known and name not in ignore:
            place = f" in {where}" if where else ""
            raise ApiError(
                400,
                f"unknown parameter {shown(name)}{place}; valid parameters: {', '.join((*ignore, *known))}",
                param=text(name),
                code="unknown_parameter",
            )


def check_length(param: str, length: int, limit: int, subject: str | None = None) -> None:
    """The server's one "too long" rule: a text of `length` characters over `limit` is a 400
    naming the field (`subject` describes it where the field name alone would not)."""
    if length > limit:
        what = f"{subject} would be" if subject else f"{param} is"
        raise ApiError(
            400,
            f"{what} {length} characters long; this server accepts at most {limit}",
            param=param,
            code="string_above_max_length",
        )


def check_tokens(param: str, tokens: int, limit: int) -> None:
    """The token rule beside the character one: a text over `limit` tokens is a 400 naming it."""
    if tokens > limit:
        raise ApiError(
            400,
            f"{param} is {tokens} tokens long; this server accepts at most {limit}",
            param=param,
            code="string_above_max_length",
        )
