"""Live text input: text delivered in pieces, at any timing, speaks exactly like the whole text."""

import asyncio
import random
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kazeia.live import TextFeed, TextTimeout

TEXTS = [
    "Hello there, this is live text. Speaking while it arrives!",
    "L'été dernier, j'ai vu 12 bateaux — déjà?\nOui.",
    "今天天气很好，我们去公园吧。然后回家。",
    "iPhone  and eBay:   spaces, tabs\tand 3.14 digits...",
]
OPTIONS = dict(voice="serena", seed=3, max_new_tokens=40)


def _run(engine, source, **extra):
    stream = engine.stream(source, **OPTIONS, **extra)
    chunks = list(stream)
    return stream, np.concatenate([c.audio for c in chunks])


@pytest.fixture(scope="module")
def whole(engines):
    """Whole-text streams in the streaming text layout: the expected codes and audio."""
    return {text: _run(engines["0.6B-custom"], text, non_streaming_mode=False) for text in TEXTS}


def _deltas(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted(c % (len(text) + 1) for c in cuts), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    which=st.integers(0, len(TEXTS) - 1),
    cuts=st.lists(st.integers(0, 400), max_size=25),
    delays=st.lists(st.floats(0, 0.02), min_size=1, max_size=5),
)
def test_deltas_at_any_timing_equal_the_whole_text(engines, whole, which, cuts, delays):
    text = TEXTS[which]
    parts = _deltas(text, cuts)

    def source():
        for i, part in enumerate(parts):
            time.sleep(delays[i % len(delays)])
            yield part

    stream, audio = _run(engines["0.6B-custom"], source())
    expected, expected_audio = whole[text]
    np.testing.assert_array_equal(stream.codes, expected.codes)
    assert audio.tobytes() == expected_audio.tobytes()


def test_single_characters_and_an_async_source(engines, whole):
    text = TEXTS[1]

    async def source():
        for ch in text:
            await asyncio.sleep(0)
            yield ch

    stream, audio = _run(engines["0.6B-custom"], source())
    assert audio.tobytes() == whole[text][1].tobytes()
    assert stream.metrics.first_text_to_audio_s is not None and stream.metrics.text_wait_frames >= 0


def test_speech_starts_after_the_first_complete_word(engines):
    """The first audio comes while the rest of the text has not even been sent."""
    feed = TextFeed()
    stream = engines["0.6B-custom"].stream(feed, **OPTIONS)
    feed.append("Hello ")  # "Hello" is complete once the space arrives
    first = next(stream)
    assert first.frames == 1
    feed.append("world, and the rest of the reply.")
    feed.end()
    rest = list(stream)
    assert rest[-1].is_last
    assert stream.metrics.text_wait_frames >= 1  # it waited for the second word


def test_text_fed_from_another_thread(engines, whole):
    text, feed = TEXTS[0], TextFeed()

    def producer():
        for word in text.split(" "):
            time.sleep(0.005)
            feed.append(word if word == text.split(" ")[0] else " " + word)
        feed.end()

    threading.Thread(target=producer).start()
    stream, audio = _run(engines["0.6B-custom"], feed)
    np.testing.assert_array_equal(stream.codes, whole[text][0].codes)


def test_non_streaming_layout_waits_for_the_whole_text(engines):
    text = TEXTS[0]
    expected = engines["0.6B-custom"].synthesize(text, **OPTIONS)  # CustomVoice default: non-streaming
    stream, _ = _run(
        engines["0.6B-custom"], iter(text.split(",")[:1] + ["," + text.split(",", 1)[1]]), non_streaming_mode=True
    )
    np.testing.assert_array_equal(stream.codes, expected.codes)


def test_idle_source_times_out(engines):
    feed = TextFeed()
    stream = engines["0.6B-custom"].stream(feed, text_timeout=0.3, **OPTIONS)
    feed.append("Hello ")
    with pytest.raises(TextTimeout, match="no new text arrived for 0.3 s"):
        list(stream)


def _fails_while_fed(stream, feed: TextFeed, delta, period: float, match: str) -> None:
    """Append `delta()` every `period` s from a thread while `stream` runs: it must fail with a
    TextTimeout matching `match`, within 5 s."""
    stop = threading.Event()

    def feeding():
        while not stop.is_set():
            feed.append(delta())
            time.sleep(period)

    threading.Thread(target=feeding, daemon=True).start()
    start = time.monotonic()
    try:
        with pytest.raises(TextTimeout, match=match):
            list(stream)
    finally:
        stop.set()
    assert time.monotonic() - start < 5.0


def test_blank_deltas_do_not_keep_a_live_text_alive(engines):
    """Empty or whitespace-only deltas every 0.1 s do not reset a 0.5 s text_timeout (they do
    not advance the utterance): it fails after ~0.5 s, not never."""
    feed = TextFeed()
    stream = engines["0.6B-custom"].stream(feed, text_timeout=0.5, **OPTIONS)
    feed.append("Hello ")
    blank = lambda: " " if random.random() < 0.5 else ""  # noqa: E731
    _fails_while_fed(stream, feed, blank, 0.1, "no new text arrived for 0.5 s")


def test_a_live_text_that_never_ends_meets_its_deadline(engines):
    """A source that keeps adding words but never ends fails at `text_deadline`."""
    feed = TextFeed()
    stream = engines["0.6B-custom"].stream(feed, text_deadline=0.8, non_streaming_mode=True, **OPTIONS)
    _fails_while_fed(stream, feed, lambda: "word ", 0.05, "did not end within 0.8 s")


def test_closing_while_waiting_for_text_stops_everything(engines):
    feed = TextFeed()
    stream = engines["0.6B-custom"].stream(feed, **OPTIONS)
    feed.append("One two ")
    next(stream)
    start = time.monotonic()
    stream.close()
    assert time.monotonic() - start < 1.0
    assert not any(t.name == "kazeia-generate" for t in threading.enumerate())


def test_empty_and_bad_sources(engines):
    engine = engines["0.6B-custom"]
    with pytest.raises(ValueError, match="text is empty"):
        list(engine.stream(iter(["", "   "]), **OPTIONS))
    with pytest.raises(ValueError, match="text deltas must be strings"):
        list(engine.stream(iter(["Hello ", 42]), **OPTIONS))
    with pytest.raises(ValueError, match="not int"):
        engine.stream(42, **OPTIONS)
    with pytest.raises(ValueError, match="text_timeout must be"):
        engine.stream(iter(["Hi"]), text_timeout=0, **OPTIONS)
    feed = TextFeed()
    feed.end()
    with pytest.raises(ValueError, match="has ended"):
        feed.append("late")


def test_a_control_token_split_between_deltas_is_plain_text_as_in_the_whole_text(engines):
    """ "Hello <|im_" then "end|> there": the characters of its name, as the whole text speaks them,
    never the control token (nor an error when the second delta completes its name)."""
    engine = engines["0.6B-custom"]
    text = "Hello <|im_end|> there"
    expected_stream, expected = _run(engine, text, non_streaming_mode=False)
    stream, audio = _run(engine, iter(["Hello <|im_", "end|> there"]))
    np.testing.assert_array_equal(stream.codes, expected_stream.codes)
    np.testing.assert_array_equal(audio, expected)
    assert 151645 not in engine.tokenizer.text_ids(text)  # <|im_end|>'s id: not in the text


def test_empty_deltas_are_not_kept():
    """An empty delta adds nothing: a feed never grows by one (a client sending only those would
    otherwise fill a queued utterance's feed without bound)."""
    feed = TextFeed()
    for _ in range(10_000):
        feed.append("")
    feed.append("Hi")
    assert feed.get(timeout=1) == "Hi" and feed._queue.empty()
