"""Kazeia's HTTP and WebSocket server (the `server` extra: FastAPI + uvicorn).

Endpoints: `POST /v1/audio/speech` (OpenAI-compatible), `WS /v1/audio/speech/stream` (whole texts,
or live text as it is written), `GET /v1/audio/voices`, `POST /v1/audio/voices` and
`DELETE /v1/audio/voices/{name}` (saved voices of Base checkpoints), `GET /v1/models`,
`GET /health`, `GET /metrics` and the demo page at `/`. See docs/server.md. One worker thread
owns the engine; the event loop only parses and relays.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .config import Limits, ServerConfig

if TYPE_CHECKING:
    from .app import create_app

__all__ = ["create_app", "serve", "Limits", "ServerConfig"]
WS_MESSAGE_ROOM = 4  # WebSocket messages the protocol reads whole, in max_body_bytes


def __getattr__(name: str):
    """`create_app` is imported on first use, so that the settings (`Limits`, `ServerConfig`) can
    be read without the server extra installed (the CLI builds its flags from them)."""
    if name == "create_app":
        from .app import create_app

        return create_app
    raise AttributeError(name)


def guarded(config: ServerConfig, host: str) -> ServerConfig:
    """`config` as served on `host`: on a loopback address, requests must name a loopback Host
    (unless `config.allowed_hosts` says otherwise); elsewhere without an API key, a warning says
    that anyone who can reach it may use it. Both `serve` and the replicas on Ray apply it."""
    import dataclasses
    import logging

    from .guard import loopback_hosts

    if config.allowed_hosts is None:
        config = dataclasses.replace(config, allowed_hosts=loopback_hosts(host))
    if config.allowed_hosts is None and config.api_key is None:
        logging.getLogger("kazeia.server").warning(
            "serving on %s without an API key: anyone who can reach this address, and any web page "
            "opened on a machine that can (DNS rebinding), can use the server and its saved voices; "
            "pass --api-key or set KAZEIA_API_KEY",
            host,
        )
    return config


def serve(engine, config: ServerConfig, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    """Serve `engine` until interrupted (the `kazeia serve` command); logs one line per utterance.
    The Host names and key are `guarded`'s."""
    import logging

    import uvicorn

    from .app import create_app
    from .guard import RedactKeys
    from .protocols import bounded_protocols
    from .wire import filter_logs

    config = guarded(config, host)
    app = create_app(engine, config)
    logging.basicConfig(format="%(levelname)s:     %(name)s: %(message)s", level=log_level.upper())
    http, ws = bounded_protocols(config.limits.client_stall_s)  # silent and stalled clients dropped
    settings = uvicorn.Config(  # configures uvicorn's loggers, so the filter goes on after it
        app,
        host=host,
        port=port,
        http=http,
        ws=ws or "auto",
        log_level=log_level,
        # A message over max_body_bytes is answered with a 413 error event on an open socket; the
        # protocol closes (1009) only one over WS_MESSAGE_ROOM times that, which it must hold whole.
        ws_max_size=WS_MESSAGE_ROOM * config.limits.max_body_bytes,
        limit_concurrency=config.max_connections,
        timeout_graceful_shutdown=5,  # streams still open after 5 s are cut; their jobs are cancelled
    )
    filter_logs(RedactKeys())  # WebSocket paths are logged with their ?api_key=; client text escaped
    uvicorn.Server(settings).run()
