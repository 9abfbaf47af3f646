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
from dataclasses import dataclass

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
    """The offline audio of `request`, chunk by chunk, from `stream` (made with offline blocks)."""

    def __init__(self, runtime: Runtime, request: Request, stream: SpeechStream):
        self.runtime, self.request, self.stream = runtime, request, stream
        self.lead = 0  # samples of the reference before the generated audio (known at the end)

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
                    held.append(AudioChunk(np.empty(0, np.float32), *_rest(chunk)))
                    continue
                frames = len(self.stream.codes) if self.stream.codes is not None else 0
                lead = self.runtime.priming.lead(ref, frames)
                self.lead = len(lead)
                if self.lead:
                    yield AudioChunk(lead, 0, 0, False)
                spool.seek(0)
                for kept in held:
                    audio = np.frombuffer(spool.read(4 * _samples(kept, self.runtime)), np.float32)
                    yield AudioChunk(audio, kept.start_sample + self.lead, kept.frames, False, kept.segments)
                yield AudioChunk(chunk.audio, chunk.start_sample + self.lead, *_rest(chunk)[1:])


def _rest(chunk: AudioChunk) -> tuple:
    """A chunk's fields after its audio."""
    return chunk.start_sample, chunk.frames, chunk.is_last, chunk.segments


def _samples(chunk: AudioChunk, runtime: Runtime) -> int:
    """The samples of a held chunk (speed 1: its frames' exact length)."""
    return chunk.frames * runtime.vocoder.cfg.samples_per_frame


@torch.inference_mode()
def reference_chunked(runtime: Runtime, request: Request, started: float) -> tuple:
    """The reference package's decode of all of a request's frames, made once they are all
    generated: every 300 frames (24 s) a restart from 25 frames of context (identical to one decode
    up to 300 frames, an approximation after) -> (audio, codes (frames, 16), segments, (seconds
    from `started` to the first frame, to the last))."""
    frames: list[torch.Tensor] = []
    segments: list[Segment] = []
    first = None
    for item in timeline(runtime, request):
        if isinstance(item, Segment):
            segments.append(item)
            continue
        frames.append(item)
        first = first if first is not None else time.perf_counter() - started
    timing = (first or 0.0, time.perf_counter() - started)
    codes = torch.stack(frames)
    ref, vocoder = request.cond.reference_codes, runtime.vocoder
    if ref is None:
        audio = vocoder.decode_reference_chunked(codes.to(runtime.device)[None])[0].float().cpu().numpy()
    else:
        audio = runtime.priming.reference_chunked(ref, codes)
    if request.speed != 1.0:
        audio = stretch(audio, request.speed, vocoder.cfg.sample_rate)
        return audio, codes, [segment.at_speed(request.speed) for segment in segments], timing
    lead = len(audio) - codes.shape[0] * vocoder.cfg.samples_per_frame  # ICL: the reference's samples kept
    return audio.astype(np.float32, copy=False), codes, [segment.shifted(lead) for segment in segments], timing
