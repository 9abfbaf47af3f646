"""Who may talk to the server: the Host a request names, the page it comes from, its API key.

A server on 127.0.0.1 is still reachable from every web page its user opens. So, before any route:

* `allowed_hosts` (set by `kazeia serve` when it binds a loopback address): a request whose Host
  header is another name is refused (421), which defeats DNS rebinding (a page on evil.example
  whose name now resolves to 127.0.0.1 still sends `Host: evil.example`).
* A request with an `Origin` header (browsers send one on cross-site requests and on every
  WebSocket) must come from the server's own origin or one of `allowed_origins` (403; a WebSocket
  is refused before it is accepted). Clients that are not browsers send no Origin.
* With an `api_key`, every route but the demo page and /health needs `Authorization: Bearer KEY`
  (as OpenAI's clients send it; a WebSocket may pass `?api_key=KEY` instead, browsers cannot set
  its headers), compared in constant time (401 otherwise).

CORS headers are only sent for `allowed_origins` (server/app.py), so other pages cannot read any
response. Tensors and the engine never see any of this.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import re
from urllib.parse import parse_qs, unquote_plus, urlsplit

from .config import ServerConfig
from .errors import ApiError
from .wire import text

PUBLIC_PATHS = ("/", "/health")  # no key needed: the demo page (static, no data) and liveness probes
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def loopback_hosts(host: str) -> tuple[str, ...] | None:
    """The Host names to accept when listening on `host`: the loopback names and `host` itself
    when it is a loopback address or name (127.0.0.2, ::ffff:127.0.0.1 too), None (any) otherwise."""
    name = host.strip("[]").lower()
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        return LOOPBACK_NAMES if name == "localhost" else None
    mapped = address.ipv4_mapped if isinstance(address, ipaddress.IPv6Address) else None
    if not (address.is_loopback or (mapped is not None and mapped.is_loopback)):
        return None
    return tuple(dict.fromkeys((*LOOPBACK_NAMES, name, str(address))))


def _host_name(host: str) -> str:
    """`Host` header -> its name without the port ("[::1]:8000" -> "::1")."""
    if host.startswith("["):
        return host[1 : host.find("]")].lower() if "]" in host else host.lower()
    return host.rsplit(":", 1)[0].lower() if host.count(":") == 1 else host.lower()


class AccessGuard:
    """ASGI middleware applying the rules above to HTTP requests and WebSocket handshakes."""

    def __init__(self, app, config: ServerConfig):
        self.app, self.config = app, config
        self.key = config.api_key.encode() if config.api_key else None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        error = self._check(scope, headers)
        if error is None:
            await self.app(scope, receive, send)
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008, "reason": close_reason(error.message)})
        else:
            await _respond(send, error)

    def _check(self, scope, headers: dict[str, str]) -> ApiError | None:
        host = headers.get("host", "")
        allowed = self.config.allowed_hosts
        if allowed is not None and _host_name(host) not in allowed:
            return ApiError(
                421, f"this server answers to {', '.join(allowed)} only, not {host!r}", code="host_not_allowed"
            )
        origin = headers.get("origin")
        if origin is not None and not self._origin_allowed(origin, host):
            return ApiError(403, f"requests from the page at {origin!r} are not allowed", code="origin_not_allowed")
        preflight = (
            scope["type"] == "http" and scope.get("method") == "OPTIONS" and "access-control-request-method" in headers
        )
        if self.key is not None and scope.get("path") not in PUBLIC_PATHS and not preflight:
            if not self._key_given(scope, headers):
                return ApiError(
                    401,
                    "a valid API key is required: send Authorization: Bearer KEY",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
        return None

    def _origin_allowed(self, origin: str, host: str) -> bool:
        allowed = self.config.allowed_origins
        if "*" in allowed or origin in allowed:
            return True
        return urlsplit(origin).netloc.lower() == host.lower() != ""  # the server's own pages

    def _key_given(self, scope, headers: dict[str, str]) -> bool:
        """Whether the request carries the key: the bytes of a Bearer token (headers are read as
        latin-1, so a key beyond ASCII arrives as its UTF-8 bytes), or of the `api_key` query value
        (percent-decoded) of a WebSocket, equal to the key's UTF-8 bytes."""
        assert self.key is not None
        given = b""
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer":
            given = token.strip().encode("latin-1")
        elif scope["type"] == "websocket":
            query = scope.get("query_string", b"").decode("latin-1")
            given = parse_qs(query, encoding="latin-1").get("api_key", [""])[0].encode("latin-1")
        return hmac.compare_digest(given, self.key)


class RedactKeys(logging.Filter):
    """Replace the value of every `api_key` query parameter in log lines (uvicorn logs WebSocket
    paths with their query) by ***, however its name is spelled (`api%5Fkey` decodes to it too)."""

    PAIR = re.compile(r"(?<=[?&\s\"'])([^=&?\s\"']+)=([^&\s\"']*)")

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(self.redact(a) if isinstance(a, str) else a for a in record.args)
        elif isinstance(record.args, dict):
            record.args = {k: self.redact(a) if isinstance(a, str) else a for k, a in record.args.items()}
        if isinstance(record.msg, str):
            record.msg = self.redact(record.msg)
        return True

    @classmethod
    def redact(cls, line: str) -> str:
        def pair(match: re.Match) -> str:
            name = unquote_plus(match.group(1), encoding="latin-1").lower()
            return f"{match.group(1)}=***" if name == "api_key" else match.group(0)

        return cls.PAIR.sub(pair, " " + line)[1:]


def close_reason(message: str) -> str:
    """A WebSocket close reason: at most 123 bytes of UTF-8, client text escaped (wire.py)."""
    return text(message).encode("utf-8")[:120].decode("utf-8", "ignore")


async def _respond(send, error: ApiError) -> None:
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in error.headers.items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
