"""The error a refused input raises, carrying the argument it is about."""

from __future__ import annotations


class RequestError(ValueError):
    """A synthesis or voice input refused before any work; the message names the problem and the
    valid choices, `field` the argument by its Python name (`text`, `voice`, `instruct`, `top_k`...),
    so front ends can point at their own field without reading the message."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def check_text(field: str, value: str) -> None:
    """A string the tokenizer can take: encodable as UTF-8 (no lone surrogates)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(
            field, f"{field} is not valid Unicode: {value[e.start]!r} at character {e.start} is a lone surrogate"
        ) from None
