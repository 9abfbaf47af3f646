"""Live text input: text delivered in pieces, at any timing, speaks exactly like the whole text."""

import asyncio
import random
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kazeia import LongTextOptions
from kazeia.errors import RequestError
from kazeia.live import LiveText, TextFeed, TextTimeout

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


LONG = (
    "The first sentence is here. A second one follows it closely! Does a third one ask something? "
    "The fourth, with a clause or two, ends this paragraph.\n\nUn autre paragraphe commence ici. "
    "Dr. Smith paid $3.14 at 5 p.m. yesterday. 今天天气很好。我们去公园吧！"
)
# Segments of a few tokens, each ending by its frame budget or the token cap as well as by EOS.
SEGMENTED = dict(long_text=LongTextOptions(segment_tokens=12, floor_frames=6, frames_per_token=1), max_new_tokens=14)


@pytest.fixture(scope="module")
def long_whole(engines):
    """The long text given whole, in each layout: its codes, audio and segments."""
    engine = engines["0.6B-custom"]
    out = {}
    for layout in (False, True):
        stream = engine.stream(LONG, voice="serena", seed=5, non_streaming_mode=layout, **SEGMENTED)
        out[layout] = stream, np.concatenate([c.audio for c in stream])
    assert len(out[False][0].segments) >= 5  # the text is cut: the property below is about the cuts
    return out


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cuts=st.lists(st.integers(0, len(LONG)), max_size=40), layout=st.booleans())
def test_a_long_live_text_is_cut_and_spoken_as_the_whole_text(engines, long_whole, cuts, layout):
    """Live text in segments: the same cuts, tokens, seeds and frame budgets as the whole text, so
    the same codes, audio and segments, wherever the deltas split it."""
    source = iter(_deltas(LONG, cuts))
    stream = engines["0.6B-custom"].stream(source, voice="serena", seed=5, non_streaming_mode=layout, **SEGMENTED)
    audio = np.concatenate([c.audio for c in stream])
    expected, expected_audio = long_whole[layout]
    np.testing.assert_array_equal(stream.codes, expected.codes)
    assert audio.tobytes() == expected_audio.tobytes()
    assert stream.segments == expected.segments


PARAGRAPHS = "Go on.\n\n" * 10  # ten segments of a few tokens: each a floor, more than the text allows


def test_paragraph_budgets_take_what_is_left_as_the_whole_text_does(engines):
    """Many short paragraphs: the later segments' budgets are what the text leaves (segment.Allowance),
    known as each segment is, so the live text gets the whole text's budgets, codes and audio."""
    engine = engines["0.6B-custom"]
    options = dict(voice="serena", seed=3, non_streaming_mode=False, **SEGMENTED)
    budgets = [part.budget for part in engine.request(PARAGRAPHS, **options).parts]
    own = SEGMENTED["long_text"].frame_budget(engine.request("Go on.", **options).parts[0].text_tokens)
    assert budgets[0] == own and min(budgets) < own, budgets  # the allowance is what is tested here
    expected = engine.stream(PARAGRAPHS, **options)
    expected_audio = np.concatenate([c.audio for c in expected])
    for cuts in ([], [3, 9, 10, 11, 40], list(range(len(PARAGRAPHS)))):
        stream = engine.stream(iter(_deltas(PARAGRAPHS, cuts)), **options)
        audio = np.concatenate([c.audio for c in stream])
        assert [s.end_sample - s.start_sample for s in stream.segments] == [
            s.end_sample - s.start_sample for s in expected.segments
        ]
        assert audio.tobytes() == expected_audio.tobytes()


def test_unguarded_paragraphs_over_what_the_text_allows_are_refused_live_too(engines):
    """ignore_eos over many short paragraphs: the whole text is refused before any work, the live
    one as soon as a segment would go past what its text allows, naming max_new_tokens."""
    engine = engines["0.6B-custom"]
    options = dict(voice="serena", ignore_eos=True, **SEGMENTED)
    with pytest.raises(RequestError, match=r"ask for max_new_tokens <= \d+") as whole:
        engine.request(PARAGRAPHS, **options)
    with pytest.raises(RequestError, match=r"ask for max_new_tokens <= \d+") as live:
        list(engine.stream(iter(_deltas(PARAGRAPHS, [5, 17])), **options))
    assert whole.value.field == live.value.field == "max_new_tokens"


def test_a_live_text_over_its_token_limit_fails_once_it_is_known_to_be(engines):
    """LiveText.max_tokens: the tokens of every pre-token but the last count while the text arrives
    (they stay whatever follows), all of them once it has ended."""
    tokenizer = engines["0.6B-custom"].tokenizer
    text = "one two three four"
    total = len(tokenizer.text_ids(text))
    feed = TextFeed()
    live = LiveText(tokenizer, feed, idle_timeout=None)
    live.max_tokens = total - 1
    feed.append(text)
    assert live._pull()  # "four" may still grow: not over yet
    feed.end()
    with pytest.raises(RequestError, match=f"text is {total} tokens long; at most {total - 1} are accepted"):
        live._pull()
    feed = TextFeed()
    live = LiveText(tokenizer, feed, idle_timeout=None)
    live.max_tokens = 1
    feed.append("one two three ")
    with pytest.raises(RequestError, match="at most 1 are accepted"):  # known before the end
        live._pull()


def test_idle_source_times_out(engines):
    feed = TextFeed()
    stream = engines["0.6B-custom"].stream(feed, text_timeout=0.3, **OPTIONS)
    feed.append("Hello ")
    with pytest.raises(TextTimeout, match="no new text arrived for 0.3 s"):
        list(stream)


def _fails_while_fed(stream, feed: TextFeed, delta, period: float, match: str) -> None:
    """Append `delta()` every `period` s from a thread while `stream` runs: it must fail with a
    TextTimeout matching `match`, within 30 s (a bound on a hang, not a speed)."""
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
    assert time.monotonic() - start < 30.0  # it ended by its timeout, not by the feeding stopping


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


class _Clock:
    """A monotonic clock the test moves by hand (in place of kazeia.live's `time`)."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    perf_counter = monotonic


def _fed_at(clock: _Clock, feed: TextFeed, *deltas: tuple[float, str]) -> None:
    for at, delta in deltas:
        clock.now = at
        feed.append(delta)


def test_timeouts_count_when_text_arrived_not_when_a_busy_reader_took_it(engines, monkeypatch):
    """A reader busy for longer than the idle timeout (a long segment to generate) still takes text
    that arrived without a pause meanwhile; a pause, or text after the deadline, fails the text even
    when the reader comes late to it."""
    import kazeia.live

    clock = _Clock()
    monkeypatch.setattr(kazeia.live, "time", clock)
    tokenizer = engines["0.6B-custom"].tokenizer

    feed = TextFeed()
    live = LiveText(tokenizer, feed, idle_timeout=0.5, deadline=5.0)
    _fed_at(clock, feed, (0.0, "Hello "))
    assert live._pull() and live.text == "Hello "  # the first wait, at 0
    _fed_at(clock, feed, (0.4, "there, "), (0.6, " "), (0.8, "busy "), (1.2, "reader "))
    clock.now = 4.0  # 2.8 s past the last advancing delta's arrival when the reader comes back
    for _ in range(4):
        assert live._pull()
    assert live.text == "Hello there,  busy reader "
    with pytest.raises(TextTimeout, match="no new text arrived for 0.5 s"):  # nothing queued now
        live._pull()

    feed = TextFeed()
    live = LiveText(tokenizer, feed, idle_timeout=0.5, deadline=5.0)
    _fed_at(clock, feed, (0.0, "One "))
    assert live._pull()  # the first wait, at 0
    _fed_at(clock, feed, (0.3, " "), (0.7, "two "))  # the blank at 0.3 advances nothing
    assert live._pull() and live.text == "One  "  # the blank is taken
    with pytest.raises(TextTimeout, match="no new text arrived for 0.5 s"):
        live._pull()  # "two " arrived 0.7 s after "One "

    feed = TextFeed()
    live = LiveText(tokenizer, feed, idle_timeout=0.5, deadline=1.0)
    _fed_at(clock, feed, (0.0, "a "), (0.4, "b "), (0.8, "c "), (1.2, "d "))
    clock.now = 0.0
    assert live._pull()
    clock.now = 9.0
    assert live._pull() and live._pull() and live.text == "a b c "
    with pytest.raises(TextTimeout, match="did not end within 1 s"):
        live._pull()


def test_closing_while_waiting_for_text_stops_everything(engines):
    feed = TextFeed()
    stream = engines["0.6B-custom"].stream(feed, **OPTIONS)
    feed.append("One two ")
    next(stream)
    start = time.monotonic()
    stream.close()
    assert time.monotonic() - start < 30.0  # it did not wait for text that never comes
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
    assert feed.get(timeout=1)[1] == "Hi" and feed._queue.empty()
