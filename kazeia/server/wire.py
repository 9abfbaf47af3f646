"""What the server writes back: client text made safe to echo, and JSON that always encodes.

A client may send any JSON string, lone surrogates ("\\ud800") included, and no UTF-8 encoder takes
those: echoed as they are into an error message, an event, a header or a log line, they make the
write itself fail (a 500 in place of a 400, a dropped socket). Everything the server writes that may
hold client text goes through this module: `text` spells such characters as the escape `\\ud800`
(what the client sent, visibly), `shown` also bounds the length of a value quoted in a message, and
`dumps` / `clean` make JSON whose strings are all encodable and whose numbers are all finite.
Non-goals: what is refused (bodies.py, params.py).
"""

from __future__ import annotations

import json
import logging
import math

SHOWN_CHARS = 64  # characters of a client's value quoted in a message at most


def text(value: str) -> str:
    """`value` with every character UTF-8 cannot encode (a lone surrogate) written as its escape."""
    try:
        value.encode("utf-8")
        return value
    except UnicodeEncodeError:
        return value.encode("utf-8", "backslashreplace").decode("utf-8")


def shown(value, limit: int = SHOWN_CHARS) -> str:
    """A client's value quoted in a message: its `repr` (lone surrogates escaped), a string or a
    container cut to `limit` characters with its length said, so that a megabyte sent is never a
    megabyte echoed."""
    if isinstance(value, str) and len(value) > limit:
        return f"{value[:limit]!r}... ({len(value)} characters)"
    quoted = repr(value) if isinstance(value, str) else json.dumps(clean(value), ensure_ascii=False)
    if len(quoted) > limit + 2:
        return f"{quoted[:limit]}... ({len(quoted)} characters)"
    return text(quoted)


def clean(value):
    """A JSON value whose strings (keys included) are `text`-safe and whose non-finite numbers are null."""
    if isinstance(value, str):
        return text(value)
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {text(str(k)): clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    return value


def dumps(value) -> str:
    """Compact JSON of `value` that always encodes as UTF-8 (`clean`)."""
    return json.dumps(clean(value), ensure_ascii=False, allow_nan=False, separators=(",", ":"))


class SafeLog(logging.Filter):
    """Escapes what UTF-8 cannot encode in a log record's message and arguments, so that client text
    in a log line never makes the handler fail."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str):
            record.msg = text(record.msg)
        if isinstance(record.args, tuple):
            record.args = tuple(text(a) if isinstance(a, str) else a for a in record.args)
        elif isinstance(record.args, dict):
            record.args = {k: text(a) if isinstance(a, str) else a for k, a in record.args.items()}
        return True


def filter_logs(*filters: logging.Filter, loggers: tuple[str, ...] = ("", "uvicorn", "uvicorn.access")) -> None:
    """Add `filters` (and SafeLog) to the handlers of `loggers` (the root's and uvicorn's by
    default), so that they see every record those handlers write, propagated ones included."""
    handlers = {h for name in loggers for h in logging.getLogger(name).handlers}
    for handler in handlers:
        for f in (SafeLog(), *filters):
            handler.addFilter(f)
