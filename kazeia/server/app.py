"""The FastAPI application: `create_app(engine, config)` wires one loaded `Engine` to one `Worker`.

Handlers only parse, submit and relay (speech.py, websocket.py, info.py): validation happens
before anything is queued, so a bad request is a 4xx with an OpenAI-style body and costs no
generation. Every error, including unknown routes and methods, has that body.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from ..engine import Engine
from ..warmup import warm_up
from .config import ServerConfig
from .errors import ApiError
from .guard import AccessGuard
from .info import router as info_router
from .speech import router as speech_router
from .state import build_state, server_state
from .voices import router as voices_router
from .websocket import router as websocket_router
from .wire import dumps


class SafeJSONResponse(JSONResponse):
    """A JSON response that always encodes (server/wire.py: client text escaped, no NaN)."""

    def render(self, content) -> bytes:
        return dumps(content).encode("utf-8")


def create_app(engine: Engine, config: ServerConfig) -> FastAPI:
    """The application for one loaded engine (`state.build_state`: its worker, metrics and saved
    voices); its worker thread runs while the app is served."""
    state = build_state(engine, config)
    worker = state.worker

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if config.warm_up:  # before the first request is taken (kazeia/warmup.py)
            await asyncio.to_thread(warm_up, engine)
        worker.start()
        try:
            yield
        finally:
            await asyncio.to_thread(worker.stop)

    app = FastAPI(
        title="Kazeia",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        default_response_class=SafeJSONResponse,
    )
    if config.allowed_origins:  # CORS headers for these pages only (none for any other)
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(config.allowed_origins),
            allow_methods=["GET", "POST", "DELETE"],
            allow_headers=["Authorization", "Content-Type"],
            expose_headers=["X-Kazeia-Seed"],
        )
    app.add_middleware(AccessGuard, config=config)  # outermost: Host, Origin and API key before anything
    app.state.kazeia = state
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)
    for router in (info_router, voices_router, speech_router, websocket_router):
        app.include_router(router)
    return app


async def _api_error(request: Request, error: ApiError) -> JSONResponse:
    route = getattr(request.scope.get("route"), "path", "unmatched")
    server_state(request).metrics.errors.inc(route=route, status=str(error.status))
    return SafeJSONResponse(error.body(), status_code=error.status, headers=error.headers)


async def _http_error(request: Request, error: HTTPException) -> JSONResponse:
    code = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code, "http_error")
    message = f"{request.method} {request.url.path}: {error.detail}"
    return await _api_error(request, ApiError(error.status_code, message, code=code))


async def _internal_error(request: Request, error: Exception) -> JSONResponse:
    return await _api_error(request, ApiError(500, f"internal error: {type(error).__name__}", code="internal_error"))
