"""OpenAI-style errors: every refusal is `{"error": {"message", "type", "param", "code"}}`.

The engine raises `RequestError` (a ValueError) with a message that names the problem and the valid
choices and a `field` naming the argument; this module keeps that message, reports the field as
`param`, and speaks of the HTTP field names (`instructions`, `input`) rather than the Python ones
(`instruct`, `text`).
"""

from __future__ import annotations

import re

from ..errors import RequestError


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


# Engine argument -> the request field that carries it (the others have the same name).
FIELDS = {"instruct": "instructions", "text": "input"}


def from_engine(error: ValueError) -> ApiError:
    """The engine's validation error as a 400 naming the field (`RequestError.field`), its message
    speaking of the HTTP field names."""
    message = str(error)
    field = getattr(error, "field", None)
    param = FIELDS.get(field, field) if isinstance(error, RequestError) else None
    message = re.sub(r"\binstruct\b=?", "instructions", message)
    if message.startswith("text "):
        message = "input " + message[len("text ") :]
    return ApiError(400, message, param=param)
