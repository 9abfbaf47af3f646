"""Live text input: speak while the text is still arriving (e.g. an LLM's token stream).

The streaming text layout feeds the talker one text token per generated frame, so speech can start
as soon as the first token is known. Text arrives as deltas of any size; `LiveText` tokenizes the
text received so far and releases only *stable* tokens, those of every pre-token (the tokenizer's
regex pieces: words, number digits, punctuation runs, whitespace) except the last, which may still
grow ("Hel" + "lo"), merge with what follows (".\n"), or split differently. The tokens fed are
therefore exactly those of tokenizing the whole text, whatever the deltas and their timing, so the
codes and audio equal those of the same text given at once. A text is plain text (kazeia/text.py):
"<|im_" then "end|>" is those characters, as in the whole text, never a control token whose name
was split between deltas. Text without spaces (Chinese, Japanese) is one pre-token up to its next
punctuation mark and starts speaking from there.

`TextFeed` is a thread-safe source to push deltas into (servers, callbacks); any iterable or async
iterable of strings works as well.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import AsyncIterable, Callable, Iterable

import torch

from .errors import RequestError, check_text
from .text import TextTokenizer

_END = object()


class TextFeed:
    """A text source filled from another thread: `append(delta)` any number of times, then `end()`."""

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
            self._queue.put(delta)

    def end(self) -> None:
        if not self._ended:
            self._ended = True
            self._queue.put(_END)

    def get(self, timeout: float) -> str | object:
        """The next delta, `_END`, or raise queue.Empty after `timeout` seconds."""
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
            feed._queue.put(error)
        feed.end()

    threading.Thread(target=run, name="kazeia-text-source", daemon=True).start()
    return feed


class TextTimeout(ValueError):
    """The text source sent nothing for longer than the allowed idle time."""


class LiveText:
    """Token ids of a text that is still arriving, released as they become stable."""

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
        self.text = ""
        self.ids: list[int] = []  # stable ids so far (all of them once the source has ended)
        self.ended = False
        self.first_text_at: float | None = None  # perf_counter() of the first non-empty delta
        self.waits = 0  # times a caller had to wait for text
        # Text tokens the whole text may have (None: no bound but the positions'); over it the text
        # fails with a RequestError as soon as it is known to be (a server's max_input_tokens).
        self.max_tokens: int | None = None

    def need(self, count: int) -> bool:
        """Block until `count` ids are known or the text has ended; False if asked to stop."""
        waited = False
        while len(self.ids) < count and not self.ended:
            waited = True
            if not self._pull():
                return False
        self.waits += waited
        return True

    def wait_for_end(self) -> bool:
        """Block until the whole text has arrived; False if asked to stop."""
        while not self.ended:
            if not self._pull():
                return False
        return True

    def start(self) -> bool:
        """Block until the first stable token of a text that is not only whitespace (or the end);
        False if asked to stop. An empty or whitespace-only text is a ValueError, as for strings."""
        while not self.ended and not (self.ids and self.text.strip()):
            if not self._pull():
                return False
        if not self.text.strip():
            raise RequestError("text", "text is empty")
        return True

    def _pull(self) -> bool:
        """Take one delta (blocking, polling `should_stop`); False if asked to stop."""
        now = time.monotonic()
        if self._active_at is None:
            self._active_at = now
            self._ends_at = None if self.deadline is None else now + self.deadline
        while True:
            if self.should_stop is not None and self.should_stop():
                return False
            self._check_time()
            try:
                item = self.feed.get(timeout=0.05)
                break
            except queue.Empty:
                continue
        if isinstance(item, BaseException):
            raise item
        if item is _END:
            self.ended = True
            self._update(final=True)
        elif isinstance(item, str) and item:
            if self.first_text_at is None:
                self.first_text_at = time.perf_counter()
            if item.strip():  # only text that advances the utterance counts as activity
                self._active_at = time.monotonic()
            self.text += item
            self._update(final=False)
        return True

    def _check_time(self) -> None:
        now = time.monotonic()
        if self._ends_at is not None and now > self._ends_at:
            raise TextTimeout(f"the text did not end within {self.deadline:g} s (text_deadline)")
        if self.idle_timeout is not None and self._active_at is not None and now > self._active_at + self.idle_timeout:
            raise TextTimeout(f"no new text arrived for {self.idle_timeout:g} s (text_timeout)")

    def _update(self, final: bool) -> None:
        encoding = self.tokenizer.encoding(self.text)
        ids = encoding.ids
        if not final and ids:
            last_word = encoding.word_ids[-1]
            ids = [i for i, w in zip(ids, encoding.word_ids, strict=True) if w != last_word]
        if self.max_tokens is not None and len(ids) > self.max_tokens:  # (stable ones: they stay)
            raise RequestError("text", f"text is {len(ids)} tokens long; at most {self.max_tokens} are accepted")
        if ids[: len(self.ids)] != self.ids:  # would mean a tokenizer whose pieces are not independent
            raise RuntimeError("live text tokenization changed already spoken tokens")
        self.ids = ids


def live_trailing(live: LiveText, embed: Callable[[int], torch.Tensor], eos: torch.Tensor, pad: torch.Tensor):
    """The trailing text track of the streaming layout as a function of the decode step:
    step s adds token s+1, then tts_eos once the text has ended, then tts_pad; None = stop."""

    def text_at(step: int) -> torch.Tensor | None:
        if not live.need(step + 2):
            return None
        if step + 1 < len(live.ids):
            return embed(live.ids[step + 1])
        return eos if step + 1 == len(live.ids) else pad

    return text_at


__all__ = ["TextFeed", "LiveText", "TextTimeout", "as_feed", "live_trailing"]
