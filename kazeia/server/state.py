"""What every handler reaches through `request.app.state.kazeia`: the engine, its worker, the voices."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from starlette.requests import HTTPConnection

from ..engine import Engine
from .config import ServerConfig
from .formats import AudioFormat
from .metrics import ServerMetrics
from .worker import Worker

if TYPE_CHECKING:
    from .voices import VoiceStore


@dataclass(frozen=True)
class ServerState:
    engine: Engine
    config: ServerConfig
    worker: Worker
    metrics: ServerMetrics
    formats: dict[str, AudioFormat]  # the response formats this libsndfile can encode
    voices: VoiceStore | None  # Base checkpoints: the saved voices; None for the others


def server_state(connection: HTTPConnection) -> ServerState:
    return connection.app.state.kazeia
