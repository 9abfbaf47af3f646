"""`kazeia say`: a text spoken into an audio file (or onto standard output) as it is generated.

Scope: reading the text (an argument, a UTF-8 file, or standard input, whole or as it arrives),
writing each chunk of the engine's stream to the sink the moment it is decoded (an audio file
through soundfile, in any format it writes, or raw 16-bit PCM on standard output), the progress
bar on stderr, the subtitles, the summary line and the warning when the runaway guard fired.
Nothing but the codes (128 bytes a frame) is kept, so memory stays flat however long the text.

Ctrl-C: the first SIGINT stops generation before its next frame; the frames made so far are
decoded and written, the file is closed with a complete header (WAV sizes, FLAC length), the
subtitles cover the segments spoken, and the command exits with status 130 and one line. A second
SIGINT interrupts at once (the file is still closed properly).
Non-goals: argument parsing and the other commands (cli.py).
"""

from __future__ import annotations

import codecs
import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np

from .options import StreamOptions
from .runaway import CANCELLED
from .streaming import AudioChunk

INTERRUPTED = 130  # exit status after Ctrl-C (128 + SIGINT), as shells report it


def say(engine, args, options: StreamOptions) -> int:
    """Speak the text `args` describe with `engine` and `options` into `args.output`; the exit status.
    Without --stream the audio is `Engine.synthesize`'s (`Engine.assemble`); with it, the stream's."""
    started = time.perf_counter()
    request = engine.request(_text(args, streaming=args.stream), options)
    stop = threading.Event()
    shown = args.progress if args.progress is not None else sys.stderr.isatty()
    with _first_interrupt_stops(stop), _sink(args.output) as write:
        if args.stream:  # the smallest chunks for the first audio
            audio = stream = engine.stream_request(request, options.schedule, stop.is_set, started)
        else:
            audio = engine.assemble(request, stop.is_set, started)
            stream = audio.stream
        with stream, Progress(len(request.parts) or None, shown, engine.vocoder.cfg.sample_rate) as bar:
            for chunk in audio:
                write(chunk.audio)
                bar.advance(chunk)
    segments = audio.segments  # an Assembly's are shifted by its lead
    m = stream.metrics
    assert m is not None  # a stream stopped by `stop` still ends with its last chunk
    where = "stdout" if args.output == "-" else args.output
    if stream.finish_reason == CANCELLED:
        subtitles = f"; subtitles in {_subtitles(args, segments)}" if args.subtitles else ""
        spoken = sum(s.end_sample > s.start_sample for s in segments)
        total = f" of {len(request.parts)}" if request.parts else ""
        print(
            f"kazeia: interrupted: {where} holds the first {m.audio_s:.2f} s of audio "
            f"({spoken}{total} segments){subtitles}",
            file=sys.stderr,
        )
        return INTERRUPTED
    print(
        f"{where}: {m.audio_s:.2f} s of audio ({m.frames} frames, {_count(len(segments), 'segment')}) in "
        f"{m.wall_s:.2f} s, TTFB {m.ttfb_s * 1000:.0f} ms, RTF {m.rtf:.2f}, seed {m.seed}",
        file=sys.stderr,
    )
    if args.subtitles:
        print(f"{_subtitles(args, segments)}: {len(segments)} subtitles", file=sys.stderr)
    _warn_guard(segments)
    return 0


class Progress:
    """A tqdm bar on stderr over the segments spoken (its ETA from their rate), with the seconds of
    audio written and the real-time factor so far; draws nothing when not `shown`."""

    def __init__(self, segments: int | None, shown: bool, sample_rate: int):
        from tqdm import tqdm

        self._bar = tqdm(total=segments, unit=" segment", disable=not shown, file=sys.stderr, dynamic_ncols=True)
        self._rate, self._started = sample_rate, time.perf_counter()

    def advance(self, chunk: AudioChunk) -> None:
        """Account for a chunk just written (and the segments it ended)."""
        audio_s = (chunk.start_sample + len(chunk.audio)) / self._rate
        wall = time.perf_counter() - self._started
        rtf = f"{wall / audio_s:.2f}" if audio_s else "-"
        self._bar.set_postfix_str(f"{audio_s:.1f} s audio, RTF {rtf}", refresh=False)
        if chunk.segments:
            self._bar.update(len(chunk.segments))  # refreshes, at most every `mininterval` seconds
        elif not self._bar.disable and time.time() - self._bar.last_print_t >= self._bar.mininterval:
            self._bar.refresh()  # the audio seconds move within a long segment too

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self._bar.close()


@contextlib.contextmanager
def _sink(output: str) -> Iterator[Callable[[np.ndarray], object]]:
    """A function that writes a chunk of audio where `output` says, at once: `-` raw 16-bit PCM on
    standard output (flushed), else an audio file in the format of its extension, closed (its header
    complete) however the writing ends."""
    from .audio import open_audio_writer, pcm16

    if output == "-":
        out = sys.stdout.buffer

        def write(audio: np.ndarray) -> None:
            out.write(pcm16(audio))
            out.flush()

        yield write
        return
    with open_audio_writer(output) as file:
        yield file.write


@contextlib.contextmanager
def _first_interrupt_stops(stop: threading.Event) -> Iterator[None]:
    """While inside: the first SIGINT sets `stop` instead of raising, and puts the previous handler
    back, so that a second one interrupts at once. Outside the main thread signals cannot be
    handled: Ctrl-C stays as it was."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    restore = previous if previous is not None else signal.default_int_handler

    def first(signum, frame) -> None:
        stop.set()
        signal.signal(signal.SIGINT, restore)

    signal.signal(signal.SIGINT, first)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, restore)


def _subtitles(args, segments) -> str:
    from .subtitles import write_subtitles

    write_subtitles(args.subtitles, segments)
    return args.subtitles


def _warn_guard(segments) -> None:
    """A warning when the runaway guard had to stop segments."""
    stopped = [s for s in segments if s.finish_reason == "guard"]
    if stopped:
        where = ", ".join(f"{s.index + 1} at {s.start_s:.1f} s" for s in stopped[:5])
        more = f" and {len(stopped) - 5} more" if len(stopped) > 5 else ""
        print(
            f"kazeia: warning: the runaway guard stopped {len(stopped)} of {len(segments)} segments "
            f"(no end of speech within their frame budget, or a loop): {where}{more}",
            file=sys.stderr,
        )


def _text(args, streaming: bool = False):
    """The text to speak: the argument, standard input (`-`; with --stream as it arrives) or --text-file."""
    if args.text_file is not None and args.text_file != "-":
        with open(args.text_file, "rb") as file:
            return _utf8(file.read(), 0, final=True, name=args.text_file)
    if args.text == "-" or args.text_file == "-":
        return _stdin_deltas() if streaming else _utf8(sys.stdin.buffer.read(), 0, final=True)
    return args.text


def _utf8(data: bytes, offset: int, final: bool, decoder=None, name: str = "standard input") -> str:
    """Standard input (or the text file `name`) is UTF-8; anything else is refused with the offset of
    the first bad byte."""
    try:
        return decoder.decode(data, final) if decoder is not None else data.decode("utf-8")
    except UnicodeDecodeError as error:
        bad = error.object[error.start : error.start + 1].hex() or "end"  # object: what the decoder held
        at = offset + len(data) - len(error.object) + error.start
        raise ValueError(f"{name} is not valid UTF-8: byte 0x{bad} at offset {at}") from None


def _stdin_deltas():
    """Standard input as text deltas, each as soon as it arrives (e.g. piped from an LLM CLI)."""
    decoder, offset = codecs.getincrementaldecoder("utf-8")(), 0
    while data := os.read(sys.stdin.fileno(), 4096):
        if text := _utf8(data, offset, False, decoder):
            yield text
        offset += len(data)
    if text := _utf8(b"", offset, True, decoder):
        yield text


def _count(n: int, noun: str) -> str:
    """'1 segment', '3 segments'."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
