"""Server settings: what a request may ask for (`Limits`) and how the server runs (`ServerConfig`)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from ..streaming import ChunkSchedule

DEFAULT_VOICES_DIR = "voices"  # relative to the working directory of the server


@dataclass(frozen=True)
class Limits:
    """Bounds on one request; anything beyond them is a 400 that names the bound."""

    max_input_chars: int = 4096  # length of `input` (OpenAI's own limit); also of a live text in total
    max_instructions_chars: int = 2048  # length of `instructions`
    max_new_tokens: int = 4096  # talker tokens per utterance (4095 frames = 5.5 min); also the default
    max_temperature: float = 2.0  # upper bound of temperature and subtalker_temperature
    max_repetition_penalty: float = 2.0  # upper bound of repetition_penalty
    max_body_bytes: int = 1 << 20  # size of a JSON request body or WebSocket message
    max_pending_utterances: int = 8  # texts a WebSocket may queue behind the one being spoken
    max_upload_bytes: int = 16 << 20  # size of a voice upload (the multipart body)
    max_reference_s: float = 30.0  # length of a voice's reference audio (its codes join every ICL prompt)

    def __post_init__(self) -> None:
        for name in (
            "max_input_chars",
            "max_instructions_chars",
            "max_body_bytes",
            "max_pending_utterances",
            "max_upload_bytes",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.max_new_tokens < 2:
            raise ValueError(f"max_new_tokens must be >= 2, got {self.max_new_tokens!r}")
        if not self.max_temperature > 0 or not self.max_repetition_penalty > 0:
            raise ValueError("max_temperature and max_repetition_penalty must be > 0")
        if not self.max_reference_s > 0:
            raise ValueError(f"max_reference_s must be > 0, got {self.max_reference_s!r}")


@dataclass(frozen=True)
class ServerConfig:
    """How the server runs one loaded engine."""

    model_name: str  # the id `GET /v1/models` lists and a request's `model` must name
    queue_size: int = 16  # utterances waiting for the worker; one more is refused with 503
    first_chunk_frames: int = ChunkSchedule.first  # frames in the first streamed chunk (80 ms each): latency
    chunk_frames: int = ChunkSchedule.rest  # frames in each later chunk: overhead per chunk
    limits: Limits = field(default_factory=Limits)
    # Base checkpoints: where uploaded voices are kept (`NAME.voice`); created at start if missing.
    voices_dir: str | os.PathLike = DEFAULT_VOICES_DIR
    # Live text (WebSocket `input_text.append`): seconds the worker waits for the next delta before
    # the utterance fails with `text_timeout` (the worker is held meanwhile, so keep it short).
    text_timeout: float = 10.0

    def __post_init__(self) -> None:
        if not isinstance(self.model_name, str) or not self.model_name.strip():
            raise ValueError("model_name must be a non-empty string")
        for name in ("queue_size", "first_chunk_frames", "chunk_frames"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        timeout = self.text_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"text_timeout must be a number of seconds > 0, got {timeout!r}")
        if not isinstance(self.voices_dir, (str, os.PathLike)) or not str(self.voices_dir).strip():
            raise ValueError(f"voices_dir must be a directory path, got {self.voices_dir!r}")

    @property
    def voices_path(self) -> Path:
        return Path(self.voices_dir).expanduser()
