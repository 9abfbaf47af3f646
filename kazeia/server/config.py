"""Server settings: what a request may ask for (`Limits`), how the server runs (`ServerConfig`), and
what the Wyoming server gives every utterance (`WyomingSettings`)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from ..options import SynthesisOptions
from ..streaming import ChunkSchedule

ADMISSIONS = ("measured", "behind", "all")  # ServerConfig.admission
DEFAULT_VOICES_DIR = "voices"  # relative to the working directory of the server


@dataclass(frozen=True)
class Limits:
    """Bounds on one request; anything beyond them is a 400 that names the bound."""

    # Length of `input` (OpenAI's own limit); also of a live text in total. A long input is spoken in
    # segments, each bounded by max_new_tokens and the runaway guard's frame budget (kazeia/segment.py).
    max_input_chars: int = 4096
    max_instructions_chars: int = 2048  # length of `instructions`
    max_new_tokens: int = 4096  # talker tokens per segment of an utterance (4095 frames = 5.5 min); also the default
    max_temperature: float = 2.0  # upper bound of temperature and subtalker_temperature
    max_repetition_penalty: float = 2.0  # upper bound of repetition_penalty
    max_body_bytes: int = 1 << 20  # size of a JSON request body or WebSocket message
    max_pending_utterances: int = 8  # texts a WebSocket may queue behind the one being spoken
    max_upload_bytes: int = 16 << 20  # size of a voice upload (the multipart body)
    max_reference_s: float = 30.0  # length of a voice's reference audio (its codes join every ICL prompt)
    # In tokens as well as characters: 4096 rare characters can make ~12,000 tokens.
    max_input_tokens: int = 4096  # text tokens of `input` (a live text: of all of it, once it has ended)
    max_instructions_tokens: int = 1024  # tokens of `instructions`
    max_ref_text_tokens: int = 1024  # tokens of a cloned voice's transcript
    # Talker positions of prompt + max_new_tokens (the KV cache grows with them: ~224 KiB each at the
    # released sizes); also bounded by the model's own positions.
    max_positions: int = 8192
    max_buffered_bytes: int = 8 << 20  # encoded audio an utterance may hold for a client that reads slowly
    max_response_bytes: int = 64 << 20  # the whole audio of a `stream: false` response (~11 min of WAV)
    # A client that takes none of its audio for this long is cancelled as if gone, and its connection
    # dropped; so is a connection that sends no request (HTTP) for this long.
    client_stall_s: float = 30.0
    max_body_s: float = 120.0  # seconds a request body (a voice upload too) may take to arrive in all
    max_field_chars: int = 256  # length of every other string field (voice, language, model, formats...)
    max_uploads: int = 2  # voice uploads read or encoded at once; one more gets 503
    max_voices: int = 256  # saved voices in the voices directory
    max_voices_bytes: int = 512 << 20  # their files' total size
    # Whether a request may set ignore_eos (exactly max_new_tokens - 1 frames a segment, for
    # benchmarks). `kazeia serve` refuses it unless started with --allow-ignore-eos.
    allow_ignore_eos: bool = True

    def __post_init__(self) -> None:
        for name in (
            "max_input_chars",
            "max_instructions_chars",
            "max_body_bytes",
            "max_pending_utterances",
            "max_upload_bytes",
            "max_input_tokens",
            "max_instructions_tokens",
            "max_ref_text_tokens",
            "max_buffered_bytes",
            "max_response_bytes",
            "max_field_chars",
            "max_uploads",
            "max_voices",
            "max_voices_bytes",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_new_tokens < 2:
            raise ValueError(f"max_new_tokens must be >= 2, got {self.max_new_tokens!r}")
        if not self.max_temperature > 0 or not self.max_repetition_penalty > 0:
            raise ValueError("max_temperature and max_repetition_penalty must be > 0")
        if not self.max_reference_s > 0:
            raise ValueError(f"max_reference_s must be > 0, got {self.max_reference_s!r}")
        for name in ("client_stall_s", "max_body_s"):
            _check_seconds(name, getattr(self, name))
        if not isinstance(self.allow_ignore_eos, bool):
            raise ValueError(f"allow_ignore_eos must be True or False, got {self.allow_ignore_eos!r}")
        if self.max_positions < self.max_new_tokens:
            raise ValueError(
                f"max_positions ({self.max_positions}) must be at least max_new_tokens ({self.max_new_tokens})"
            )


MAX_BATCH = 64  # utterances generated at once at most (each holds a serving thread)


@dataclass(frozen=True)
class ServerConfig:
    """How the server runs one loaded engine."""

    model_name: str  # the id `GET /v1/models` lists and a request's `model` must name
    queue_size: int = 16  # utterances waiting for the worker; one more is refused with 503
    first_chunk_frames: int = ChunkSchedule.first  # frames in the first streamed chunk (80 ms each): latency
    chunk_frames: int = ChunkSchedule.rest  # frames in each later chunk: overhead per chunk
    # A later chunk of a stream that fell behind takes the frames already waiting, up to this many
    # (raised to chunk_frames; None: exactly chunk_frames): its vocoder catches up (ChunkSchedule).
    # Worth it with max_batch > 1 on few cores; the audio's last bits then depend on timing.
    max_chunk_frames: int | None = None
    limits: Limits = field(default_factory=Limits)
    # Base checkpoints: where uploaded voices are kept (`NAME.voice`); created at start if missing.
    voices_dir: str | os.PathLike = DEFAULT_VOICES_DIR
    # Live text (WebSocket `input_text.append`): seconds the worker waits for new text (blank deltas
    # do not count) before the utterance fails with `text_timeout` (the worker is held meanwhile, so
    # keep it short), and seconds within which its text must end (`text_deadline`).
    text_timeout: float = 10.0
    text_deadline: float = 300.0
    # Apps written for OpenAI name its models; these ids are accepted for the served model too.
    model_aliases: tuple[str, ...] = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts")
    # Who may talk to the server (server/guard.py): the Host names it answers to (None: any;
    # `kazeia serve` on a loopback address sets the loopback names), the pages besides its own
    # that may call it (also given CORS headers; "*" for any), and an API key (None: none).
    allowed_hosts: tuple[str, ...] | None = None
    allowed_origins: tuple[str, ...] = ()
    api_key: str | None = None
    max_connections: int = 64  # open connections at once (uvicorn's limit_concurrency); more get 503
    ws_idle_s: float = 300.0  # a WebSocket with nothing to say or speak for this long is closed
    # Utterances generated at once, their frame steps batched (kazeia/scheduler.py); 1: one at a time.
    # 4: with several clients on 2 cores their first audio comes seconds sooner and ~1.5x the audio
    # is spoken in all; a lone client loses nothing measurable (docs/server.md, BENCHMARKS.md).
    max_batch: int = 4
    # Who is let in (server/worker.py; refused: 503 + Retry-After, code at_capacity): "measured"
    # refuses a new utterance while a stream is behind real time (its listener, behind a 250 ms
    # buffer, would be waiting) or when the pace this server's own streams have shown says one more
    # would not keep real time (server/capacity.py); "behind" only the first; "all" neither (the
    # queue's bound alone). The listeners already served keep their pace, at the price of refusals
    # a client must retry (or a router sends elsewhere).
    admission: str = "measured"
    # Pay the engine's one-off costs before taking a request (kazeia/warmup.py): its first stream and
    # each preset speaker's prompt positions, so that the first listener, or the first to pick a
    # voice, hears it as soon as the next ones (~60 ms sooner on a 2-vCPU Zen 3; ~1.7 s at start).
    warm_up: bool = True

    @property
    def schedule(self) -> ChunkSchedule:
        """The chunk schedule of every stream (`max_chunk_frames` raised to `chunk_frames` if below)."""
        most = None if self.max_chunk_frames is None else max(self.max_chunk_frames, self.chunk_frames)
        return ChunkSchedule(self.first_chunk_frames, self.chunk_frames, most)

    def __post_init__(self) -> None:
        if not isinstance(self.model_name, str) or not self.model_name.strip():
            raise ValueError("model_name must be a non-empty string")
        for name in ("queue_size", "first_chunk_frames", "chunk_frames", "max_connections", "max_batch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        most = self.max_chunk_frames
        if most is not None and (isinstance(most, bool) or not isinstance(most, int) or most < 1):
            raise ValueError(f"max_chunk_frames must be an integer >= 1 or None, got {most!r}")
        if not isinstance(self.warm_up, bool):
            raise ValueError(f"warm_up must be True or False, got {self.warm_up!r}")
        if self.admission not in ADMISSIONS:
            raise ValueError(f"admission must be one of {', '.join(ADMISSIONS)}, got {self.admission!r}")
        if self.max_batch > MAX_BATCH:
            raise ValueError(f"max_batch must be at most {MAX_BATCH}, got {self.max_batch}")
        for name in ("text_timeout", "text_deadline", "ws_idle_s"):
            _check_seconds(name, getattr(self, name))
        if not all(isinstance(a, str) and a.strip() for a in self.model_aliases):
            raise ValueError(f"model_aliases must be non-empty strings, got {self.model_aliases!r}")
        for origin in self.allowed_origins:  # as browsers send it: scheme://host[:port], nothing more
            parts = urlsplit(origin) if isinstance(origin, str) else None
            if origin != "*" and (
                parts is None
                or parts.scheme not in ("http", "https")
                or not parts.netloc
                or origin != f"{parts.scheme}://{parts.netloc}"
            ):
                raise ValueError(
                    f"allowed origin {origin!r} must be '*' or scheme://host[:port], e.g. https://app.example"
                )
        key = self.api_key
        if key is not None and (not isinstance(key, str) or len(key) < 8):
            raise ValueError("api_key must be a string of at least 8 characters")
        if key is not None and any(c.isspace() or not c.isprintable() for c in key):
            raise ValueError("api_key must hold no spaces or control characters (it travels in a header)")
        if not isinstance(self.voices_dir, (str, os.PathLike)) or not str(self.voices_dir).strip():
            raise ValueError(f"voices_dir must be a directory path, got {self.voices_dir!r}")

    @property
    def voices_path(self) -> Path:
        return Path(self.voices_dir).expanduser()


@dataclass(frozen=True)
class WyomingSettings:
    """What every utterance gets that a Wyoming client cannot ask for (the protocol carries a text
    and a voice's name, language and speaker, nothing more)."""

    # voice: when a request names none (None: the first voice `info` lists); language: when a request
    # names none (Home Assistant sends none; a Wyoming code or a name, None for auto); instruct, seed,
    # speed and the sampling options: every utterance's (a fixed seed: the same text, the same audio).
    # The options' long_text is not used (a Wyoming text is spoken as the HTTP server speaks one).
    options: SynthesisOptions = SynthesisOptions()
    idle_s: float = 300.0  # a connection with nothing generating for this long is closed

    def __post_init__(self) -> None:
        _check_seconds("idle_s", self.idle_s)
        if not isinstance(self.options, SynthesisOptions) or not isinstance(self.options.voice, (str, type(None))):
            raise ValueError("the Wyoming server's options are SynthesisOptions with a voice name (or none)")


def _check_seconds(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a number of seconds > 0, got {value!r}")
