"""Offline audio: a request's whole audio, in order, assembled from its stream (`Assembly`), and
`Speech`, the result of `Engine.synthesize`.

`Engine.synthesize` and `kazeia say` (without `--stream`) both take their audio from an Assembly:
the stream's chunks in blocks of OFFLINE_BLOCK frames (the vocoder's offline blocks: the audio of
one decode), preceded, for an ICL voice at speed 1, by the samples of the reference that the
reference package's cut keeps before the generated audio (`voices.Priming.lead`: 0 or 1, by float
rounding of a ratio of the final length). That count is known only once generation has ended, so
for such voices the chunks are held until then: in a temporary file beyond a few megabytes, so
memory stays flat however long the text. The segments it lists are shifted by the lead.

Also `reference_chunked`, the reference package's own decode (300-frame restarts), for comparisons.
Non-goals: streaming (kazeia/streaming.py), where no lead can precede audio already sent.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace

import numpy as np
import torch

from .request import Request
from .runaway import overall
from .runtime import Runtime
from .segment import Segment
from .speed import stretch
from .streaming import AudioChunk, Metrics, SpeechStream
from .utterance import timeline

SPOOL_BYTES = 8 << 20  # chunks held in memory while an ICL lead is unknown; beyond, in a temporary file


@dataclass(frozen=True)
class Speech:
    """Result of `Engine.synthesize`."""

    audio: np.ndarray  # (samples,) float32 mono in [-1, 1]
    sample_rate: int  # Hz (24000)
    codes: np.ndarray  # (frames, 16) int64 speech-tokenizer codes
    metrics: Metrics
    segments: tuple[Segment, ...] = ()  # the text's segments in order, with their exact samples and finish reasons

    @property
    def finish_reason(self) -> str:
        """Why the utterance ended: the most serious of its segments' reasons (kazeia/runaway.py)."""
        return overall([s.finish_reason for s in self.segments])


class Assembly:
    """The offline audio of `request`, chunk by chunk, from `stream` (made with offline blocks,
    opened at perf_counter() `started`)."""

    def __init__(self, runtime: Runtime, request: Request, stream: SpeechStream, started: float):
        self.runtime, self.request, self.stream, self.started = runtime, request, stream, started
        self.lead = 0  # samples of the reference before the generated audio (known at the end)

    def speech(self) -> Speech:
        """All of the audio at once, with its codes, metrics and segments (`Engine.synthesize`'s
        result); the stream is closed after."""
        with self.stream:
            audio = np.concatenate([chunk.audio for chunk in self]).astype(np.float32, copy=False)
        streamed, codes = self.stream.metrics, self.stream.codes
        assert streamed is not None and codes is not None  # the last chunk is out
        wall, audio_s = time.perf_counter() - self.started, len(audio) / self.runtime.vocoder.cfg.sample_rate
        metrics = replace(streamed, audio_s=audio_s, wall_s=wall, rtf=wall / audio_s, ttfb_s=wall, chunks=1)
        return Speech(audio, self.runtime.vocoder.cfg.sample_rate, codes, metrics, tuple(self.segments))

    @property
    def segments(self) -> list[Segment]:
        """The segments that have ended, in output samples (after the lead)."""
        return [segment.shifted(self.lead) for segment in self.stream.segments]

    def __iter__(self) -> Iterator[AudioChunk]:
        ref = self.request.cond.reference_codes
        if ref is None or self.request.speed != 1.0:
            yield from self.stream
            return
        with tempfile.SpooledTemporaryFile(SPOOL_BYTES) as spool:
            held: list[AudioChunk] = []  # each with its audio in the spool instead
            for chunk in self.stream:
                if not chunk.is_last:
                    spool.write(chunk.audio.tobytes())
                    held.append(replace(chunk, audio=np.empty(0, np.float32)))
                    continue
                frames = len(self.stream.codes) if self.stream.codes is not None else 0
                lead = self.runtime.priming.lead(ref, frames)
                self.lead = len(lead)
                if self.lead:
                    yield AudioChunk(lead, 0, 0, False)
                spool.seek(0)
                for kept in held:
                    audio = np.frombuffer(spool.read(4 * _samples(kept, self.runtime)), np.float32)
                    yield replace(kept, audio=audio, start_sample=kept.start_sample + self.lead)
                yield replace(chunk, start_sample=chunk.start_sample + self.lead)


def _samples(chunk: AudioChunk, runtime: Runtime) -> int:
    """The samples of a held chunk (speed 1: its frames' exact length)."""
    return chunk.frames * runtime.vocoder.cfg.samples_per_frame


@torch.inference_mode()
def decode(runtime: Runtime, codes: torch.Tensor, reference_chunked: bool = False) -> np.ndarray:
    """codes (frames, 16) -> float32 audio (frames * 1920,): one exact causal decode, or the
    reference's 300-frame restarts with `reference_chunked`."""
    codes = codes.to(runtime.device)[None]
    vocoder = runtime.vocoder
    audio = vocoder.decode_reference_chunked(codes) if reference_chunked else vocoder(codes)
    return audio[0].float().cpu().numpy().astype(np.float32, copy=False)


@torch.inference_mode()
def reference_chunked(runtime: Runtime, request: Request, started: float) -> Speech:
    """`Engine.synthesize`'s result with the reference package's decode of all of a request's
    frames, made once they are all generated: every 300 frames (24 s) a restart from 25 frames of
    context (identical to one decode up to 300 frames, an approximation after). `started`: the
    call's perf_counter()."""
    frames: list[torch.Tensor] = []
    segments: list[Segment] = []
    first = None
    for item in timeline(runtime, request):
        if isinstance(item, Segment):
            segments.append(item)
            continue
        frames.append(item)
        first = first if first is not None else time.perf_counter() - started
    generated = time.perf_counter() - started
    codes = torch.stack(frames)  # (frames, 16)
    ref, rate = request.cond.reference_codes, runtime.vocoder.cfg.sample_rate
    audio = decode(runtime, codes, True) if ref is None else runtime.priming.reference_chunked(ref, codes)
    if request.speed != 1.0:
        audio = stretch(audio, request.speed, rate)
        segments = [segment.at_speed(request.speed) for segment in segments]
    else:
        lead = len(audio) - codes.shape[0] * runtime.vocoder.cfg.samples_per_frame  # ICL: the reference's kept
        segments = [segment.shifted(lead) for segment in segments]
    wall, audio_s = time.perf_counter() - started, len(audio) / rate
    metrics = Metrics(
        len(codes), audio_s, wall, wall / audio_s, first or 0.0, wall, 1, request.seed, generation_s=generated
    )
    return Speech(audio.astype(np.float32, copy=False), rate, codes.cpu().numpy(), metrics, tuple(segments))
