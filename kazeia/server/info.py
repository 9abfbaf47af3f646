"""What the server offers: the demo page, models, health and Prometheus metrics (voices: voices.py)."""

from __future__ import annotations

import functools
import time
from importlib import resources

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, Response

from ..audio import SAMPLE_RATE
from .metrics import CONTENT_TYPE
from .state import server_state

router = APIRouter()
STARTED = int(time.time())  # `created` of the model entry: when this server process started


@functools.cache
def _demo_page() -> str:
    return resources.files(__package__).joinpath("demo.html").read_text(encoding="utf-8")


@router.get("/")
async def demo() -> HTMLResponse:
    """A page that speaks typed text over the WebSocket and shows TTFB and RTF (no build step)."""
    return HTMLResponse(_demo_page())


@router.get("/health")
async def health(request: Request) -> dict:
    s = server_state(request)
    worker = s.worker
    return {
        "status": "ok",
        "model": s.config.model_name,
        "active": worker.active,  # admitted and not finished
        "queue_depth": worker.queue_depth,  # waiting for a serving thread
        "behind": worker.behind,  # streams behind real time now (a 250 ms playout buffer would be dry)
        "admission": s.config.admission,
        "admits": worker.admits,  # utterances at once the admission lets in now
        # audio seconds per second waited, by utterances spoken at once (server/capacity.py)
        "paces": {str(n): round(pace, 3) for n, pace in worker.paces().items()},
    }


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(server_state(request).metrics.render(), media_type=CONTENT_TYPE)


@router.get("/v1/models")
async def models(request: Request) -> dict:
    s = server_state(request)
    model = {
        "id": s.config.model_name,
        "object": "model",
        "created": STARTED,
        "owned_by": "kazeia",
        "model_type": s.engine.model_type,
        "sample_rate": SAMPLE_RATE,
    }
    return {"object": "list", "data": [model]}
