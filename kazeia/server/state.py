"""What every handler reaches through `request.app.state.kazeia`: the engine and its worker."""

from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import HTTPConnection

from ..engine import Engine
from .config import ServerConfig
from .formats import AudioFormat
from .metrics import ServerMetrics
from .worker import Worker


@dataclass(frozen=True)
class ServerState:
    engine: Engine
    config: ServerConfig
    worker: Worker
    metrics: ServerMetrics
    formats: dict[str, AudioFormat]  # the response formats this libsndfile can encode


def server_state(connection: HTTPConnection) -> ServerState:
    return connection.app.state.kazeia
