"""Long text as segments: what each segment speaks with, and where its audio lies.

Scope: `LongTextOptions` (how a text is segmented and guarded); `plan`, the `Part`s a request speaks
one after the other (the pieces `split.split_text` cuts, each with its tokens, seed and frame
budget); `Allowance`, the frames a request's segments may make in all; and `Segment`, where a spoken
part's audio lies in the utterance and why it ended.

Non-goals: where a text is cut (split.py), the model's prompt (prompt.py), tokenization (text.py),
generating a part's frames (kazeia/utterance.py) and the runaway guard's rules (runaway.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .described import Described, option
from .errors import RequestError
from .sampling import MAX_SEED
from .speed import output_length
from .split import split_text
from .text import CLOSING_IDS, ROLE_IDS, TextTokenizer


@dataclass(frozen=True)
class LongTextOptions(Described):
    """How a whole text is split into segments and how each segment's generation is guarded."""

    segment: bool = option(True, "split a text longer than segment_tokens (False: one generation)")
    segment_tokens: int = option(96, "text tokens per segment at most (~25-30 s of English speech)")
    guard: bool = option(True, "stop a segment at its frame budget or when it loops (off with ignore_eos)")
    floor_frames: int = option(64, "frame budget of a segment: floor_frames + frames_per_token per text token")
    frames_per_token: int = option(8, "frames (80 ms each) a segment may take per text token, over the floor")
    loop_frames: int = option(48, "a segment whose last loop_frames codebook-0 tokens repeat a short pattern stops")
    carry_context: bool = option(False, "Base checkpoints: each segment continues the previous one's text and frames")

    def __post_init__(self) -> None:
        for name in ("segment", "guard", "carry_context"):
            if not isinstance(getattr(self, name), bool):
                raise RequestError(name, f"{name} must be True or False, got {getattr(self, name)!r}")
        for name, low in (("segment_tokens", 1), ("floor_frames", 1), ("frames_per_token", 0), ("loop_frames", 16)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise RequestError(name, f"{name} must be an integer >= {low}, got {value!r}")

    def frame_budget(self, text_tokens: int) -> int:
        """Frames a segment of `text_tokens` text tokens may take before the guard stops it."""
        return self.floor_frames + self.frames_per_token * text_tokens

    def text_budget(self, text_tokens: int) -> int:
        """Frames a text of `text_tokens` tokens may take in all, however it is cut: the segment
        budgets of that text in segments half full (two consecutive segments of one paragraph never
        fit one budget together), plus one (`Allowance`)."""
        segments = 2 * -(-text_tokens // self.segment_tokens) + 1
        return self.floor_frames * segments + self.frames_per_token * text_tokens


TEMPLATE_IDS = ROLE_IDS + CLOSING_IDS  # the assistant template's ids around a text's tokens
SEED_STEP = 0x9E3779B97F4A7C15  # segment k speaks with seed + k * SEED_STEP (mod MAX_SEED): distinct, reproducible


@dataclass(frozen=True)
class Part:
    """One segment of a whole text, as the talker speaks it."""

    text: str  # the segment's text (the whole text, as given, when it is one segment)
    text_ids: tuple[int, ...]  # its assistant template's ids
    seed: int  # its own seed, derived from the request's (segment 0: the request's seed itself)
    budget: int | None  # the runaway guard's frame budget (None: only max_new_tokens bounds it)

    @property
    def text_tokens(self) -> int:
        return len(self.text_ids) - TEMPLATE_IDS


def plan(
    text: str,
    text_ids: tuple[int, ...],
    tokenizer: TextTokenizer,
    long_text: LongTextOptions,
    seed: int,
    max_new_tokens: int,
    guarded: bool,
) -> tuple[Part, ...]:
    """The parts of `text` (its assistant template's ids `text_ids`): one for a text within the
    budget or with segmentation off, else its `split_text` pieces (counted in text tokens), each
    with its template's ids, its seed and, when `guarded`, its frame budget (None where
    max_new_tokens comes first).

    A request's frames are bounded by its text, whatever its options (`Allowance`)."""
    texts = [text]
    if long_text.segment and len(text_ids) - TEMPLATE_IDS > long_text.segment_tokens:
        count = lambda piece: len(tokenizer.text_ids(piece))  # noqa: E731
        texts = [piece.strip() for piece in split_text(text, long_text.segment_tokens, count)]
    ids = [tuple(text_ids) if len(texts) == 1 else tuple(tokenizer.assistant_ids(piece)) for piece in texts]
    allowance = Allowance(long_text, max_new_tokens, guarded)
    budgets = [allowance.take(len(i) - TEMPLATE_IDS) for i in ids]
    seeds = [part_seed(seed, k) for k in range(len(texts))]
    return tuple(Part(*part) for part in zip(texts, ids, seeds, budgets, strict=True))


def part_seed(seed: int, index: int) -> int:
    """The seed segment `index` speaks with (segment 0: the request's own)."""
    return (seed + index * SEED_STEP) % MAX_SEED


class Allowance:
    """The frames a request's segments may make, taken in speaking order, so that a text still
    arriving (kazeia/live.py) gets each segment's budget as soon as that segment is known, the same
    as the whole text's: a request's frames are bounded by its text, whatever its options.

    Segments 0..k together may make at most the larger of `max_new_tokens - 1` (one generation) and
    `long_text.text_budget` of their text tokens. A guarded segment's budget is its own
    (`frame_budget`) cut to what is left of that (at least 1 frame; None where max_new_tokens - 1
    comes first), which only a text of many short paragraphs (each a segment, each with a floor)
    ever reaches. An unguarded segment (ignore_eos, or the guard off) may make max_new_tokens - 1
    frames: one that would go past what is left is a RequestError naming max_new_tokens."""

    def __init__(self, long_text: LongTextOptions, max_new_tokens: int, guarded: bool):
        self.long_text, self.frames, self.guarded = long_text, max_new_tokens - 1, guarded
        self.tokens = 0  # text tokens of the segments taken
        self.spent = 0  # frames they may make in all
        self.taken = 0  # segments taken

    def left(self, tokens: int) -> int:
        """Frames the next segment may make, were it of `tokens` text tokens."""
        return max(self.frames, self.long_text.text_budget(self.tokens + tokens)) - self.spent

    def least(self, tokens: int) -> int:
        """The next guarded segment's budget before the None of max_new_tokens: never more than
        once it has more tokens, so a lower bound while its text is still arriving."""
        return max(1, min(self.long_text.frame_budget(tokens), self.left(tokens)))

    def take(self, tokens: int) -> int | None:
        """The next segment, of `tokens` text tokens: its budget (None: max_new_tokens - 1 bounds it)."""
        if self.guarded:
            budget = self.least(tokens)
            budget = None if budget >= self.frames else budget
        elif self.frames > (left := self.left(tokens)):
            most = (self.long_text.text_budget(self.tokens + tokens) // (self.taken + 1)) + 1
            raise RequestError(
                "max_new_tokens",
                f"without the runaway guard (ignore_eos, or the guard off) each segment makes up to max_new_tokens - 1 "
                f"= {self.frames} frames, but the text up to segment {self.taken + 1} allows at most {max(left, 0)} "
                f"more: ask for max_new_tokens <= {most}, or keep the guard",
            )
        else:
            budget = None
        self.tokens, self.taken = self.tokens + tokens, self.taken + 1
        self.spent += self.frames if budget is None else budget
        return budget


@dataclass(frozen=True)
class Segment:
    """One segment of an utterance (a whole short text is one) and where its audio lies."""

    index: int  # 0, 1, ... in speaking order
    text: str  # what it says
    start_sample: int  # its first sample in the utterance's audio (24 kHz)
    end_sample: int  # one past its last sample
    finish_reason: str  # why its generation ended: "eos", "length", "guard" or "cancelled" (runaway.py)
    sample_rate: int  # Hz (24000)

    @property
    def start_s(self) -> float:
        return self.start_sample / self.sample_rate

    @property
    def end_s(self) -> float:
        return self.end_sample / self.sample_rate

    def at_speed(self, speed: float) -> Segment:
        """Its samples in output time at `speed`: the stretch's length rule (speed.py) applied to its
        ends (exact for the utterance's end; within the stretch's window, ~25 ms, at joins)."""
        if speed == 1.0:
            return self
        start, end = (output_length(n, speed) for n in (self.start_sample, self.end_sample))
        return replace(self, start_sample=start, end_sample=end)

    def shifted(self, samples: int) -> Segment:
        """Its samples `samples` later (an ICL voice's lead before the generated audio)."""
        return replace(self, start_sample=self.start_sample + samples, end_sample=self.end_sample + samples)
