"""Speaking rate: time-scale modification that changes the pace of speech, not its pitch.

`TimeStretch` is WSOLA (waveform-similarity overlap-add): output frames of `WINDOW_S` (Hann
window, half-overlapping) are cut from the input around the nominal position `output_time * speed`,
each shifted by up to `TOLERANCE_S` to the place whose start looks most like the natural
continuation of the previous frame (normalised cross-correlation over the overlap), so the
waveform stays periodic across joins and the pitch is untouched. It carries its state from one
`push` to the next: audio given chunk by chunk yields the same samples as the whole of it given
at once, whatever the chunk sizes, because each output frame is made once, from the same input
samples, as soon as they are all there.

Length: `n` input samples become exactly `output_length(n, speed)` = floor(n / speed + 1/2)
output samples; `push` returns only samples that are final, `flush` the rest (the input is taken
as silence past its end). Non-goals: speeds outside `SPEED_RANGE`, music, more than one channel.
"""

from __future__ import annotations

import math

import numpy as np

SPEED_RANGE = (0.25, 4.0)  # the speeds accepted (OpenAI's range for `speed`)
WINDOW_S = 0.025  # seconds per output frame (its Hann window); frames overlap by half
TOLERANCE_S = 0.010  # seconds a frame may move from its nominal place, either way
_EPS = 1e-12  # keeps the normalisation finite in silence


def check_speed(speed) -> float:
    """`speed` as a float, or a ValueError naming the accepted range."""
    low, high = SPEED_RANGE
    if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not low <= speed <= high:
        raise ValueError(f"speed must be a number from {low} to {high}, got {speed!r}")
    return float(speed)


def output_length(samples: int, speed: float) -> int:
    """Samples out for `samples` samples in at `speed`: floor(samples / speed + 1/2)."""
    return math.floor(samples / speed + 0.5)


class TimeStretch:
    """WSOLA with carried state: `push` input chunks, get the output samples that are final; `flush`
    once at the end for the rest. One instance per utterance."""

    def __init__(self, speed: float, sample_rate: int = 24000):
        self.speed = check_speed(speed)
        self.win = 2 * round(WINDOW_S * sample_rate / 2)  # samples per frame (even)
        self.hop = self.win // 2  # output samples between frames
        self.tol = round(TOLERANCE_S * sample_rate)  # samples of shift either way
        n = np.arange(self.win)
        self.window = 0.5 - 0.5 * np.cos(2 * np.pi * n / self.win)  # periodic Hann: sums to 1 at hop win/2
        # Input positions are "padded": input sample i sits at i + pad, with silence before it, so the
        # first frames (centred on output time 0) can look left of the start.
        self._pad = self.win // 2 + self.tol
        self._input = np.zeros(self._pad)  # padded positions [_in_base, _in_base + len)
        self._in_base = 0
        self._received = 0  # input samples pushed
        self._frame = 0  # the next output frame to make
        self._prev: int | None = None  # padded start of the last frame's input segment
        self._output = np.zeros(self.win)  # output positions [_out_base, _out_base + len)
        self._out_base = -self.hop  # frame k covers output [(k - 1) * hop, (k + 1) * hop)
        self._emitted = 0  # output samples returned so far
        self._flushed = False

    def push(self, audio: np.ndarray) -> np.ndarray:
        """Add input samples (1-D float); return the output samples that no later input can change."""
        if self._flushed:
            raise RuntimeError("push after flush: a TimeStretch serves one utterance")
        audio = np.asarray(audio, dtype=np.float64).reshape(-1)
        self._input = np.concatenate([self._input, audio])
        self._received += len(audio)
        end = self._in_base + len(self._input)
        while self._need(self._frame) <= end:
            self._make_frame()
        return self._take(min(self._final(), output_length(self._received, self.speed)))

    def flush(self) -> np.ndarray:
        """The remaining output: the total is exactly `output_length(pushed samples, speed)`."""
        if self._flushed:
            return np.zeros(0, np.float32)
        self._flushed = True
        total = output_length(self._received, self.speed)
        while self._final() < total:  # frames past the input's end read silence
            short = self._need(self._frame) - (self._in_base + len(self._input))
            if short > 0:
                self._input = np.concatenate([self._input, np.zeros(short)])
            self._make_frame()
        return self._take(total)

    # -- one output frame ----------------------------------------------------------------------
    def _nominal(self, k: int) -> int:
        """Padded start of frame k's input segment before the search: centred on input time k * hop * speed."""
        return self._pad + round(k * self.hop * self.speed) - self.win // 2

    def _need(self, k: int) -> int:
        """Padded input position up to which frame k reads."""
        return self._nominal(k) + self.tol + self.win

    def _final(self) -> int:
        """Output samples complete so far: those before the next frame's start."""
        return (self._frame - 1) * self.hop

    def _make_frame(self) -> None:
        k, nominal = self._frame, self._nominal(self._frame)
        start = nominal if self._prev is None else self._search(nominal, self._prev + self.hop)
        segment = self._at(start, self.win) * self.window
        offset = k * self.hop - self.hop - self._out_base
        if offset + self.win > len(self._output):
            self._output = np.concatenate([self._output, np.zeros(offset + self.win - len(self._output))])
        self._output[offset : offset + self.win] += segment
        self._prev, self._frame = start, k + 1
        keep = min(self._nominal(k + 1) - self.tol, start + self.hop)  # the next frame reads from here on
        if keep > self._in_base:
            self._input = self._input[keep - self._in_base :]
            self._in_base = keep

    def _search(self, nominal: int, natural: int) -> int:
        """The start in [nominal - tol, nominal + tol] whose first `hop` samples best match the
        natural continuation of the previous frame (those at `natural`)."""
        overlap = self.hop
        template = self._at(natural, overlap)
        region = self._at(nominal - self.tol, 2 * self.tol + overlap)
        corr = np.correlate(region, template, mode="valid")  # (2 * tol + 1,)
        energy = np.concatenate([[0.0], np.cumsum(region * region)])
        energy = energy[overlap:] - energy[:-overlap]  # sliding sum of squares over `overlap`
        score = corr / np.sqrt(np.maximum(energy, 0.0) + _EPS)
        return nominal - self.tol + int(np.argmax(score))

    def _at(self, start: int, length: int) -> np.ndarray:
        """A copy of the padded input [start, start + length): identical arithmetic whatever the
        chunking, since every frame's inputs are fresh arrays of the same values."""
        i = start - self._in_base
        return self._input[i : i + length].copy()

    def _take(self, upto: int) -> np.ndarray:
        """Return output [_emitted, upto) (positions >= 0) and drop what is no longer needed."""
        upto = max(upto, self._emitted)
        lo, hi = self._emitted - self._out_base, upto - self._out_base
        out = self._output[lo:hi].astype(np.float32)
        self._emitted = upto
        drop = min(upto, self._final()) - self._out_base  # the next frame adds from _final() on
        if drop > 0:
            self._output = self._output[drop:]
            self._out_base += drop
        return out


def stretch(audio: np.ndarray, speed: float, sample_rate: int = 24000) -> np.ndarray:
    """The whole of `audio` at `speed` (float32): one `TimeStretch`, pushed once and flushed."""
    ts = TimeStretch(speed, sample_rate)
    return np.concatenate([ts.push(audio), ts.flush()])
