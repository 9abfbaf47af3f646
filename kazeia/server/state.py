"""What every handler reaches through `request.app.state.kazeia`: the engine, its worker, the voices.

`build_state` makes them for one engine; the HTTP app and the Wyoming server are built on it, so
both speak through the same kind of worker: one thread, one bounded queue, cancel within a frame."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from starlette.requests import HTTPConnection

from ..engine import Engine
from .config import ServerConfig
from .formats import AudioFormat, available_formats
from .metrics import ServerMetrics
from .store import VoiceStore
from .worker import Worker


@dataclass(frozen=True)
class ServerState:
    engine: Engine
    config: ServerConfig
    worker: Worker
    metrics: ServerMetrics
    formats: dict[str, AudioFormat]  # the response formats this libsndfile can encode
    voices: VoiceStore | None  # Base checkpoints: the saved voices; None for the others
    uploads: asyncio.Semaphore  # voice uploads being read or encoded (Limits.max_uploads at once)


def server_state(connection: HTTPConnection) -> ServerState:
    return connection.app.state.kazeia


def build_state(engine: Engine, config: ServerConfig) -> ServerState:
    """The worker (not started yet), metrics and voices of one engine. A Base (voice-clone)
    checkpoint speaks with the voices saved in `config.voices_dir` (created if missing; a ValueError
    if it cannot be); other checkpoints never touch that directory."""
    voices = VoiceStore(config.voices_path, engine, config.limits) if engine.model_type == "base" else None
    metrics = ServerMetrics(
        lambda: worker.queue_depth, lambda: worker.active, lambda: worker.behind, lambda: worker.admits
    )
    worker = Worker(engine, config.queue_size, config.schedule, metrics, config.max_batch, config.admission)
    uploads = asyncio.Semaphore(config.limits.max_uploads)
    return ServerState(engine, config, worker, metrics, available_formats(), voices, uploads)
