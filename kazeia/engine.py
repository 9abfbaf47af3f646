"""The public API: load a checkpoint once, synthesize many times.

```python
engine = Engine.load("Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice")
speech = engine.synthesize("Bonjour Kazeia.", voice="serena", language="french", seed=7)

base = Engine.load("Qwen/Qwen3-TTS-12Hz-0.6B-Base")  # voice cloning
me = base.create_voice("me.wav", ref_text="What I say in me.wav.")
speech = base.synthesize("Bonjour Kazeia.", voice=me, language="french")
```

`Engine` is a facade over a loaded `Runtime` (kazeia/runtime.py): a call's text and options
(kazeia/options.py) become a `Request` (kazeia/request.py), the request a stream
(kazeia/utterance.py, kazeia/streaming.py), and `synthesize` takes the stream's whole audio
(`assemble`, kazeia/offline.py). Every call is independent (fresh caches, its own `torch.Generator`);
the same text, voice, options and seed give the same codes and the same audio bytes. Bad input raises
`RequestError` (a ValueError) naming what is wrong and the valid choices.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator

import numpy as np
import torch

from . import offline
from .audio import MAX_REFERENCE_S, SAMPLE_RATE, load_reference_audio
from .config import ModelConfig
from .errors import RequestError
from .model import TTSModel
from .offline import Assembly, Speech, reference_chunked
from .options import ChunkSchedule, StreamOptions, SynthesisOptions, with_overrides
from .request import Request, TextSource, build_request, check_clone
from .runtime import Runtime
from .sampling import SamplingOptions
from .scheduler import Scheduler
from .segment import LongTextOptions, Segment
from .streaming import Metrics, SpeechStream, open_stream
from .text import TextTokenizer
from .utterance import Unscheduled, timeline
from .vocoder import OFFLINE_BLOCK, Vocoder
from .voices import Voice


class Engine:
    """A loaded checkpoint (talker, code predictor, vocoder, text tokenizer, and for Base checkpoints
    the two encoders) and the calls made on it. It holds no per-call state."""

    def __init__(self, runtime: Runtime):
        self.runtime = runtime

    @classmethod
    def load(
        cls,
        path_or_id: str | os.PathLike,
        device: str = "cpu",
        dtype: str | None = None,
        *,
        vocoder_dtype: str = "float32",
        tokenizer_regex: str = "qwen2",
        offline: bool | None = None,
        threads: int | None = None,
        huge_pages: bool = True,
    ) -> Engine:
        """Load a local checkpoint directory or a hub id (downloaded once into the hub cache).

        dtype: talker and code-predictor weights, "float32" | "bfloat16" | "float16" | "int8" (CPU:
            per-channel int8 weights quantized at load, float32 activations rounded to 16 bits per
            row, exact integer sums; see kazeia/quant.py) | "int4" (CPU with the native library: 4-bit
            groups of 32 weights, the fewest bytes to read a frame; see kazeia/int4.py). Default:
            the precision a checkpoint prepared by `kazeia quantize` was made for (the only one it
            loads in; kazeia/prepared.py), else float32.
        vocoder_dtype: the speech-tokenizer decoder; float32 by default for exact audio. "bfloat16"
            is faster on CPUs with bfloat16 dot products, at a lower SNR against float32
            (BENCHMARKS.md); elsewhere half precision is slower. "int8" (the CPU with the native
            library): most residual convolutions as int8 products (kazeia/conv.py's `Tiled8`), the
            same bits whatever the chunking, at an SNR against float32 like bfloat16's
            (docs/design.md).
        tokenizer_regex: "qwen2" (standard) or "reference-local" (the split regex the reference
            package uses when it loads from a local directory; see kazeia/text.py).
        threads: torch threads for each of the two stages that run side by side, generation and
            the vocoder (process-wide: `torch.set_num_threads`). Default on the CPU: half the cores
            this process may use, at least 1 (kazeia/placement.py says why, and when a prompt takes
            both stages' threads).
        huge_pages: on the CPU, the talker's and code predictor's weights are copied into memory
            the kernel may back with 2 MB pages (kazeia/hugepages.py): generation reads them ~5-10 %
            faster, for a longer load (on a VM up to ~2 s a GB). False for one-shot work;
            `KAZEIA_HUGEPAGES=0` turns it off everywhere.
        """
        return cls(
            Runtime.load(path_or_id, device, dtype, vocoder_dtype, tokenizer_regex, offline, threads, huge_pages)
        )

    # -- what was loaded and what it accepts -------------------------------------------------
    @property
    def cfg(self) -> ModelConfig:
        """The checkpoint's configuration."""
        return self.runtime.cfg

    @property
    def model(self) -> TTSModel:
        """The talker and code predictor."""
        return self.runtime.model

    @property
    def vocoder(self) -> Vocoder:
        """The speech-tokenizer decoder."""
        return self.runtime.vocoder

    @property
    def tokenizer(self) -> TextTokenizer:
        """The text tokenizer."""
        return self.runtime.tokenizer

    @property
    def device(self) -> torch.device:
        """Where the model runs."""
        return self.runtime.device

    @property
    def defaults(self) -> SamplingOptions:
        """The sampling options of the checkpoint's generation_config.json."""
        return self.runtime.caps.defaults

    @property
    def model_type(self) -> str:
        """ "custom_voice", "voice_design" or "base"."""
        return self.runtime.caps.model_type

    @property
    def voices(self) -> list[str]:
        """Preset speakers (CustomVoice checkpoints); empty for other kinds."""
        return self.runtime.caps.voices

    @property
    def languages(self) -> list[str]:
        """Accepted `language` values: "auto" plus the checkpoint's languages (dialects come with speakers)."""
        return self.runtime.caps.languages

    # -- voice cloning (Base checkpoints) ------------------------------------------------------
    def create_voice(
        self,
        ref_audio,
        ref_text: str | None = None,
        x_vector_only: bool = False,
        *,
        max_seconds: float = MAX_REFERENCE_S,
    ) -> Voice:
        """Clone the voice of `ref_audio` (a Base checkpoint's job): encode it once into a `Voice`.

        ref_audio: a path (WAV/FLAC/OGG/MP3), the bytes of such a file, a binary file object, or
            `(array, sample_rate)`; mixed down to mono and resampled to 24 kHz. 3-10 s of clean
            speech work best; under 1 s, empty, silent or unreadable audio is a ValueError.
        ref_text: the transcript of `ref_audio`, required in ICL mode (the default): the talker then
            continues the reference's own codes, which copies the voice most closely.
        x_vector_only: use only the speaker embedding (no transcript needed, looser likeness).
        max_seconds: the longest reference accepted, checked from a file's header before decoding.
        """
        cloner = self.runtime.cloner
        if cloner is None:
            raise ValueError(f"voice cloning needs a Base checkpoint; this is a {self.model_type} checkpoint")
        check_clone(self.runtime.caps, ref_text, x_vector_only)
        codes, x_vector = cloner.encode(load_reference_audio(ref_audio, cloner.encoder.cfg.sample_rate, max_seconds))
        if x_vector_only:
            return Voice(x_vector, None, None, cloner.model)
        return Voice(x_vector, codes, ref_text, cloner.model)

    # -- synthesis --------------------------------------------------------------------------
    def synthesize(
        self,
        text: str,
        options: SynthesisOptions | None = None,
        *,
        reference_chunked_decode: bool = False,
        **overrides,
    ) -> Speech:
        """Speak `text` with `options` (kazeia/options.py; keyword `overrides` replace its fields:
        `engine.synthesize(text, voice="serena", seed=7)`).

        A text longer than `long_text.segment_tokens` tokens is spoken in segments, one after the
        other, as one utterance (kazeia/segment.py), each held to a frame budget by the runaway
        guard (kazeia/runaway.py); `speech.segments` says where each lies and why it ended. `speed`
        (0.25-4.0) changes the pace, not the pitch (kazeia/speed.py). The audio is one exact causal
        decode of all codes, made beside the generation (`assemble`). `reference_chunked_decode=True`
        instead reproduces the reference's decode, which restarts every 300 frames (24 s) from 25
        frames of context: identical up to 300 frames, an approximation after (for comparisons)."""
        if not isinstance(reference_chunked_decode, bool):
            raise RequestError(
                "reference_chunked_decode",
                f"reference_chunked_decode must be True or False, got {reference_chunked_decode!r}",
            )
        if not isinstance(text, str):
            raise RequestError("text", f"text must be a string, got {type(text).__name__}")
        start = time.perf_counter()
        request = build_request(self.runtime.caps, text, with_overrides(SynthesisOptions, options, overrides))
        if reference_chunked_decode:
            return reference_chunked(self.runtime, request, start)
        return self.assemble(request, started=start).speech()

    def stream(
        self,
        text: TextSource,
        options: SynthesisOptions | None = None,
        *,
        should_stop: Callable[[], bool] | None = None,
        scheduler: Scheduler | None = None,
        **overrides,
    ) -> SpeechStream:
        """Like `synthesize`, but yields `AudioChunk`s while generating (`StreamOptions` add the
        chunk schedule: the first chunk after `first_chunk_frames` frames of 80 ms, later ones up to
        `chunk_frames`, catching up to `max_chunk_frames`; options.ChunkSchedule). The schedule
        changes only latency and overhead, never the codes or audio. Use it as an iterator, ideally
        in a `with` block; closing it stops generation before the next frame.

        `text` may also be a source of text still arriving: an iterable or async iterable of deltas,
        or a `TextFeed` (kazeia/live.py). Speech then starts with the first complete word, and the
        codes and audio equal those of the whole text given at once; a source silent for
        `text_timeout` seconds, or not ended `text_deadline` seconds after the stream started waiting
        for it, fails the stream. `should_stop`: polled before each frame; True ends the stream
        early. `scheduler`: generate it there, batched with other streams (`Engine.scheduler`),
        with the same codes and audio."""
        started = time.perf_counter()
        chosen = with_overrides(StreamOptions, options, overrides)
        request = build_request(self.runtime.caps, text, chosen)
        return self.stream_request(request, chosen.schedule, should_stop, started, scheduler)

    def request(
        self,
        text: TextSource,
        options: SynthesisOptions | None = None,
        *,
        position_limit: int | None = None,
        **overrides,
    ) -> Request:
        """Validate a call's text and options and resolve names to ids (kazeia/request.py): a
        `Request` for `frames` or `stream_request`; raises RequestError on anything wrong. A text
        source (not a string) starts being read now. `position_limit`: a caller's (a server's) bound
        on prompt + max_new_tokens, below the model's own."""
        return build_request(self.runtime.caps, text, with_overrides(StreamOptions, options, overrides), position_limit)

    def stream_request(
        self,
        request: Request,
        schedule: ChunkSchedule | None = None,
        should_stop: Callable[[], bool] | None = None,
        started: float | None = None,
        scheduler: Scheduler | None = None,
    ) -> SpeechStream:
        """`stream` for a request validated before (`request`), e.g. by a server when it was queued."""
        if scheduler is not None and scheduler.runtime is not self.runtime:
            raise ValueError("the scheduler belongs to another engine")
        if scheduler is None:
            return open_stream(
                self.runtime, request, Unscheduled(self.runtime, request, should_stop), schedule, started
            )
        return open_stream(self.runtime, request, scheduler.source(request, should_stop), schedule, started)

    def assemble(
        self, request: Request, should_stop: Callable[[], bool] | None = None, started: float | None = None
    ) -> Assembly:
        """The offline audio of a validated request, chunk by chunk (kazeia/offline.py): the audio
        `synthesize` returns, for writers that take it as it comes (`kazeia say`). Close its
        `stream` (or use it in a `with` block) when done."""
        started = time.perf_counter() if started is None else started
        stream = self.stream_request(request, ChunkSchedule(OFFLINE_BLOCK, OFFLINE_BLOCK), should_stop, started)
        return Assembly(self.runtime, request, stream, started)

    def frames(self, request: Request, should_stop: Callable[[], bool] | None = None) -> Iterator[torch.Tensor]:
        """A validated request's (16,) int64 code frames, those of all its segments one after the
        other. Live text is waited for here."""
        for item in timeline(self.runtime, request, should_stop):
            if isinstance(item, torch.Tensor):
                yield item

    def scheduler(
        self,
        max_batch: int = 4,
        max_queue: int = 16,
        on_step: Callable[[int], None] | None = None,
        vocoder_lanes: int | None = None,
        spare_lanes: int | None = None,
        prompts_at_once: int | None = None,
    ) -> Scheduler:
        """A scheduler generating up to `max_batch` streams of this engine together (one batched
        frame step for all: kazeia/scheduler.py), `max_queue` more waiting first come first served.
        Each stream's codes and audio do not depend on the others. Close it when done. `on_step`:
        called with each step's number of streams; `vocoder_lanes`, `spare_lanes`,
        `prompts_at_once`: as `Scheduler`'s (defaults: kazeia/placement.py)."""
        return Scheduler(self.runtime, max_batch, max_queue, on_step, vocoder_lanes, spare_lanes, prompts_at_once)

    def decode(self, codes: torch.Tensor, reference_chunked: bool = False) -> np.ndarray:
        """codes (frames, 16) -> float32 audio (frames * 1920,): one exact causal decode, or the
        reference's 300-frame restarts with `reference_chunked`."""
        return offline.decode(self.runtime, codes, reference_chunked)


__all__ = ["Engine", "Speech", "Metrics", "Segment", "LongTextOptions", "Voice", "SAMPLE_RATE"]
