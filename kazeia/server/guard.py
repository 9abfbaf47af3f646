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
from urllib.parse import parse_qs, urlsplit

from .config import ServerConfig
from .errors import ApiError

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
            await send({"type": "websocket.close", "code": 1008, "reason": error.message[:120]})
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
        assert self.key is not None
        given = ""
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer":
            given = token.strip()
        elif scope["type"] == "websocket":
            given = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("api_key", [""])[0]
        return hmac.compare_digest(given.encode(), self.key)


class RedactKeys(logging.Filter):
    """Replace `api_key=...` in log lines (uvicorn logs WebSocket paths with their query) by ***."""

    PATTERN = re.compile(r"(api_key=)[^&\s\"']+", re.IGNORECASE)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.args:
            args = record.args if isinstance(record.args, tuple) else (record.args,)
            record.args = tuple(self.PATTERN.sub(r"\1***", a) if isinstance(a, str) else a for a in args)
        if isinstance(record.msg, str):
            record.msg = self.PATTERN.sub(r"\1***", record.msg)
        return True


async def _respond(send, error: ApiError) -> None:
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in error.headers.items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
