"""Batched frame steps and the scheduler (kazeia/frame.py, kazeia/scheduler.py): every request's
codes and audio equal its solo run bit for bit, whatever joins, leaves or pauses beside it."""

import asyncio
import threading
import time
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from conftest import INT8, requires_int8
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kazeia import Engine, cpu, native
from kazeia.admission import Ticket
from kazeia.frame import FrameStep
from kazeia.layers import KVCache
from kazeia.live import TextFeed
from kazeia.products import row_product
from kazeia.prompt import build_prompt
from kazeia.scheduler import SchedulerBusy
from kazeia.segment import LongTextOptions
from kazeia.vocoder import no_pause

TEXTS = (
    "Hello there, how are you today?",
    "Short one.",
    "A somewhat longer sentence that goes on for a while.",
    "Yes, and then some more words.",
)
WORDS = "The quick brown fox jumps over the lazy dog again and again.".split(" ")


@pytest.fixture(scope="module")
def typed(tiny_checkpoints):
    """dtype -> an engine of the tiny 0.6B CustomVoice checkpoint in that precision."""
    made: dict[str, Engine] = {}

    def get(dtype: str, name: str = "0.6B-custom") -> Engine:
        if (dtype, name) not in made:
            made[dtype, name] = Engine.load(tiny_checkpoints[name], dtype=dtype)
        return made[dtype, name]

    return get


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_gemv_gives_each_of_many_rows_its_one_row_result(dtype):
    """gemv.c's rows in pairs: rows 0..m-1 of one call equal m calls of one row each, bit for bit
    (odd counts, and widths that leave a remainder after the vector loops)."""
    from kazeia.native.linear import NativeLinear

    lib = native.library()
    if lib is None or (dtype == torch.float16 and not lib.has_float16()):
        pytest.skip("no native library for this dtype")
    g = torch.Generator().manual_seed(3)
    linear = NativeLinear(torch.nn.Linear(200, 37).to(dtype), lib)
    product = row_product(linear)
    x = torch.randn(7, 200, generator=g).to(dtype)
    together = product(x)
    for i in range(7):
        assert torch.equal(together[i : i + 1], linear(x[i : i + 1]))


@requires_int8
def test_int8_rows_depend_on_their_own_request_only_and_stay_accurate():
    """int8.c's rows, each on its own grid: a request's rows give the same result whatever rows
    share the call (here requests of very different ranges), and the error stays at the weights'
    rounding."""
    from kazeia.quant import QuantLinear

    g = torch.Generator().manual_seed(4)
    weight, bias = torch.randn(96, 256, generator=g), torch.randn(96, generator=g)
    product = row_product(QuantLinear.from_float(weight, bias, native.library()))
    x = torch.randn(4, 2, 256, generator=g) * torch.tensor([1e-3, 1.0, 40.0, 3e4])[:, None, None]
    with torch.inference_mode():
        together = product(x.reshape(8, 256)).view(4, 2, 96)
        for b in range(4):
            assert torch.equal(together[b], product(x[b]))
        scales = weight.abs().amax(dim=1, keepdim=True) / 127
        exact = x @ (torch.round(weight / scales) * scales).T + bias
        for b in range(4):
            error = (together[b] - exact[b]).norm() / (exact[b] - bias).norm()
            assert error < 1e-3


def _prefilled(engine: Engine, i: int, seed: int, frames: int):
    request = engine.request(TEXTS[i], voice=engine.voices[0] if engine.voices else None, seed=seed,
                             do_sample=True, max_new_tokens=frames)  # fmt: skip
    part = request.parts[0]
    prompt = build_prompt(engine.model, part.text_ids, request.cond, request.non_streaming_mode)
    generator = torch.Generator().manual_seed(part.seed)
    state, codes = engine.runtime.step.prefill(prompt, request.sampling, generator)
    return state, prompt, [codes], request


def _step_together(step: FrameStep, items: list) -> None:
    """Step `_prefilled` requests together, each leaving at its own end (None appended to its codes)."""
    live = [i for i, item in enumerate(items) if item[2][-1] is not None]
    while live:
        states = [items[i][0] for i in live]
        texts = [items[i][1].text_at(items[i][0].frames - 1) for i in live]
        for i, codes in zip(live, step.decode(states, texts), strict=True):
            items[i][2].append(codes)
        live = [i for i in live if items[i][2][-1] is not None]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", INT8, "int4"])
@pytest.mark.parametrize("name", ["0.6B-custom", "1.7B-custom"])
@torch.inference_mode()
def test_a_batched_step_gives_each_request_its_solo_codes(typed, dtype, name):
    """Four requests of different lengths stepped together, each leaving at its own end: their
    codes equal one step at a time of each alone (B = 1), and the engine's own frame loop's, at
    every precision."""
    engine = typed(dtype, name)
    step = engine.runtime.step
    lib = native.library()
    if lib is not None and lib.gemv_vector_bits() and cpu.uses("avx2"):
        # The native products read weights once for all rows; the tiny 1.7B's int4 model keeps a
        # float product whose width int4 does not take (an F.linear): its requests step one by one.
        assert step.rows_shared == (name != "1.7B-custom" or dtype != "int4")
    frames = [9, 14, 20, 27]

    def alone(i: int) -> torch.Tensor:
        state, prompt, made, _ = _prefilled(engine, i, i + 5, frames[i])
        while made[-1] is not None:
            made.append(step.decode([state], [prompt.text_at(state.frames - 1)])[0])
        return torch.cat(made[:-1])

    items = [_prefilled(engine, i, i + 5, frames[i]) for i in range(4)]
    _step_together(step, items)
    for i in range(4):
        together = torch.cat(items[i][2][:-1])
        assert torch.equal(together, alone(i))
        assert torch.equal(together, torch.stack(list(engine.frames(items[i][3]))))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int4"])
@torch.inference_mode()
def test_a_kv_cache_position_is_never_read_before_it_is_written(typed, dtype, monkeypatch):
    """KV caches are allocated without zeroing (layers.KVCache). Filled with NaN instead, every
    cache read past its last written position would poison the result: a synthesis's audio and a
    batched step's codes stay what they were with zeroed caches (the talker's and the code
    predictor's both)."""
    engine = typed(dtype)
    step = engine.runtime.step

    def outputs() -> tuple[np.ndarray, list[torch.Tensor]]:
        options = dict(voice=engine.voices[0], seed=3, do_sample=True, max_new_tokens=12)
        audio = engine.synthesize(TEXTS[0], **options).audio
        items = [_prefilled(engine, i, i + 5, 7 + 3 * i) for i in range(3)]
        _step_together(step, items)
        return audio, [torch.cat(item[2][:-1]) for item in items]

    def filled(value: float):
        allocate = KVCache.__init__

        def init(self, *args, **kwargs):
            allocate(self, *args, **kwargs)
            self.k.fill_(value)
            self.v.fill_(value)

        return init

    monkeypatch.setattr(KVCache, "__init__", filled(0.0))
    zeroed = outputs()
    monkeypatch.setattr(KVCache, "__init__", filled(float("nan")))
    poisoned = outputs()
    assert np.isfinite(poisoned[0]).all() and np.array_equal(poisoned[0], zeroed[0])
    for a, b in zip(poisoned[1], zeroed[1], strict=True):
        assert torch.equal(a, b)


def _speak(stream, cancel_after: int | None = None):
    """Audio and codes of a stream; with `cancel_after`, closed after that many chunks."""
    pieces = []
    for n, chunk in enumerate(stream, 1):
        pieces.append(chunk.audio)
        if cancel_after is not None and n >= cancel_after:
            stream.close()
            break
    audio = np.concatenate(pieces) if pieces else np.zeros(0, np.float32)
    return audio, stream.codes


def _until(condition, timeout: float = 30.0) -> None:
    """Wait for a state (a thread has queued...), however slow the machine; fail past `timeout`."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the state waited for never came"
        time.sleep(0.001)


def _options(engine: Engine, spec) -> dict:
    _, frames, seed, _, _ = spec
    return dict(voice=engine.voices[0], seed=seed, do_sample=True, max_new_tokens=frames, chunk_frames=2)


def _live_feed(pause: float) -> TextFeed:
    feed = TextFeed()

    def feed_words() -> None:
        for word in WORDS:
            feed.append(word + " ")
            time.sleep(pause)
        feed.end()

    threading.Thread(target=feed_words, daemon=True).start()
    return feed


REQUEST = st.tuples(
    st.floats(0, 0.015),  # arrival delay (s)
    st.integers(4, 24),  # max_new_tokens
    st.integers(0, 3),  # seed (and text)
    st.none() | st.integers(1, 4),  # cancel after this many chunks
    st.booleans(),  # live text, arriving word by word with pauses
)


@pytest.mark.parametrize("dtype", ["float32", INT8, "bfloat16"])
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(specs=st.lists(REQUEST, min_size=2, max_size=6), max_batch=st.integers(1, 4))
def test_staggered_streams_equal_their_solo_runs(typed, dtype, specs, max_batch):
    """Random arrivals, lengths, seeds, cancellations and live-text pauses through one scheduler:
    every stream's audio and codes equal those of the same request run alone (for float32 and
    int8, the engine's own stream without a scheduler; for bfloat16, alone in a scheduler), and a
    cancelled stream's audio is the start of its solo audio."""
    engine = typed(dtype)
    results: list = [None] * len(specs)
    with engine.scheduler(max_batch=max_batch, max_queue=len(specs)) as scheduler:

        def run(k: int) -> None:
            delay, _, seed, cancel_after, live = specs[k]
            time.sleep(delay)
            text = _live_feed(0.002 * (k + 1)) if live else TEXTS[seed]
            results[k] = _speak(scheduler.stream(text, **_options(engine, specs[k])), cancel_after)

        threads = [threading.Thread(target=run, args=(k,)) for k in range(len(specs))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert max(scheduler.stats.batch_sizes, default=1) <= max_batch
    for k, spec in enumerate(specs):
        _, _, seed, cancel_after, live = spec
        text = [w + " " for w in WORDS] if live else TEXTS[seed]
        if dtype in ("float32", "int8"):
            solo = _speak(engine.stream(text, **_options(engine, spec)))
        else:
            with engine.scheduler(max_batch=1) as alone:
                solo = _speak(alone.stream(text, **_options(engine, spec)))
        audio, codes = results[k]
        if cancel_after is None:
            assert np.array_equal(codes, solo[1])
            assert np.array_equal(audio, solo[0])
        else:
            assert np.array_equal(audio, solo[0][: len(audio)])


def test_long_text_and_speed_go_through_the_scheduler(typed):
    """Segments (each with its own prefill and runaway guard) and a time stretch, batched with
    another stream: the engine's own stream, bit for bit, segments included."""
    engine = typed("float32")
    long = LongTextOptions(segment_tokens=8)
    text = "First part of it. Then a second sentence here. And a third one to end."
    options = dict(voice="serena", seed=3, speed=1.25, long_text=long, max_new_tokens=12, chunk_frames=3)
    solo_stream = engine.stream(text, **options)
    solo = _speak(solo_stream)
    with engine.scheduler(max_batch=2) as scheduler:
        other = scheduler.stream(TEXTS[2], voice="ryan", seed=1, max_new_tokens=40)
        stream = scheduler.stream(text, **options)
        audio, codes = _speak(stream)
        _speak(other)
        assert max(scheduler.stats.batch_sizes) == 2
    assert len(stream.segments) >= 2
    assert stream.segments == solo_stream.segments
    assert np.array_equal(codes, solo[1]) and np.array_equal(audio, solo[0])


def test_a_stream_that_cannot_start_gives_its_place_back(typed, monkeypatch):
    """When no thread can be started for a stream, its queued place is released: it would otherwise
    hold the head of the queue, and no stream after it would ever be admitted."""
    engine = typed("float32")
    with engine.scheduler(max_batch=1, max_queue=1) as scheduler:
        start = threading.Thread.start

        def refuse(thread: threading.Thread) -> None:
            if thread.name == "kazeia-generate":
                raise RuntimeError("can't start new thread")
            start(thread)

        monkeypatch.setattr(threading.Thread, "start", refuse)
        for _ in range(3):  # more than max_batch + max_queue: each place came back
            with pytest.raises(RuntimeError, match="new thread"):
                scheduler.stream(TEXTS[0], voice="serena", seed=1, max_new_tokens=6)
        monkeypatch.setattr(threading.Thread, "start", start)
        assert scheduler.stats.waiting == 0 and scheduler.stats.active == 0
        chunks = list(scheduler.stream(TEXTS[0], voice="serena", seed=1, max_new_tokens=6))
    assert sum(c.frames for c in chunks) == 5


def test_admission_is_first_come_and_the_queue_is_bounded(typed):
    """max_batch 1: streams are admitted in the order they were made; past max_queue waiting
    streams the next is refused; bad sizes are errors."""
    engine = typed("float32")
    with pytest.raises(ValueError, match="max_batch"):
        engine.scheduler(max_batch=0)
    with pytest.raises(ValueError, match="max_queue"):
        engine.scheduler(max_queue=-1)
    made, admitted = [], []  # tickets in the order their streams were made; indices as admitted
    with engine.scheduler(max_batch=1, max_queue=3) as scheduler:
        admission = scheduler.admission
        enqueue, admit = admission.enqueue, admission.admit

        def enqueued():
            made.append(enqueue())
            return made[-1]

        def admitting(ticket):
            if admit(ticket):  # max_batch 1: the next one waits for this stream's generation to end
                admitted.append(made.index(ticket))
                return True
            return False

        admission.enqueue, admission.admit = enqueued, admitting
        streams = [scheduler.stream(TEXTS[k], voice="serena", seed=k, max_new_tokens=10) for k in range(4)]
        with pytest.raises(SchedulerBusy):
            scheduler.stream(TEXTS[0], voice="serena", seed=9)

        def take(k: int) -> None:
            for _ in streams[k]:
                pass

        threads = [threading.Thread(target=take, args=(k,)) for k in reversed(range(4))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        stats = scheduler.stats
    assert admitted == [0, 1, 2, 3]
    assert set(stats.batch_sizes) == {1} and stats.active == 0 and stats.waiting == 0
    assert stats.queue_waits_s[0] < stats.queue_waits_s[-1]


def test_a_cancelled_stream_stops_within_a_frame_and_the_others_go_on(typed):
    engine = typed("float32")
    with engine.scheduler(max_batch=2) as scheduler:
        kept = scheduler.stream(TEXTS[0], voice="serena", seed=1, max_new_tokens=30, ignore_eos=True)
        dropped = scheduler.stream(TEXTS[1], voice="ryan", seed=2, max_new_tokens=400, ignore_eos=True)
        next(iter(dropped))
        dropped.close()
        at_close = dropped.frames_generated
        audio, codes = _speak(kept)
        time.sleep(0.05)
        assert dropped.frames_generated <= at_close + 1
        assert dropped.finish_reason == "cancelled"
    solo = _speak(engine.stream(TEXTS[0], voice="serena", seed=1, max_new_tokens=30, ignore_eos=True))
    assert np.array_equal(codes, solo[1]) and np.array_equal(audio, solo[0])


def test_a_queued_stream_that_is_closed_leaves_the_queue(typed):
    engine = typed("float32")
    with engine.scheduler(max_batch=1, max_queue=1) as scheduler:
        first = scheduler.stream(TEXTS[0], voice="serena", seed=1, max_new_tokens=200, ignore_eos=True)
        waiting = scheduler.stream(TEXTS[1], voice="serena", seed=2)
        next(iter(first))
        waiting.close()
        deadline = time.monotonic() + 120
        while scheduler.stats.waiting and time.monotonic() < deadline:
            time.sleep(0.01)
        assert scheduler.stats.waiting == 0
        scheduler.stream(TEXTS[2], voice="serena", seed=3).close()  # the place is free again
        first.close()


def test_a_stream_dropped_without_closing_is_collected_and_gives_its_place_back(typed):
    """A scheduled stream nobody closes (its consumer lost, an exception upstream) is collected
    like any object: the scheduler keeps no reference to it, so its finalizer stops generation
    and the place goes to the next stream."""
    import gc
    import weakref

    engine = typed("float32")
    with engine.scheduler(max_batch=1, max_queue=1) as scheduler:
        dropped = scheduler.stream(TEXTS[1], voice="ryan", seed=2, max_new_tokens=400, ignore_eos=True)
        next(iter(dropped))
        gone = weakref.ref(dropped)
        del dropped
        gc.collect()
        assert gone() is None
        audio, codes = _speak(scheduler.stream(TEXTS[0], voice="serena", seed=1, max_new_tokens=12, ignore_eos=True))
    solo = _speak(engine.stream(TEXTS[0], voice="serena", seed=1, max_new_tokens=12, ignore_eos=True))
    assert np.array_equal(codes, solo[1]) and np.array_equal(audio, solo[0])


def test_closing_the_scheduler_ends_its_streams_with_an_error(typed):
    from kazeia.scheduler import SchedulerClosed

    engine = typed("float32")
    scheduler = engine.scheduler(max_batch=2)
    stream = scheduler.stream(TEXTS[0], voice="serena", seed=1, max_new_tokens=2000, ignore_eos=True)
    next(iter(stream))
    scheduler.close()
    with pytest.raises(SchedulerClosed):
        for _ in stream:
            pass
    with pytest.raises(SchedulerClosed):
        scheduler.stream(TEXTS[0], voice="serena")


def test_vocoder_lanes_bound_the_decodes_and_serve_first_chunks_then_the_soonest_deadline():
    from kazeia.lanes import VocoderLanes

    for bad in (0, -1, True, 1.5, None):
        with pytest.raises(ValueError, match="vocoder_lanes"):
            VocoderLanes(bad)
    lanes, order, running, most = VocoderLanes(1), [], [0], [0]
    lock = threading.Lock()

    def decode(name: str, first: bool, deadline: float) -> None:
        with lanes.turn(first, deadline, lambda: False) as got:
            assert got
            with lock:
                order.append(name)
                running[0] += 1
                most[0] = max(most[0], running[0])
            time.sleep(0.01)
            with lock:
                running[0] -= 1

    with lanes.turn(False, 0.0, lambda: False):  # the lane is taken: the others queue in any order
        waiters = [
            threading.Thread(target=decode, args=args)
            for args in (("late", False, 5.0), ("soon", False, 1.0), ("first", True, 9.0), ("later", False, 7.0))
        ]
        for k, waiter in enumerate(waiters):
            waiter.start()
            _until(lambda k=k: len(lanes._waiting) == k + 1)  # each has queued before the next
    for waiter in waiters:
        waiter.join(60)
    assert order == ["first", "soon", "late", "later"] and most[0] == 1
    two, inside = VocoderLanes(2), threading.Barrier(2, timeout=60)

    def both() -> None:
        with two.turn(False, 0.0, lambda: False):
            inside.wait()  # both hold a lane at once, or this times out

    pair = [threading.Thread(target=both) for _ in range(2)]
    for thread in pair:
        thread.start()
    for thread in pair:
        thread.join(60)
    assert not inside.broken


def test_a_stopped_stream_leaves_the_vocoder_queue_without_a_turn():
    from kazeia.lanes import VocoderLanes

    lanes, stop, results = VocoderLanes(1), threading.Event(), []

    def wait(first: bool, stopped) -> None:
        with lanes.turn(first, 0.0, stopped) as pause:
            results.append(pause is not None)

    with lanes.turn(False, 0.0, lambda: False):
        quitter = threading.Thread(target=wait, args=(True, stop.is_set))  # first in line, then stopped
        quitter.start()
        _until(lambda: len(lanes._waiting) == 1)  # it has queued
        stop.set()
        quitter.join(60)
        assert results == [False]
    wait(False, lambda: False)  # its place is not held: the next one gets the lane
    assert results == [False, True]


def test_a_decode_hands_its_lane_to_a_first_chunk_at_a_pause_and_gets_it_back():
    """A later chunk's decode gives the lane up at its next pause point to a first chunk that waits
    (and to no other), then resumes before the later chunks that queued after it; a first chunk's
    own decode never pauses."""
    from kazeia.lanes import VocoderLanes

    lanes, order, queued = VocoderLanes(1), [], threading.Event()

    def decode(name: str, first: bool, deadline: float, stages: int = 3) -> None:
        with lanes.turn(first, deadline, lambda: False) as pause:
            for stage in range(stages):
                order.append(f"{name}{stage}")
                if name == "long" and stage == 0:
                    queued.wait(60)  # the others have queued by now
                pause()

    long = threading.Thread(target=decode, args=("long", False, 1.0))
    long.start()
    while not order:
        time.sleep(0.001)
    others = [threading.Thread(target=decode, args=args) for args in (("later", False, 0.5), ("first", True, 9.0))]
    for k, thread in enumerate(others):
        thread.start()
        _until(lambda k=k: len(lanes._waiting) == k + 1)  # queued before the next
    queued.set()
    for thread in [long, *others]:
        thread.join(60)
    # "later" has an earlier deadline than "long", yet does not take its lane: only first chunks do
    assert order == ["long0", "first0", "first1", "first2", "long1", "long2", "later0", "later1", "later2"]


def test_a_paused_decode_of_a_stopped_stream_ends_without_its_lane():
    from kazeia.lanes import LaneStopped, VocoderLanes

    lanes, stop, outcome, release = VocoderLanes(1), threading.Event(), [], threading.Event()

    def decode() -> None:
        try:
            with lanes.turn(False, 0.0, stop.is_set) as pause:
                while not lanes._waiting:  # the first chunk below has queued
                    time.sleep(0.001)
                pause()  # gives the lane up to it, is stopped while waiting for it back
                outcome.append("decoded")
        except LaneStopped:
            outcome.append("stopped")

    def first() -> None:
        with lanes.turn(True, 0.0, lambda: False):
            stop.set()
            release.wait(60)

    threads = [threading.Thread(target=decode), threading.Thread(target=first)]
    threads[0].start()
    while not lanes.decoding():
        time.sleep(0.001)
    threads[1].start()
    threads[0].join(60)
    release.set()
    threads[1].join(60)
    assert outcome == ["stopped"] and not lanes.decoding()
    with lanes.turn(False, 0.0, lambda: False) as pause:  # the lane was given back once, not twice
        assert pause is not None and lanes.decoding() and lanes._free == 0


@pytest.mark.parametrize("dtype", ["float32", pytest.param("int8", marks=requires_int8)])
def test_a_scheduled_prompt_takes_the_team_only_while_no_audio_is_decoded(typed, monkeypatch, held_neighbours, dtype):
    """No decode holding a lane: a joining stream's prompt runs on the engine's
    prompt team, as a lone `Engine.stream`'s first prompt does; while a decode holds a lane, or
    while another process takes the CPUs (kazeia/neighbours.py), on generation's own threads. With
    Kazeia's own products (int8) the team is asked at each product, so a prompt takes the second
    core as soon as the decode ends."""
    engine = typed(dtype)
    team = engine.runtime.placement.prompt_team
    if team is None:
        pytest.skip("one core per stage is all this machine has: no prompt team")
    seen, teams, prefill, second = [], [], FrameStep.prefill, threading.Event()

    def prefilled(self, prompt, opts, generator, given=None):
        teams.append(given)
        threads = None if given is None else given.threads
        seen.append((threads() if callable(threads) else threads, True if given is None else given.openmp))
        if len(seen) == 2:
            second.set()
        return prefill(self, prompt, opts, generator, given)

    monkeypatch.setattr(FrameStep, "prefill", prefilled)
    with engine.scheduler(max_batch=2) as scheduler:
        assert not scheduler.lanes.decoding()
        _speak(scheduler.stream(TEXTS[0], voice="ryan", seed=1, max_new_tokens=3))
        with scheduler.lanes.turn(False, 0.0, lambda: False):  # a decode holds the only lane
            assert scheduler.lanes.decoding()
            stream = scheduler.stream(TEXTS[1], voice="ryan", seed=2, max_new_tokens=3)  # its thread starts
            assert second.wait(120)  # its prefill has asked for its team while the lane is held
        _speak(stream)
    if team.openmp:  # torch's threads: decided at the start
        assert seen == [tuple(team), (None, True)]
    else:
        assert seen == [tuple(team), (1, False)] and teams[1].threads() == team.threads
    held_neighbours.held = True
    seen.clear()
    with engine.scheduler(max_batch=2) as scheduler:
        _speak(scheduler.stream(TEXTS[0], voice="ryan", seed=1, max_new_tokens=3))
    assert seen == [(None, True) if team.openmp else (1, False)]


@pytest.mark.parametrize("dtype", ["float32", pytest.param("int8", marks=requires_int8)])
def test_prompts_waiting_together_run_side_by_side_each_as_alone(typed, monkeypatch, dtype):
    """Two prompts waiting at one frame boundary run at once (the scheduler's thread and a helper),
    each on its share of the prompt team while both run (Kazeia's own products: one thread each;
    torch's: generation's threads), and each gives what the same prompt gives run alone: its first
    codes and its talker cache."""
    from kazeia import scheduler as scheduling

    engine = typed(dtype)
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="prompts_at_once"):
            engine.scheduler(prompts_at_once=bad)
    placement = engine.runtime.placement
    team = placement.prompt_team
    if team is None or team.threads < 2 * placement.threads:
        pytest.skip("no prompt team of two stages' threads here: prompts run one at a time")
    jobs, alone = [], []
    with torch.inference_mode():
        for i in range(2):
            request = engine.request(TEXTS[i], voice="ryan", seed=i + 3, do_sample=True, max_new_tokens=8)
            part = request.parts[0]
            prompt = build_prompt(engine.model, part.text_ids, request.cond, request.non_streaming_mode)
            jobs.append((prompt, request.sampling, torch.Generator().manual_seed(part.seed)))
            generator = torch.Generator().manual_seed(part.seed)
            alone.append(engine.runtime.step.prefill(prompt, request.sampling, generator))
    both, seen, prefill = threading.Barrier(2, timeout=120), [], FrameStep.prefill

    def prefilled(self, prompt, opts, generator, given=None):
        both.wait()  # each waits for the other: one after the other, the barrier breaks
        threads, openmp = (None, True) if given is None else given
        seen.append((threading.current_thread().name, threads() if callable(threads) else threads, openmp))
        both.wait()  # both shares read while both prompts run: one that ended first frees its threads
        return prefill(self, prompt, opts, generator, given)

    monkeypatch.setattr(FrameStep, "prefill", prefilled)
    with engine.scheduler(max_batch=2) as scheduler:
        works = [scheduling._Work(Ticket(), prefill=job) for job in jobs]
        with scheduler._model_lock:
            scheduler._prefills_held(works)
        assert scheduler.stats.prefills == 2
    assert len({name for name, _, _ in seen}) == 2
    share = (1, False) if not team.openmp else (None, True)
    assert [(threads, openmp) for _, threads, openmp in seen] == [share, share]
    for work, (state, codes) in zip(works, alone, strict=True):
        assert work.error is None
        made, first = work.result
        assert torch.equal(first, codes)
        n = state.length  # the positions a prefill writes (the rest of a cache is never read: KVCache)
        assert made.length == n
        for mine, theirs in zip(made.cache.layers, state.cache.layers, strict=True):
            assert torch.equal(mine.k[:, :, :n], theirs.k[:, :, :n])
            assert torch.equal(mine.v[:, :, :n], theirs.v[:, :, :n])


def test_a_spare_lane_decodes_only_while_generation_waits():
    """A spare lane (generation's own core) is taken only while generation has nothing to run; a
    decode on it stops at its next pause point when generation has work again, and goes on when
    generation waits again or a lane frees (the decode then holds that lane)."""
    from kazeia.lanes import LaneStopped, VocoderLanes

    with pytest.raises(ValueError, match="spare_lanes"):
        VocoderLanes(1, -1)
    lanes, events, release, resumed = VocoderLanes(1, spare=1), [], threading.Event(), threading.Event()

    def spare_decode() -> None:
        with lanes.turn(False, 0.0, lambda: False) as pause:
            events.append("took")
            pause()  # generation still waits: goes on
            events.append("stage 1")
            release.wait(60)  # generation has work again by now
            pause()  # waits for it to end, or for a lane
            events.append("stage 2")
            resumed.set()

    with lanes.turn(False, 0.0, lambda: False):  # the one lane is taken
        thread = threading.Thread(target=spare_decode)
        thread.start()
        time.sleep(0.1)
        assert events == []  # generation runs (the default): the spare lane is its core
        lanes.generating(False)
        while len(events) < 2:
            time.sleep(0.001)
        assert events == ["took", "stage 1"] and lanes._spare_free == 0
        lanes.generating(True)
        release.set()
        assert not resumed.wait(0.2)  # stopped at the pause while generation runs
    assert resumed.wait(60) and events[-1] == "stage 2"  # the lane freed: it went on there
    thread.join(60)
    assert not lanes.decoding() and lanes._free == 1 and lanes._spare_free == 1
    stop = threading.Event()
    lanes.generating(False)
    with pytest.raises(LaneStopped):  # stopped while waiting on its spare lane: nothing is held after
        with lanes.turn(False, 0.0, lambda: False), lanes.turn(False, 0.0, stop.is_set) as pause:
            lanes.generating(True)
            stop.set()
            pause()
    assert lanes._free == 1 and lanes._spare_free == 1
    lanes.generating(False)
    with lanes.turn(False, 0.0, lambda: False), lanes.turn(True, 0.0, lambda: False) as pause:
        lanes.generating(True)  # a first chunk on the spare lane goes on all the same
        pause()
        assert lanes._spare_free == 0


def test_a_scheduled_stream_generates_only_what_its_vocoder_needs_soon(typed):
    """A scheduled stream is stepped while fewer frames than its next two chunks take are made and
    not yet decoding: with its consumer away it stops there (alone it would run 64 frames ahead),
    and goes on when the consumer comes back; the codes and audio are those of the stream alone."""
    from kazeia.streaming import PACE_CHUNKS

    engine = typed("float32")
    options = dict(voice="serena", seed=3, max_new_tokens=40, ignore_eos=True)
    with engine.scheduler(max_batch=2) as scheduler:
        stream = scheduler.stream(TEXTS[0], **options)
        chunks = [next(stream)]  # 1 frame; the next chunk takes 2
        made = _paced(scheduler, stream, 1 + PACE_CHUNKS * 2)  # the consumer is away
        chunks += list(stream)
    assert made == 1 + PACE_CHUNKS * 2
    assert sum(c.frames for c in chunks) == 39
    alone = engine.stream(TEXTS[0], **options)
    audio = np.concatenate([c.audio for c in alone])
    assert np.array_equal(stream.codes, alone.codes) and np.array_equal(
        np.concatenate([c.audio for c in chunks]), audio
    )
    with engine.scheduler(max_batch=2) as scheduler:  # a chunk that may catch up with 7 frames: 2 x 7 ready
        stream = scheduler.stream(TEXTS[0], chunk_frames=2, max_chunk_frames=7, **options)
        next(stream)
        assert _paced(scheduler, stream, 1 + PACE_CHUNKS * 7) == 1 + PACE_CHUNKS * 7
        assert [c.frames for c in stream][:2] == [7, 7]  # it catches up, as a stream alone would


def _paced(scheduler, stream, frames: int, timeout: float = 120.0) -> int:
    """The frames `stream` has made once the scheduler waits with nothing due (its steps paced to
    the vocoders: `lanes._generating` False) after making at least `frames`; bounded by `timeout`,
    whatever the machine's speed. While it waits, nothing more is made (the consumer is away)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if stream.frames_generated >= frames and not scheduler.lanes._generating:
            return stream.frames_generated
        time.sleep(0.005)
    return stream.frames_generated


def test_the_scheduler_runs_one_decode_at_a_time_with_one_lane(typed, monkeypatch):
    engine = typed("float32")
    vocoder, running, most = engine.vocoder, [0], [0]
    decode, lock = vocoder.decode_chunk, threading.Lock()

    def enter() -> None:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])

    def leave() -> None:
        with lock:
            running[0] -= 1

    def counted(codes, state, pause):
        def paused() -> None:  # a paused decode is not running (another may have its lane meanwhile)
            leave()
            try:
                pause()
            finally:
                enter()

        enter()
        try:
            time.sleep(0.005)  # widens any overlap
            return decode(codes, state, paused)
        finally:
            leave()

    monkeypatch.setattr(vocoder, "decode_chunk", counted)
    specs = [(TEXTS[i], 20 + 3 * i, 40 + i) for i in range(3)]
    with engine.scheduler(max_batch=3, vocoder_lanes=1, spare_lanes=0) as scheduler:
        streams = [
            scheduler.stream(text, voice="serena", seed=seed, max_new_tokens=n, ignore_eos=True)
            for text, n, seed in specs
        ]
        results = [None] * 3
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, _speak(streams[i]))) for i in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    monkeypatch.undo()
    assert most[0] == 1
    for (text, n, seed), (audio, codes) in zip(specs, results, strict=True):
        solo = _speak(engine.stream(text, voice="serena", seed=seed, max_new_tokens=n, ignore_eos=True))
        assert np.array_equal(codes, solo[1]) and np.array_equal(audio, solo[0])


def test_a_joining_streams_prefill_runs_at_the_next_frame_boundary(typed, monkeypatch):
    import kazeia.scheduler as scheduling

    monkeypatch.setattr(scheduling, "GRACE_S", 2.0)  # a worker that submits late still makes it
    monkeypatch.setattr(scheduling, "PROMPT_GRACE_S", 60.0)  # and a prompt built late (every one has its prefill)
    engine = typed("float32")
    events: list[str] = []
    with engine.scheduler(max_batch=2) as scheduler:
        exclusive, prefill, step = scheduler._exclusive, scheduler._prefill, scheduler.step.decode

        @contextmanager
        def watched_prompt():
            with exclusive():
                yield
            events.append("prompt")

        def watched_prefill(work):
            events.append("prefill")
            prefill(work)

        def watched_step(states, texts, pause=no_pause, team=None):
            events.append("step")
            return step(states, texts, pause, team)

        monkeypatch.setattr(scheduler, "_exclusive", watched_prompt)
        monkeypatch.setattr(scheduler, "_prefill", watched_prefill)
        monkeypatch.setattr(scheduler.step, "decode", watched_step)
        running = scheduler.stream(TEXTS[0], voice="serena", seed=1, max_new_tokens=400, ignore_eos=True)
        chunks = iter(running)
        next(chunks)
        while events.count("step") < 3:  # the first stream steps on its own
            next(chunks)
        joining = scheduler.stream(TEXTS[1], voice="ryan", seed=2, max_new_tokens=6, ignore_eos=True)
        _speak(joining)
        running.close()
    joined = len(events) - 1 - events[::-1].index("prompt")  # the joining stream's prompt
    assert events[joined + 1] == "prefill", events[joined - 2 : joined + 3]


def test_a_stream_that_joins_during_a_step_starts_within_it(typed, monkeypatch):
    """A stream that joins while a step runs builds its prompt and runs its prefill at the step's
    next pause, before the step ends; both streams still speak their solo audio."""
    engine = typed("float32")
    events: list[str] = []
    joining: dict = {}
    options = dict(voice="ryan", seed=2, max_new_tokens=6, ignore_eos=True)
    with engine.scheduler(max_batch=2) as scheduler:
        step, prefill = scheduler.step.decode, scheduler._prefill

        def join() -> None:
            joining["got"] = _speak(scheduler.stream(TEXTS[1], **options))

        def watched_step(states, texts, pause=no_pause, team=None):
            third = events.count("step") == 2
            events.append("step")

            def watched_pause():
                if third and "join" not in events:  # a stream arrives in the middle of the third step
                    events.append("join")
                    joining["thread"] = threading.Thread(target=join)
                    joining["thread"].start()
                    deadline = time.monotonic() + 120
                    while events[-1] != "prefill" and time.monotonic() < deadline:
                        pause()  # the scheduler's own pause: it lets the new stream in, or not
                        time.sleep(0.002)
                pause()

            got = step(states, texts, watched_pause, team)
            events.append("end")
            return got

        def watched_prefill(work):
            events.append("prefill")
            prefill(work)

        monkeypatch.setattr(scheduler.step, "decode", watched_step)
        monkeypatch.setattr(scheduler, "_prefill", watched_prefill)
        running = _speak(scheduler.stream(TEXTS[0], voice="serena", seed=1, max_new_tokens=10, ignore_eos=True))
        joining["thread"].join(30)
    arrived = events.index("join")
    assert events[arrived + 1 : arrived + 3] == ["prefill", "end"], events
    for got, (text, kwargs) in (
        (running, (TEXTS[0], dict(voice="serena", seed=1, max_new_tokens=10))),
        (joining["got"], (TEXTS[1], options)),
    ):
        solo = _speak(engine.stream(text, **{**kwargs, "ignore_eos": True}))
        assert np.array_equal(got[1], solo[1]) and np.array_equal(got[0], solo[0])


pytest.importorskip("fastapi")
pytest.importorskip("httpx")


def test_max_batch_is_checked():
    from kazeia.server import ServerConfig

    for bad in (0, -1, True, 1.5, 65):
        with pytest.raises(ValueError, match="max_batch"):
            ServerConfig("m", max_batch=bad)
    assert ServerConfig("m").max_batch == 4  # four utterances at once unless asked (BENCHMARKS.md)


def test_a_full_queue_is_refused_with_retry_after_under_max_batch(engines):
    """--max-batch 2, --queue-size 1: 2 long requests are generated together; of 6 more sent while
    both are held after their first audio (HeldJobs: they cannot end first, however fast the
    machine), one waits in the queue and the rest get 503 with a Retry-After; the server ends idle.
    (The first two are sent one at a time, each once a serving thread holds the one before.)"""
    import httpx
    from server_support import HeldJobs, LiveServer

    from kazeia.server import Limits, ServerConfig, create_app

    app = create_app(engines["0.6B-custom"], ServerConfig("tiny-custom", queue_size=1, max_batch=2,
                                                          limits=Limits(max_new_tokens=400)))  # fmt: skip
    body = dict(input=TEXTS[0], voice="serena", max_new_tokens=300, ignore_eos=True, response_format="pcm")

    async def client(http, k: int) -> tuple[int, str | None]:
        async with http.stream("POST", "/v1/audio/speech", json={**body, "seed": k}) as response:
            await response.aread()
            return response.status_code, response.headers.get("retry-after")

    async def all_clients(url: str, gate: HeldJobs):
        async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(120)) as http:
            first = []
            for k in range(2):  # one at a time: sent at once, both could find the queue's one place taken
                first.append(asyncio.create_task(client(http, k)))
                await asyncio.to_thread(gate.wait_held, k + 1)  # a serving thread holds it
            rest = [asyncio.create_task(client(http, k)) for k in range(2, 8)]
            pending, loop = set(rest), asyncio.get_running_loop()
            deadline = loop.time() + 120
            while len(pending) > 1 and loop.time() < deadline:  # five answered; one waits for a place
                _, pending = await asyncio.wait(pending, timeout=10, return_when=asyncio.FIRST_COMPLETED)
            assert len(pending) == 1, f"{len(pending)} of 6 requests unanswered while two are held"
            gate.release()
            return await asyncio.gather(*first, *rest)

    with LiveServer(app) as server, HeldJobs() as gate:
        got = asyncio.run(all_clients(server.url, gate))
        worker = app.state.kazeia.worker
        deadline = time.monotonic() + 60
        while worker.active and time.monotonic() < deadline:
            time.sleep(0.02)
        assert worker.active == 0
    statuses = [status for status, _ in got]
    assert statuses[:2] == [200, 200] and statuses.count(200) == 3 and statuses.count(503) == 5
    assert max(worker.scheduler.stats.batch_sizes) == 2
    assert all(int(after) >= 1 for status, after in got if status == 503)


def test_the_server_serves_16_clients_with_max_batch_4(engines):
    """16 concurrent streaming clients against --max-batch 4, a few leaving early: every complete
    response is the engine's own audio for its request, steps were batched, and the server ends idle."""
    import httpx
    from server_support import LiveServer, assert_pcm_equal, offline_pcm

    from kazeia.server import Limits, ServerConfig, create_app

    engine = engines["0.6B-custom"]
    config = ServerConfig("tiny-custom", queue_size=16, max_batch=4, limits=Limits(max_new_tokens=64))
    app = create_app(engine, config)
    bodies = [
        dict(input=TEXTS[k % 4], voice=("serena", "ryan")[k % 2], seed=k, max_new_tokens=6 + k, response_format="pcm")
        for k in range(16)
    ]

    async def client(http, k: int) -> bytes | None:
        async with http.stream("POST", "/v1/audio/speech", json=bodies[k]) as response:
            assert response.status_code == 200
            data = b""
            async for piece in response.aiter_bytes():
                data += piece
                if k % 5 == 4 and data:
                    return None  # leaves early
            return data

    async def all_clients(url: str):
        async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(120)) as http:
            return await asyncio.gather(*(client(http, k) for k in range(16)))

    with LiveServer(app) as server:
        got = asyncio.run(all_clients(server.url))
        deadline = time.monotonic() + 10
        worker = app.state.kazeia.worker
        while worker.active and time.monotonic() < deadline:
            time.sleep(0.02)
        assert worker.active == 0
        metrics = httpx.get(f"{server.url}/metrics").text
    sizes = worker.scheduler.stats.batch_sizes
    assert max(sizes) > 1 and max(sizes) <= 4
    assert "kazeia_batch_size_count" in metrics and "kazeia_queue_wait_seconds_count" in metrics
    for k, data in enumerate(got):
        if data is not None:
            options = {key: v for key, v in bodies[k].items() if key not in ("input", "response_format")}
            assert_pcm_equal(data, offline_pcm(engine, bodies[k]["input"], **options))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", INT8, "int4"])
@pytest.mark.parametrize(("requests", "positions"), [(1, 1), (1, 2), (3, 1), (2, 2)])
@torch.inference_mode()
def test_the_step_in_one_native_call_equals_the_step_layer_by_layer(typed, dtype, requests, positions):
    """stack.c's whole step (one call, where every product is native in the activations' dtype)
    gives the bits of the layer-by-layer step, solo and batched, results and caches."""
    model = typed(dtype).model
    for stack in (model.talker, model.code_predictor):
        step = stack.native_step
        products = [p for layer in stack.layers for p in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                          layer.mlp.gate_up_proj, layer.mlp.down_proj)]  # fmt: skip
        native = all(getattr(p, "product_spec", lambda dtype: None)(step.dtype) is not None for p in products)
        assert (step.whole is not None) == native  # float products without the GEMV are not
        assert native or dtype not in ("int4", "int8")  # int4.c's and int8.c's wherever these load
        if step.whole is None:
            continue
        generator = torch.Generator().manual_seed(requests * 10 + positions)
        x = torch.randn(requests * positions, step.hidden, generator=generator).to(step.dtype)
        starts = [int(s) for s in torch.randint(0, 40, (requests,), generator=generator)]
        caches = [stack.new_cache(64) for _ in range(requests)]
        for cache in caches:
            for layer in cache:
                layer.k.normal_(generator=generator), layer.v.normal_(generator=generator)
        copies = [[KVCache(1, c.k.shape[1], 64, c.k.shape[3], "cpu", c.k.dtype) for c in cache] for cache in caches]
        for cache, copy in zip(caches, copies, strict=True):
            for layer, twin in zip(cache, copy, strict=True):
                twin.k.copy_(layer.k), twin.v.copy_(layer.v)
        rope = [stack.rotary.span(s, positions, step.dtype, "cpu") for s in starts]
        whole = step._run_whole(x, positions, list(zip(rope, caches, starts, strict=True)))
        layers = step.layers if requests == 1 else step.batch_layers
        apart = step._run(x, positions, list(zip(rope, copies, starts, strict=True)), layers)
        assert torch.equal(whole, apart)
        for cache, copy in zip(caches, copies, strict=True):
            assert all(torch.equal(a.k, b.k) and torch.equal(a.v, b.v) for a, b in zip(cache, copy, strict=True))
