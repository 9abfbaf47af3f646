"""Long text as segments: how a text is cut, what each segment speaks with, and where its audio lies.

Scope: `LongTextOptions` (how a text is segmented and guarded); `split_text`, which cuts a text into
pieces of at most a token budget each: whole paragraphs (a blank line always ends a segment) packed
from whole sentences, a sentence too long split at clauses (commas, semicolons, colons, dashes), a
clause too long at spaces between words, and a word too long (a run of Chinese or Japanese without
punctuation) between characters; `plan`, the `Part`s a request speaks one after the other (each
piece's tokens, seed and frame budget); and `Segment`, where a spoken part's audio lies in the
utterance and why it ended. The pieces concatenate back to the text: each keeps the whitespace that
follows it.

Sentence ends: `.`, `!`, `?`, `…` and runs of them (an ellipsis), with closing quotes or brackets,
followed by whitespace; `。！？` (and their fullwidth relatives) with or without whitespace; and line
breaks. A full stop is not an end after a known abbreviation ("Dr.", "z. B.", "M.", "т. е."), after a
single letter (initials), inside a number ("3.14" has no space), or when the next word starts with
a lowercase letter or a digit ("Wait... what?" is one sentence; "etc. and" too).

Non-goals: the model's prompt (prompt.py), tokenization (text.py: `split_text` only counts tokens
through the function it is given), generating a part's frames (kazeia/utterance.py) and the runaway
guard's rules (runaway.py).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace

from .described import Described, option
from .errors import RequestError
from .sampling import MAX_SEED
from .speed import output_length
from .text import CLOSING_IDS, ROLE_IDS, TextTokenizer

# Words that end with a full stop without ending a sentence (compared in lowercase, without the stop).
ABBREVIATIONS = frozenset(
    """
    mr mrs ms dr prof st sr jr vs etc e.g i.e cf no nos vol fig approx dept est inc ltd co corp jan feb mar
    apr jun jul aug sep sept oct nov dec mt ft gen col lt sgt capt rev hon
    m mm mme mmes mlle mlles me mgr pr env cie ex p.ex av bd
    z.b d.h u.a bzw ca evtl ggf inkl nr str tel vgl hr fr dipl
    sra srta dña dra ud uds pág núm
    sig dott ing avv
    т.е т.д т.п г гг им др пр ул стр
    """.split()
)
_TERMINATORS = ".!?…"
_CJK_TERMINATORS = "。！？｡．"
_CLOSERS = "\"'”’»)]}」』）】〉》"
# A sentence end, the closing quotes/brackets after it, and the whitespace after those. A match
# starts only at the first character of a run of terminators (or of spaces before a newline): from
# inside a run it could only end where the run's first character's match ends, and trying every
# position of a long run ("a....b", spaces with no newline) would take time quadratic in its length.
_SENTENCE_END = re.compile(
    rf"(?:(?<![{re.escape(_TERMINATORS)}])[{re.escape(_TERMINATORS)}]+[{re.escape(_CLOSERS)}]*(?=\s|$)"
    rf"|[{_CJK_TERMINATORS}]+[{re.escape(_CLOSERS)}]*)\s*"
    r"|(?<![^\S\n])[^\S\n]*\n\s*"
)
# A clause end: Latin punctuation followed by whitespace, a spaced dash, or CJK clause punctuation.
_CLAUSE_END = re.compile(r"(?:[,;:](?=\s)|\s[—–-](?=\s)|[，、；：])\s*")
_PARAGRAPH_END = re.compile(r"\n[^\S\n]*\n\s*")
_WORD_END = re.compile(r"\s+")


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
        """Frames a whole text of `text_tokens` tokens may take in all, however it is cut: the
        segment budgets of that text in segments half full (two consecutive segments of one
        paragraph never fit one budget together), plus one. Texts of many short paragraphs (each
        its own segment) have their segments' budgets scaled down to it (`plan`)."""
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

    A request's frames are bounded by its text, whatever its options: at most the larger of
    `max_new_tokens - 1` (one generation) and `long_text.text_budget` of the whole text. Guarded
    segments whose budgets add up to more have them scaled down to it; unguarded ones (ignore_eos,
    or the guard off), each allowed max_new_tokens - 1 frames, are refused (a RequestError naming
    max_new_tokens) when that many segments could make more."""
    texts = [text]
    if long_text.segment and len(text_ids) - TEMPLATE_IDS > long_text.segment_tokens:
        count = lambda piece: len(tokenizer.text_ids(piece))  # noqa: E731
        texts = [piece.strip() for piece in split_text(text, long_text.segment_tokens, count)]
    ids = [tuple(text_ids) if len(texts) == 1 else tuple(tokenizer.assistant_ids(piece)) for piece in texts]
    most = max(max_new_tokens - 1, long_text.text_budget(len(text_ids) - TEMPLATE_IDS))
    budgets = _budgets([len(i) - TEMPLATE_IDS for i in ids], long_text, max_new_tokens, guarded, most)
    seeds = [(seed + k * SEED_STEP) % MAX_SEED for k in range(len(texts))]
    return tuple(Part(*part) for part in zip(texts, ids, seeds, budgets, strict=True))


def _budgets(
    tokens: list[int], long_text: LongTextOptions, max_new_tokens: int, guarded: bool, most: int
) -> list[int | None]:
    """Each segment's frame budget (None: max_new_tokens - 1 bounds it), their frames `most` in all."""
    frames = max_new_tokens - 1
    if not guarded:
        if len(tokens) * frames > most:
            raise RequestError(
                "max_new_tokens",
                f"without the runaway guard (ignore_eos, or the guard off) each of this text's {len(tokens)} "
                f"segments makes up to max_new_tokens - 1 = {frames} frames, {len(tokens) * frames} in all; "
                f"a text of {sum(tokens)} tokens may make at most {most}: ask for max_new_tokens <= "
                f"{most // len(tokens) + 1}, or keep the guard",
            )
        return [None] * len(tokens)
    own = [min(long_text.frame_budget(n), frames) for n in tokens]
    if sum(own) > most:  # many short paragraphs: their budgets shrink in proportion
        own = [max(1, b * most // sum(own)) for b in own]
    return [None if b >= frames else b for b in own]


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


def split_text(text: str, budget: int, count: Callable[[str], int]) -> list[str]:
    """`text` cut into pieces whose `count(piece.strip())` is at most `budget` (tokens), at the
    coarsest boundaries that allow it (module docstring); `"".join(pieces) == text`. A text
    within the budget is one piece."""
    if count(text.strip()) <= budget:
        return [text]
    pieces: list[str] = []
    for paragraph in _cut(text, _PARAGRAPH_END):
        pieces += _pack(_sentences(paragraph), budget, count, _FINER)
    return _whitespace_joined(pieces)


def _sentences(text: str) -> list[str]:
    """Sentence pieces of `text`, with the full stops that do not end a sentence joined back."""
    pieces = _cut(text, _SENTENCE_END)
    joined: list[str] = []
    for piece in pieces:
        if joined and not _ends_sentence(joined[-1], piece):
            joined[-1] += piece
        else:
            joined.append(piece)
    return joined


def _ends_sentence(before: str, after: str) -> bool:
    """Whether the boundary between `before` and `after` (found by _SENTENCE_END) ends a sentence."""
    if "\n" in before[len(before.rstrip()) :]:
        return True  # a line break
    head = before.rstrip().rstrip(_CLOSERS)
    if head[-1:] in _CJK_TERMINATORS:  # 「行こう！」と言った: a quotation the sentence goes on after
        quoted = len(head) < len(before) and before == before.rstrip()
        return not (quoted and after[:1].isalpha())
    first = after.lstrip().lstrip(_CLOSERS + "¿¡\"'«“‘(")[:1]
    if first and (first.islower() or first.isdigit()):
        return False  # "Wait... what?", "etc. and", "z. B. das"
    if head.endswith(".") and not head.endswith(".."):
        word = head[:-1].rsplit(None, 1)[-1] if head[:-1].split() else ""
        word = word.lstrip(_CLOSERS + "¿¡\"'«“‘(")
        if len(word) == 1 and word.isalpha():
            return False  # an initial: "J. K. Rowling", "M. Dupont"
        if word.lower() in ABBREVIATIONS or _dotted_abbreviation(before, word):
            return False
    return True


def _dotted_abbreviation(before: str, word: str) -> bool:
    """ "z. B." / "d. h." / "т. е.": the last two one-letter words, each with its stop, form a known one."""
    words = before.rstrip().split()
    if len(words) < 2 or len(word) != 1:
        return False
    return f"{words[-2].rstrip('.')}.{word}".lower() in ABBREVIATIONS


def _cut(text: str, boundary: re.Pattern[str]) -> list[str]:
    """`text` cut after every match of `boundary` (a match keeps its whitespace); whitespace alone
    never makes a piece (leading whitespace goes with the first one)."""
    pieces, start = [], 0
    for match in boundary.finditer(text):
        if text[start : match.end()].strip():
            pieces.append(text[start : match.end()])
            start = match.end()
    if start < len(text):
        pieces.append(text[start:])
    return pieces


def _words(text: str) -> list[str]:
    return _cut(text, _WORD_END)


def _characters(text: str) -> list[str]:
    """Single characters, each whitespace character joined to the one before it."""
    return _cut(text, re.compile(r"\S\s*"))


def _clauses(text: str) -> list[str]:
    return _cut(text, _CLAUSE_END)


_FINER: tuple[Callable[[str], list[str]], ...] = (_clauses, _words, _characters)


def _pack(pieces: list[str], budget: int, count: Callable[[str], int], finer) -> list[str]:
    """Consecutive pieces joined while they fit `budget`; a piece that alone does not fit is cut with
    the next finer splitter (`finer`), and its parts packed the same way."""
    out: list[str] = []
    current = ""
    for piece in pieces:
        if current and count((current + piece).strip()) <= budget:
            current += piece
            continue
        if current:
            out.append(current)
            current = ""
        if count(piece.strip()) <= budget or not finer:
            current = piece
            continue
        parts = _pack(finer[0](piece), budget, count, finer[1:])
        out += parts[:-1]
        current = parts[-1]
    if current:
        out.append(current)
    return out


def _whitespace_joined(pieces: list[str]) -> list[str]:
    """Pieces with any piece of only whitespace joined to the next one (or the last)."""
    out: list[str] = []
    carry = ""
    for piece in pieces:
        if not piece.strip():
            carry += piece
            continue
        out.append(carry + piece)
        carry = ""
    if carry:
        if out:
            out[-1] += carry
        else:
            out.append(carry)
    return out
