"""Live text input: speak while the text is still arriving (e.g. an LLM's token stream).

A live text is spoken exactly as the whole text would be: cut into the same segments
(kazeia/segment.py), each with the same tokens, seed and frame budget, so the codes and audio equal
those of the same text given at once, whatever the deltas and their timing. `LiveParts` settles
each segment as soon as no continuation can change it (`split.resettled`: a sentence is complete
once the next one's first letter is there; a segment closes once the sentence after it cannot fit).
Within a segment, the streaming text layout feeds the talker one token per generated frame, so
speech can start with the first tokens certain to be the segment's: those of every pre-token (the
tokenizer's regex pieces: words, number digits, punctuation runs, whitespace) but the last, which
may still grow ("Hel" + "lo"), merge with what follows (".\n"), or split differently. Where a
decision needs text that has not arrived, generation waits for it (within the text's timeouts).
A text is plain text (kazeia/text.py): "<|im_" then "end|>" is those characters, as in the whole
text, never a control token whose name was split between deltas.

`TextFeed` is a thread-safe source to push deltas into (servers, callbacks); any iterable or async
iterable of strings works as well; `LiveText` reads one within its timeouts.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import AsyncIterable, Callable, Iterable

import torch

from .errors import RequestError, check_text
from .segment import Allowance, LongTextOptions, part_seed
from .split import resettled
from .text import TextTokenizer

_END = object()


class TextFeed:
    """A text source filled from another thread: `append(delta)` any number of times, then `end()`.
    Each delta keeps the moment it arrived: a text's timeouts count the client's pauses, not how
    late a busy reader takes what is queued."""

    def __init__(self) -> None:
        self._queue: queue.Queue = queue.Queue()
        self._ended = False

    def append(self, delta: str) -> None:
        """Queue `delta` (an empty one adds nothing and is not kept)."""
        if not isinstance(delta, str):
            raise RequestError("text", f"text deltas must be strings, got {type(delta).__name__}")
        check_text("text", delta)
        if self._ended:
            raise ValueError("the text feed has ended; no more text can be appended")
        if delta:
            self._put(delta)

    def end(self) -> None:
        if not self._ended:
            self._ended = True
            self._put(_END)

    def _put(self, item: str | object) -> None:
        self._queue.put((time.monotonic(), item))

    def get(self, timeout: float) -> tuple[float, str | object]:
        """The next delta (or `_END`, or a source's error) and the monotonic time it arrived; raise
        queue.Empty after `timeout` seconds."""
        return self._queue.get(timeout=timeout)


def as_feed(source: Iterable[str] | AsyncIterable[str] | TextFeed) -> TextFeed:
    """Wrap any text source as a TextFeed; iterables are drained by a daemon thread as they yield."""
    if isinstance(source, TextFeed):
        return source
    feed = TextFeed()
    if isinstance(source, AsyncIterable):

        async def drain_async() -> None:
            async for delta in source:
                feed.append(delta)

        target: Callable[[], None] = lambda: asyncio.run(drain_async())  # noqa: E731
    elif isinstance(source, Iterable):

        def target() -> None:
            for delta in source:
                feed.append(delta)
    else:
        kind = type(source).__name__
        raise ValueError(f"text must be a string, an iterable or an async iterable of strings, not {kind}")

    def run() -> None:
        try:
            target()
        except BaseException as error:  # reported through the feed
            feed._put(error)
        feed.end()

    threading.Thread(target=run, name="kazeia-text-source", daemon=True).start()
    return feed


class TextTimeout(ValueError):
    """The text source sent nothing for longer than the allowed idle time."""


class LiveText:
    """A text that is still arriving, read from its feed as a reader needs more (`_pull`), within
    its timeouts; what it decides is read off it by `LiveParts`."""

    def __init__(
        self,
        tokenizer: TextTokenizer,
        feed: TextFeed,
        idle_timeout: float | None,
        should_stop: Callable[[], bool] | None = None,
        deadline: float | None = None,
    ):
        """idle_timeout: seconds the text may go without advancing (a delta with something other
        than whitespace; empty and blank deltas do not count) before it fails with TextTimeout.
        deadline: seconds, from the first wait for text, within which the text must have ended."""
        self.tokenizer, self.feed = tokenizer, feed
        self.idle_timeout, self.should_stop, self.deadline = idle_timeout, should_stop, deadline
        self._active_at: float | None = None  # monotonic time of the last advancing delta (or the first wait)
        self._ends_at: float | None = None  # monotonic time by which the text must end
        self.text = ""  # all of it so far
        self.ended = False
        self.first_text_at: float | None = None  # perf_counter() of the first non-empty delta
        self.waits = 0  # times a caller had to wait for text
        # Text tokens the whole text may have (None: no bound but the positions'); over it the text
        # fails with a RequestError as soon as it is known to be (a server's max_input_tokens).
        self.max_tokens: int | None = None

    def _pull(self) -> bool:
        """Take one delta (blocking, polling `should_stop`); False if asked to stop."""
        now = time.monotonic()
        if self._active_at is None:
            self._active_at = now
            self._ends_at = None if self.deadline is None else now + self.deadline
        while True:
            if self.should_stop is not None and self.should_stop():
                return False
            try:
                arrived, item = self.feed.get(timeout=0.05)
                break
            except queue.Empty:
                self._check_time(time.monotonic())
        self._check_time(arrived)  # the text had paused, or run out of time, before this came
        if isinstance(item, BaseException):
            raise item
        if item is _END:
            self.ended = True
        elif isinstance(item, str) and item:
            if self.first_text_at is None:
                self.first_text_at = time.perf_counter()
            if item.strip():  # only text that advances the utterance counts as activity
                self._active_at = max(self._active_at, arrived)
            self.text += item
        if self.max_tokens is not None:
            self._check_tokens(self.max_tokens)
        return True

    def _check_tokens(self, limit: int) -> None:
        """Refuse the text once it is known to have more than `limit` tokens: those of every
        pre-token but the last (they stay whatever follows), or all of them once it has ended."""
        tokenizer = self.tokenizer
        count = len(tokenizer.text_ids(self.text) if self.ended else stable_ids(tokenizer, self.text))
        if count > limit:
            raise RequestError("text", f"text is {count} tokens long; at most {limit} are accepted")

    def _check_time(self, now: float) -> None:
        """Fail if at monotonic time `now` the text is past its deadline or has not advanced for
        longer than its idle timeout."""
        if self._ends_at is not None and now > self._ends_at:
            raise TextTimeout(f"the text did not end within {self.deadline:g} s (text_deadline)")
        if self.idle_timeout is not None and self._active_at is not None and now > self._active_at + self.idle_timeout:
            raise TextTimeout(f"no new text arrived for {self.idle_timeout:g} s (text_timeout)")


class LiveParts:
    """The segments of a text still arriving: exactly those `segment.plan` gives the whole text
    (where it cuts, each one's tokens, seed and frame budget), each known as soon as no continuation
    can change it (`split.settled`). Part k begins once its first token is certain; its tokens
    come as they become certain; where a decision needs text that has not arrived, the caller waits
    for it (within the text's timeouts). Read in one thread, the one that pulls the text."""

    def __init__(self, live: LiveText, long_text: LongTextOptions, seed: int, max_new_tokens: int, guarded: bool):
        self.live, self.long_text, self.seed = live, long_text, seed
        self.max_new_tokens, self.guarded = max_new_tokens, guarded
        self.tokenizer = live.tokenizer
        self.pieces: list[str] = []  # the final pieces (raw, as split_text gives them)
        self.single = True  # the text is, or may still be, one piece
        self.open: list[int] = []  # the certain text ids of the piece after `pieces`
        self._seen: tuple[int, bool] = (-1, False)  # the text's length and end when last looked at
        self.allowance = Allowance(long_text, max_new_tokens, guarded)
        self.budgets: list[int | None] = []  # the final parts' budgets, taken in order

    def part(self, index: int) -> LivePart | None:
        """Part `index` once it has begun; None once the text has ended with fewer parts, or when
        stopped while waiting. An empty text is a RequestError, as for a string."""
        while True:
            self._refresh()
            if index < len(self.pieces) or (index == len(self.pieces) and self.open and self.live.text.strip()):
                return LivePart(self, index)
            if self.live.ended:
                if not self.live.text.strip():
                    raise RequestError("text", "text is empty")
                return None
            if not self.live._pull():
                return None

    def final(self, index: int) -> bool:
        return index < len(self.pieces)

    def text(self, index: int) -> str:
        """A final part's text, as `segment.plan` gives it (the whole text where it is one piece)."""
        return self.live.text if self.single and self.live.ended else self.pieces[index].strip()

    def ids(self, index: int) -> list[int]:
        """Part `index`'s text ids known so far: all of them once it is final."""
        if self.final(index):
            return self.tokenizer.text_ids(self.text(index))
        return self.open if index == len(self.pieces) else []

    def wait(self, index: int, count: int) -> bool:
        """Block until part `index` has `count` ids known or is final; False if stopped."""
        waited = False
        while not self.final(index) and len(self.ids(index)) < count and not self.live.ended:
            waited = True
            if not self.live._pull():
                return False
            self._refresh()
        self.live.waits += waited
        return True

    def _refresh(self) -> None:
        """Settle what the text so far decides: final pieces from where the last one ends (their
        text never changes), the certain ids of the next."""
        text, ended = self.live.text, self.live.ended
        if (len(text), ended) == self._seen:
            return
        self._seen = len(text), ended
        if not self.long_text.segment:  # one piece, whatever its length
            pieces, certain, single = ([text] if ended else []), text, True
        else:
            count = lambda piece: len(self.tokenizer.text_ids(piece))  # noqa: E731
            budget, at_least = self.long_text.segment_tokens, self.tokenizer.at_least
            pieces, certain, single = resettled(text, self.pieces, ended, budget, count, at_least)
        if len(pieces) > len(self.pieces):
            self.open = []
        self.pieces, self.single = pieces, single
        while len(self.budgets) < len(pieces):  # final parts take their frames in order (segment.plan's)
            self.budgets.append(self.allowance.take(len(self.ids(len(self.budgets)))))
        if ended or (single and self.long_text.segment and text[:1].isspace()):
            return  # ended: every part final; one piece keeps leading whitespace, a split one not
        ids = stable_ids(self.tokenizer, certain if single else certain.lstrip())
        if len(ids) > len(self.open):  # what was certain stays so
            self.open = ids


def stable_ids(tokenizer: TextTokenizer, text: str) -> list[int]:
    """The ids of every pre-token of `text` but the last (which may still grow or merge): those
    that stay whatever follows."""
    encoding = tokenizer.encoding(text)
    if not encoding.ids:
        return []
    last = encoding.word_ids[-1]
    return [i for i, w in zip(encoding.ids, encoding.word_ids, strict=True) if w != last]


class LivePart:
    """One segment of a text still arriving (`LiveParts.part`)."""

    def __init__(self, parts: LiveParts, index: int):
        self.parts, self.index = parts, index
        self.seed = part_seed(parts.seed, index)

    def wait_final(self) -> bool:
        """Block until the part's text is known whole; False if stopped."""
        parts = self.parts
        while not parts.final(self.index) and not parts.live.ended:
            if not parts.live._pull():
                return False
            parts._refresh()
        return True

    @property
    def text(self) -> str:
        """The part's text: whole once it is final, else what has arrived of it."""
        return self.parts.text(self.index) if self.parts.final(self.index) else ""

    @property
    def text_ids(self) -> tuple[int, ...]:
        """Its assistant template's ids (once final)."""
        return tuple(self.parts.tokenizer.wrap_assistant(self.parts.ids(self.index)))

    def budget_at(self, frames: int) -> int | None:
        """The runaway guard's frame budget, as `segment.plan` gives it, asked with the frames made:
        known at once while those stay below what the part's known tokens allow (`Allowance.least`),
        else once it is final (waited for; a stop ends the wait with no budget)."""
        parts = self.parts
        if not parts.final(self.index):
            known = parts.allowance.least(len(parts.ids(self.index)))
            if frames < known:
                return known
            if not self.wait_final():
                return None
        return parts.budgets[self.index]

    def trailing(self, embed: Callable[[int], torch.Tensor], eos: torch.Tensor, pad: torch.Tensor):
        """The trailing text track of the streaming layout as a function of the decode step: step s
        adds token s+1, then tts_eos once the part is final, then tts_pad; None = stop."""
        parts, index = self.parts, self.index

        def text_at(step: int) -> torch.Tensor | None:
            if not parts.wait(index, step + 2):
                return None
            ids = parts.ids(index)
            if step + 1 < len(ids):
                return embed(ids[step + 1])
            return eos if step + 1 == len(ids) else pad

        return text_at


__all__ = ["TextFeed", "LiveText", "LiveParts", "LivePart", "TextTimeout", "as_feed"]
