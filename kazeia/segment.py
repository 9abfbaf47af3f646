"""Long text: split it into segments the talker speaks one after the other as one utterance.

Scope: `LongTextOptions` (how a text is segmented and guarded) and `split_text`, which cuts a text
into pieces of at most a token budget each: whole paragraphs (a blank line always ends a segment)
packed from whole sentences, a sentence too long split at clauses (commas, semicolons, colons,
dashes), a clause too long at spaces between words, and a word too long (a run of Chinese or
Japanese without punctuation) between characters. The pieces concatenate back to the text: each
piece keeps the whitespace that follows it.

Sentence ends: `.`, `!`, `?`, `…` and runs of them (an ellipsis), with closing quotes or brackets,
followed by whitespace; `。！？` (and their fullwidth relatives) with or without whitespace; and line
breaks. A full stop is not an end after a known abbreviation ("Dr.", "z. B.", "M.", "т. е."), after a
single letter (initials), inside a number ("3.14" has no space), or when the next word starts with
a lowercase letter or a digit ("Wait... what?" is one sentence; "etc. and" too).

Non-goals: the model's prompt (prompt.py), tokenization (text.py: `split_text` only counts tokens
through the function it is given), and the frame budgets of the runaway guard (runaway.py).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from .errors import RequestError
from .sampling import Described, _option

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

    segment: bool = _option(True, "split a text longer than segment_tokens (False: one generation)")
    segment_tokens: int = _option(96, "text tokens per segment at most (~25-30 s of English speech)")
    guard: bool = _option(True, "stop a segment at its frame budget or when it loops (off with ignore_eos)")
    floor_frames: int = _option(64, "frame budget of a segment: floor_frames + frames_per_token per text token")
    frames_per_token: int = _option(8, "frames (80 ms each) a segment may take per text token, over the floor")
    loop_frames: int = _option(48, "a segment whose last loop_frames codebook-0 tokens repeat a short pattern stops")
    carry_context: bool = _option(False, "Base checkpoints: each segment continues the previous one's text and frames")

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
