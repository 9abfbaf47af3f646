"""Subtitles from a long text's segments: SubRip (.srt) and WebVTT (.vtt).

Each segment is one cue, from its first to one past its last sample (exact: segments end on frame
boundaries), in milliseconds rounded down; a segment with no audio (one stopped before its first
frame) has none. Non-goals: reflowing text into lines, styling.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from .segment import Segment

FORMATS = (".srt", ".vtt")


def _clock(sample: int, rate: int, separator: str) -> str:
    ms = sample * 1000 // rate
    hours, ms = divmod(ms, 3_600_000)
    minutes, ms = divmod(ms, 60_000)
    seconds, ms = divmod(ms, 1000)
    return f"{hours:02d}:{minutes:02d}:{seconds:02d}{separator}{ms:03d}"


def _cues(segments: Sequence[Segment], separator: str, numbered: bool) -> str:
    cues = []
    for n, segment in enumerate((s for s in segments if s.end_sample > s.start_sample), 1):
        start = _clock(segment.start_sample, segment.sample_rate, separator)
        end = _clock(segment.end_sample, segment.sample_rate, separator)
        text = "\n".join(line.strip() for line in segment.text.strip().splitlines() if line.strip())
        cues.append((f"{n}\n" if numbered else "") + f"{start} --> {end}\n{text}\n\n")
    return "".join(cues)


def srt(segments: Sequence[Segment]) -> str:
    """SubRip: numbered cues, `HH:MM:SS,mmm` times."""
    return _cues(segments, ",", numbered=True)


def vtt(segments: Sequence[Segment]) -> str:
    """WebVTT: a `WEBVTT` header, then cues with `HH:MM:SS.mmm` times."""
    return "WEBVTT\n\n" + _cues(segments, ".", numbered=False)


def write_subtitles(path: str | os.PathLike, segments: Sequence[Segment]) -> None:
    """Write `segments` as SubRip or WebVTT, by the extension of `path` (.srt or .vtt)."""
    suffix = Path(path).suffix.lower()
    if suffix not in FORMATS:
        raise ValueError(f"subtitles file {str(path)!r} must end in .srt or .vtt")
    Path(path).write_text(srt(segments) if suffix == ".srt" else vtt(segments), encoding="utf-8")
