"""The runaway guard: why a segment's generation ended, and stopping one that would never end.

A talker that misses EOS keeps generating until `max_new_tokens` (minutes of noise or silence,
reported as a success by most engines). The guard gives each segment a frame budget from its
text (`LongTextOptions.frame_budget`: a floor plus frames per text token) and watches codebook 0,
the semantic codebook, for a loop: the last `loop_frames` tokens repeating a pattern of at most
`MAX_PERIOD` tokens (a stuck syllable; a held near-silence is one or two tokens repeated), or
holding at most `STILL_TOKENS` distinct tokens (a near-silence that wavers between a few codes).
It decides from the codes alone, so the same seed stops at the same frame, streamed or not.

Finish reasons (per segment and overall): `eos` (the model ended it), `length` (it reached
`max_new_tokens`), `guard` (the budget or the loop rule stopped it), `cancelled` (the caller
stopped it). Non-goals: the frame loop itself (generate.py), segmentation (segment.py).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

EOS, LENGTH, GUARD, CANCELLED = "eos", "length", "guard", "cancelled"
FINISH_REASONS = (EOS, LENGTH, GUARD, CANCELLED)
MAX_PERIOD = 8  # longest codebook-0 pattern (frames, 640 ms) whose repetition counts as a loop
STILL_TOKENS = 3  # a window with at most this many distinct codebook-0 tokens is a held sound


class RunawayGuard:
    """Watches one segment's frames: `stops(token)` after each frame says whether to end it there."""

    def __init__(self, budget: int | None | Callable[[int], int | None], loop_frames: int):
        # frames at most (None: only max_new_tokens bounds it); or a function of the frames made that
        # gives it (a live text's segment: its budget is known once its text is, live.LivePart.budget_at)
        self.budget = budget
        self.loop_frames = loop_frames
        self.frames = 0
        self.looped = False  # stopped by the loop rule (not the budget)
        self._recent: deque[int] = deque(maxlen=loop_frames)  # the last codebook-0 tokens

    def stops(self, token: int) -> bool:
        """Record the codebook-0 token of the frame just made; True: stop the segment after it."""
        self.frames += 1
        self._recent.append(token)
        budget = self.budget(self.frames) if callable(self.budget) else self.budget
        if budget is not None and self.frames >= budget:
            return True
        self.looped = len(self._recent) == self.loop_frames and is_loop(list(self._recent))
        return self.looped


def is_loop(tokens: list[int]) -> bool:
    """Whether a window of codebook-0 tokens is a loop: periodic with a period of at most
    MAX_PERIOD, or made of at most STILL_TOKENS distinct tokens."""
    if len(set(tokens)) <= STILL_TOKENS:
        return True
    return any(
        all(tokens[i] == tokens[i - period] for i in range(period, len(tokens))) for period in range(1, MAX_PERIOD + 1)
    )


def overall(reasons: list[str]) -> str:
    """One reason for a whole utterance: the most serious of its segments' (cancelled > guard >
    length > eos); `eos` for none."""
    for reason in (CANCELLED, GUARD, LENGTH):
        if reason in reasons:
            return reason
    return EOS
