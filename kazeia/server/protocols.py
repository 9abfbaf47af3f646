"""uvicorn's connection protocols, with bounds on a client that stops reading or never asks.

uvicorn waits without a deadline for a peer to take what was written to it (its `send` awaits the
transport's drain), and `transport.close()` itself waits until the buffered bytes are sent; an HTTP
connection that never sends a request is kept as long as it stays open. Each holds one of the
`--max-connections` slots, so a few dozen silent clients would get everyone else a 503. The
protocols made here (`bounded_protocols`) add two rules to uvicorn's own:

* a peer that takes none of the bytes waiting for it for `stall_s` seconds (the transport stays
  paused that long) is dropped: `transport.abort()`, its unsent bytes discarded;
* an HTTP connection that has not sent a whole request head within `stall_s` of opening is dropped
  (between requests uvicorn's keep-alive timeout applies).

Dropping the connection is what a client that left would do: the response's `send` fails, its job is
cancelled, its slot is free. Non-goals: what a response holds (the job's own buffer bound,
worker.py) and the Wyoming server (which has its own connections, wyoming.py).
"""

from __future__ import annotations

import asyncio
import logging

log = logging.getLogger("kazeia.server")


class _Bounded:
    """Mixin for an asyncio protocol of uvicorn's (HTTP or WebSocket) that has a `transport`."""

    stall_s: float = 30.0
    head: bool = False  # an HTTP protocol: the first request head must come within stall_s
    transport: asyncio.Transport
    _stall_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        if self.head:
            asyncio.get_running_loop().call_later(self.stall_s, self._no_request)

    def pause_writing(self) -> None:
        super().pause_writing()  # type: ignore[misc]
        if self._stall_timer is None:
            self._stall_timer = asyncio.get_running_loop().call_later(self.stall_s, self._stalled)

    def resume_writing(self) -> None:
        self._disarm()
        super().resume_writing()  # type: ignore[misc]

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)  # type: ignore[misc]

    def _disarm(self) -> None:
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None

    def _stalled(self) -> None:
        self._stall_timer = None
        log.info("a client took nothing for %g s; its connection is dropped", self.stall_s)
        self.transport.abort()

    def _no_request(self) -> None:
        """No request head yet (uvicorn makes a request cycle once one is complete); a connection
        upgraded to a WebSocket belongs to its WebSocket protocol now and is left alone."""
        transport = self.transport
        if transport is None or transport.is_closing() or transport.get_protocol() is not self:
            return
        if getattr(self, "cycle", None) is None:
            log.info("a connection sent no request within %g s; dropped", self.stall_s)
            transport.abort()


def bounded_protocols(stall_s: float) -> tuple[type[asyncio.Protocol], type[asyncio.Protocol] | None]:
    """(HTTP protocol, WebSocket protocol) classes for `uvicorn.Config(http=..., ws=...)`: uvicorn's
    automatic choices with the rules above, `stall_s` seconds each (None: no WebSocket library)."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol
    from uvicorn.protocols.websockets.auto import AutoWebSocketsProtocol

    http = type("BoundedHTTPProtocol", (_Bounded, AutoHTTPProtocol), {"stall_s": stall_s, "head": True})
    ws = None
    if isinstance(AutoWebSocketsProtocol, type):
        ws = type("BoundedWebSocketProtocol", (_Bounded, AutoWebSocketsProtocol), {"stall_s": stall_s})
    return http, ws
