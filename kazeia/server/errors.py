"""OpenAI-style errors: every refusal is `{"error": {"message", "type", "param", "code"}}`.

The engine raises `ValueError` with a message that names the problem and the valid choices; this
module keeps that message, says which request field it is about, and speaks of the HTTP field
names (`instructions`, `input`) rather than the Python ones (`instruct`, `text`).
"""

from __future__ import annotations

import re

from ..sampling import SamplingOptions


class ApiError(Exception):
    """A request the server refuses; `status` is the HTTP status (4xx, or 503 when busy)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str = "invalid_value",
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    @property
    def type(self) -> str:
        return "invalid_request_error" if self.status < 500 else "server_error"

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# Engine message -> the request field it is about (first match wins).
_PARAMS = (
    (re.compile(r"^unknown voice\b|^voice\b|no preset voices|this voice was made|cloned voices need"), "voice"),
    (re.compile(r"^unknown language\b"), "language"),
    (re.compile(r"\binstruct\b"), "instructions"),
    (re.compile(r"^text\b"), "input"),
)


def from_engine(error: ValueError) -> ApiError:
    """The engine's validation error as a 400 naming the field."""
    message = str(error)
    first = message.split(" ", 1)[0]
    param = first if first in SamplingOptions.names() or first in ("seed", "non_streaming_mode") else None
    for pattern, name in _PARAMS if param is None else ():
        if pattern.search(message):
            param = name
            break
    message = re.sub(r"\binstruct\b=?", "instructions", message)
    if message.startswith("text "):
        message = "input " + message[len("text ") :]
    return ApiError(400, message, param=param)
