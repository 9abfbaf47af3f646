"""Response audio formats: raw PCM, WAV, and what libsndfile encodes (FLAC, MP3, Ogg/Opus).

Every encoder takes float32 mono chunks at 24 kHz as they are generated and returns the bytes that
can go out now. Streaming decides what a header can say:

* `pcm`: 16-bit little-endian samples, no header.
* `wav`: a 44-byte header whose RIFF and data sizes are 0xFFFFFFFF ("length unknown", the usual
  convention for a WAV written to a pipe), then 16-bit PCM as it is generated. soundfile, the
  `wave` module, browsers and ffmpeg read it to the end of the body.
* `mp3`: constant bit rate, streamed frame by frame. The gapless (LAME/Xing) header can only be
  written once the length is known, so the stream starts with an empty frame and keeps the
  encoder's delay: decoders give about 0.09 s more than the generated audio.
* `opus`: Ogg/Opus, streamed page by page (a page holds up to about a second of audio).
* `flac`: sent in one piece when the utterance is complete, because its header (length, MD5) is
  final only then and libsndfile cannot read a FLAC stream whose length is unset.

A format is offered only when the installed libsndfile can encode it (MP3 needs libsndfile >= 1.1);
`available_formats()` probes that once.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..audio import SAMPLE_RATE, pcm16

UNKNOWN_SIZE = 0xFFFFFFFF  # RIFF/data chunk size of a WAV whose length is not known yet
# libsndfile applies the bit-rate mode only together with a compression level; 0.5 is 80 kbit/s here.
MP3_CBR = dict(bitrate_mode="CONSTANT", compression_level=0.5)


class AudioEncoder:
    """Raw 16-bit PCM; subclasses add a container."""

    def header(self) -> bytes:
        """Bytes that can be sent before any audio exists."""
        return b""

    def encode(self, audio: np.ndarray) -> bytes:
        """A chunk of float32 audio -> the bytes ready to send now (possibly none)."""
        return pcm16(audio)

    def finish(self) -> bytes:
        """The bytes that end the stream."""
        return b""

    @property
    def held(self) -> int:
        """Encoded bytes kept back, not yet returned (FLAC: the whole file until `finish`)."""
        return 0


class WavEncoder(AudioEncoder):
    def header(self) -> bytes:
        return wav_header(SAMPLE_RATE, UNKNOWN_SIZE)


def wav_header(sample_rate: int, data_bytes: int) -> bytes:
    """The 44-byte header of a mono 16-bit PCM WAV; `UNKNOWN_SIZE` for a stream of unknown length."""
    riff = UNKNOWN_SIZE if data_bytes == UNKNOWN_SIZE else 36 + data_bytes
    fmt = struct.pack("<HHIIHH", 1, 1, sample_rate, sample_rate * 2, 2, 16)  # PCM, mono, 2 bytes/sample
    return (
        b"RIFF"
        + struct.pack("<I", riff)
        + b"WAVEfmt "
        + struct.pack("<I", len(fmt))
        + fmt
        + b"data"
        + struct.pack("<I", data_bytes)
    )


class _Sink:
    """A seekable in-memory file for libsndfile that keeps only the bytes not yet sent.

    libsndfile rewrites a few header bytes when it closes a file (FLAC's STREAMINFO, MP3's tag
    frame); bytes already sent stay as they were, which is why those formats are set up so that
    the stream is valid without the rewrite (CBR MP3) or is sent only at the end (FLAC). So once
    bytes are sent (`unsent`) they are dropped: a rewrite of them is ignored, a read gives zeros,
    and a streamed utterance holds a page or a frame of encoded audio, not all of it.
    """

    def __init__(self) -> None:
        self.data = bytearray()  # the file's bytes from `base` on
        self.base = 0  # bytes sent and dropped before `data`
        self.position = 0  # in the whole file

    def write(self, chunk) -> int:
        chunk = bytes(chunk)
        written, start, end = len(chunk), self.position, self.position + len(chunk)
        self.position = end
        if end <= self.base:
            return written  # rewrites bytes already sent
        if start < self.base:
            chunk, start = chunk[self.base - start :], self.base
        if end - self.base > len(self.data):
            self.data.extend(bytes(end - self.base - len(self.data)))
        self.data[start - self.base : end - self.base] = chunk
        return written

    def read(self, size: int = -1) -> bytes:
        size = self.size - self.position if size < 0 else min(size, max(0, self.size - self.position))
        start = self.position
        self.position += size
        dropped = bytes(max(0, min(self.base, start + size) - start))  # bytes sent read back as zeros
        return dropped + bytes(self.data[max(start, self.base) - self.base : start + size - self.base])

    def seek(self, offset: int, whence: int = 0) -> int:
        base = (0, self.position, self.size)[whence]
        self.position = base + offset
        return self.position

    def tell(self) -> int:
        return self.position

    @property
    def size(self) -> int:
        return self.base + len(self.data)

    def unsent(self) -> bytes:
        """The bytes written since the last call, which are then dropped."""
        chunk = bytes(self.data)
        self.base += len(self.data)
        self.data = bytearray()
        return chunk


class SoundfileEncoder(AudioEncoder):
    """A libsndfile container; `streamed=False` holds every byte back until `finish()`."""

    def __init__(self, format: str, subtype: str, streamed: bool, **options):
        import soundfile as sf

        self._sink = _Sink()
        self._streamed = streamed
        self._file = sf.SoundFile(
            self._sink, "w", samplerate=SAMPLE_RATE, channels=1, format=format, subtype=subtype, **options
        )

    def encode(self, audio: np.ndarray) -> bytes:
        self._file.write(np.asarray(audio, dtype=np.float32))
        return self._sink.unsent() if self._streamed else b""

    def finish(self) -> bytes:
        self._file.close()
        return self._sink.unsent()

    @property
    def held(self) -> int:
        return len(self._sink.data)


@dataclass(frozen=True)
class AudioFormat:
    name: str  # the `response_format` value
    media_type: str  # Content-Type of the response
    make: Callable[[], AudioEncoder]  # a fresh encoder for one utterance


FORMATS = {
    f.name: f
    for f in (
        AudioFormat("pcm", "audio/pcm", AudioEncoder),
        AudioFormat("wav", "audio/wav", WavEncoder),
        AudioFormat("flac", "audio/flac", lambda: SoundfileEncoder("FLAC", "PCM_16", streamed=False)),
        AudioFormat(
            "mp3",
            "audio/mpeg",
            lambda: SoundfileEncoder("MP3", "MPEG_LAYER_III", streamed=True, **MP3_CBR),
        ),
        AudioFormat("opus", "audio/ogg", lambda: SoundfileEncoder("OGG", "OPUS", streamed=True)),
    )
}
# OpenAI's formats that libsndfile cannot encode at all (named in the error that refuses them).
UNSUPPORTED = ("aac",)


@functools.cache
def available_formats() -> dict[str, AudioFormat]:
    """The formats this machine's libsndfile can encode, in FORMATS order (probed once)."""
    found = {}
    silence = np.zeros(SAMPLE_RATE // 10, dtype=np.float32)
    for name, audio_format in FORMATS.items():
        try:
            encoder = audio_format.make()
            encoder.header()
            encoder.encode(silence)
            encoder.finish()
        except Exception:  # any failure means this libsndfile cannot encode it
            continue
        found[name] = audio_format
    return found
