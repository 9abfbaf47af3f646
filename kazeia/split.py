"""How a text is cut into pieces of at most a token budget each (kazeia/segment.py speaks them).

`split_text` cuts a whole text: whole paragraphs (a blank line always ends a piece) packed from
whole sentences, a sentence too long split at clauses (commas, semicolons, colons, dashes), a clause
too long at spaces between words, and a word too long (a run of Chinese or Japanese without
punctuation) between characters. The pieces concatenate back to the text: each keeps the whitespace
that follows it. `settled` and `resettled` give, for a text still arriving, the pieces no
continuation can change (kazeia/live.py).

Sentence ends: `.`, `!`, `?`, `…` and runs of them (an ellipsis), with closing quotes or brackets,
followed by whitespace; `。！？` (and their fullwidth relatives) with or without whitespace; and line
breaks. A full stop is not an end after a known abbreviation ("Dr.", "z. B.", "M.", "т. е."), after a
single letter (initials), inside a number ("3.14" has no space), or when the next word starts with
a lowercase letter or a digit ("Wait... what?" is one sentence; "etc. and" too).

Non-goals: tokenization (text.py: the pieces are only counted, through the function given), what a
piece speaks with (segment.py).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable

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
_OPENERS = "¿¡\"'«“‘("
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


def split_text(text: str, budget: int, count: Callable[[str], int]) -> list[str]:
    """`text` cut into pieces whose `count(piece.strip())` is at most `budget` (tokens), at the
    coarsest boundaries that allow it (module docstring); `"".join(pieces) == text`. A text
    within the budget is one piece."""
    if count(text.strip()) <= budget:
        return [text]
    return _split(text, budget, count)


def settled(
    text: str,
    ended: bool,
    budget: int,
    count: Callable[[str], int],
    at_least: Callable[[str], int],
    split: bool = False,
) -> tuple[list[str], str, bool]:
    """What of `split_text` of a text still arriving no continuation can change (all of it once
    `ended`): (the first pieces, final; the start of the next piece that is certain; whether the text
    may still be one piece). `at_least(x)`: the fewest tokens any continuation of x counts. `split`:
    the text is what follows final pieces of a longer one (split already: never one piece).

    A sentence is complete once the next one's first letter is there (what follows cannot undo the
    boundary then). A piece closes once the sentence after it is known not to fit, or at a paragraph
    break; until then its complete sentences are certain. A piece with none yet is certain of its
    first sentence's complete clauses, or of the words of its first clause while they fit."""
    if ended:
        pieces = _split(text, budget, count) if split else split_text(text, budget, count)
        return pieces, "", len(pieces) == 1 and not split
    done = _complete(text)
    rest = text[done:]
    opened = _cut(rest, _SENTENCE_END)[0] if rest.strip() else ""  # the sentence begun after them
    if not split and at_least(text.strip()) <= budget:  # one piece, or split: then its first paragraph's start
        first = _cut(text[:done], _PARAGRAPH_END)[:1]  # its complete sentences: certain if they fit as counted
        if not first:
            return [], _first_unit(opened, budget, count), True
        return [], first[0] if count(first[0].strip()) <= budget else "", True
    pieces = _split(text[:done], budget, count) if text[:done].strip() else []
    if pieces and not _paragraph_ends_at(text, done):
        if not opened or at_least((pieces[-1] + opened).strip()) <= budget:  # it may join the last piece
            return pieces[:-1], pieces[-1], False
    return pieces, _first_unit(opened, budget, count), False


def _first_unit(sentence: str, budget: int, count: Callable[[str], int]) -> str:
    """What of a piece's first sentence, still arriving, is certainly in the piece: its complete
    clauses while they fit (an oversized sentence is packed from its clauses), else the words of
    its one clause while they fit (an oversized clause is packed from its words). The clause's
    words are counted as they are: a lower bound (`at_least`) would let a word that does not fit
    alone, and is split between its characters later, pass as certain."""
    clauses = _cut(sentence, _CLAUSE_END)
    if len(clauses) > 1:
        complete = "".join(clauses[:-1])
        return complete if count(complete.strip()) <= budget else ""
    return sentence if count(sentence.strip()) <= budget else ""


def resettled(
    text: str, final: list[str], ended: bool, budget: int, count: Callable[[str], int], at_least: Callable[[str], int]
) -> tuple[list[str], str, bool]:
    """`settled` for a text that grew since `final` (its first pieces) was settled: the same result,
    settling again only from the paragraph where those end (pieces never span a paragraph break,
    and a paragraph is cut the same alone), so a long text is not settled from its start each time."""
    ends = list(itertools.accumulate(len(piece) for piece in final))
    breaks = {m.end() for m in _PARAGRAPH_END.finditer(text[: ends[-1]])} if final else set()
    before = max((k + 1 for k, end in enumerate(ends) if end in breaks), default=0)  # pieces before it
    anchor = ends[before - 1] if before else 0
    pieces, certain, single = settled(text[anchor:], ended, budget, count, at_least, split=bool(final))
    return final[:before] + pieces, certain, single and not final


def _split(text: str, budget: int, count: Callable[[str], int]) -> list[str]:
    """`split_text`'s pieces of a text over the budget: paragraphs packed from sentences."""
    pieces: list[str] = []
    for paragraph in _cut(text, _PARAGRAPH_END):
        pieces += _pack(_sentences(paragraph), budget, count, _FINER)
    return _whitespace_joined(pieces)


def _complete(text: str) -> int:
    """Where the complete sentences of a text still arriving end: after the last sentence or
    paragraph boundary whose next sentence has begun (its first letter is there, so what follows
    cannot undo the boundary); 0 where there is none."""
    end, offset = 0, 0
    for paragraph in _cut(text, _PARAGRAPH_END):
        for sentence in _sentences(paragraph):
            if offset and _begun(text[offset:]):
                end = offset
            offset += len(sentence)
    return end


def _begun(after: str) -> bool:
    """Whether the text after a boundary holds the letter that decides it (`_ends_sentence`)."""
    return bool(after.lstrip().lstrip(_CLOSERS + _OPENERS)[:1])


def _paragraph_ends_at(text: str, position: int) -> bool:
    """Whether a paragraph break ends just before `position`."""
    return any(match.end() == position for match in _PARAGRAPH_END.finditer(text[:position]))


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
    first = after.lstrip().lstrip(_CLOSERS + _OPENERS)[:1]
    if first and (first.islower() or first.isdigit()):
        return False  # "Wait... what?", "etc. and", "z. B. das"
    if head.endswith(".") and not head.endswith(".."):
        word = head[:-1].rsplit(None, 1)[-1] if head[:-1].split() else ""
        word = word.lstrip(_CLOSERS + _OPENERS)
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
