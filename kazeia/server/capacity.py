"""How many utterances this server keeps in real time, as its own streams show it (`Capacity`).

Every chunk a worker thread takes from its stream after the first is evidence: the seconds of audio
in it against the seconds the thread waited for it, at the number of utterances being spoken then
(the level). A stream's first chunk waits for its prompt, a cost its listener meets as the time to
first audio, not as a stall; the prompt's load on the others shows in their chunks.
A level's pace, audio seconds per second waited over its recent chunks, is what its listeners
get: below 1 they run dry. A stream never gets faster for having more beside it (they share the
same cores; batching only makes sharing cheaper), so a level measured slower than real time rules
out every level above it too. `holds(k)` is False when some level up to k was measured slower than
real time. A level never measured is given the benefit of the doubt (trying it is the only way to
learn it), and one utterance alone always holds: refusing it would serve no one.

Evidence fades (half-life HALF_LIFE_S), so that a machine whose busy neighbour has gone quiet is
tried again, and a level's pace counts only once MIN_EVIDENCE_S of waiting stand behind it. Live
text is no evidence (its chunks wait for the client's text). Times are arguments: no figure here
depends on a clock.
"""

from __future__ import annotations

import threading

HALF_LIFE_S = 60.0  # seconds after which a level's evidence weighs half
MIN_EVIDENCE_S = 2.0  # seconds of waiting behind a level's pace before it counts
REAL_TIME = 1.0  # audio seconds per second a listener needs


class Capacity:
    """The measured pace of each level from 1 to `most` (module docstring)."""

    def __init__(self, most: int, half_life_s: float = HALF_LIFE_S, min_evidence_s: float = MIN_EVIDENCE_S):
        if most < 1 or not half_life_s > 0 or not min_evidence_s > 0:
            raise ValueError(f"bad capacity settings: most={most}, half-life {half_life_s}, evidence {min_evidence_s}")
        self.most, self.half_life_s, self.min_evidence_s = most, half_life_s, min_evidence_s
        self._audio = [0.0] * (most + 1)  # per level (index 0 unused): audio seconds, faded
        self._waited = [0.0] * (most + 1)  # seconds waited for them, faded alike
        self._at = [0.0] * (most + 1)  # when each level's sums were last faded
        self._lock = threading.Lock()

    def observe(self, level: int, audio_s: float, waited_s: float, now: float) -> None:
        """A chunk of `audio_s` seconds came out after `waited_s`, with `level` utterances being
        spoken (clamped to 1..most)."""
        if not audio_s >= 0 or not waited_s >= 0:
            return  # nothing to learn from (a clock that stepped back)
        level = min(max(level, 1), self.most)
        with self._lock:
            self._fade(level, now)
            self._audio[level] += audio_s
            self._waited[level] += waited_s

    def paces(self, now: float) -> dict[int, float]:
        """The pace of each level with enough evidence behind it."""
        out = {}
        with self._lock:
            for level in range(1, self.most + 1):
                self._fade(level, now)
                if self._waited[level] >= self.min_evidence_s:
                    out[level] = self._audio[level] / self._waited[level]
        return out

    def holds(self, level: int, now: float) -> bool:
        """Whether `level` utterances at once are expected to keep real time (module docstring)."""
        if level <= 1:
            return True
        return all(pace >= REAL_TIME for below, pace in self.paces(now).items() if below <= level)

    def most_held(self, now: float) -> int:
        """The largest level up to `most` that holds."""
        return max(level for level in range(1, self.most + 1) if self.holds(level, now))

    def _fade(self, level: int, now: float) -> None:
        elapsed = now - self._at[level]
        if elapsed > 0:
            weight = 0.5 ** (elapsed / self.half_life_s)
            self._audio[level] *= weight
            self._waited[level] *= weight
            self._at[level] = now
