"""Streaming: any chunk schedule gives the offline codes and audio; closing stops the worker."""

import gc
import threading
import time

import numpy as np
import pytest
import torch
from conftest import INT8
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kazeia import Engine, cpu, placement, streaming, utterance
from kazeia.frame import FrameStep, go_on
from kazeia.live import TextFeed
from kazeia.prompt import build_prompt
from kazeia.scheduler import SchedulerBusy
from kazeia.segment import LongTextOptions
from kazeia.streaming import QUEUE_FRAMES, ChunkSchedule
from kazeia.utterance import timeline
from kazeia.vocoder import Vocoder, no_pause

TEXT = "Streaming should sound exactly like offline synthesis."


def _workers() -> int:
    return sum(t.name == "kazeia-generate" for t in threading.enumerate())


def _check_stream(stream, offline, chunks=None):
    """`stream`'s chunks (taken here unless given) against the offline synthesis."""
    chunks = list(stream) if chunks is None else chunks
    assert chunks and chunks[-1].is_last and not any(c.is_last for c in chunks[:-1])
    starts = np.cumsum([0] + [len(c.audio) for c in chunks[:-1]])
    assert [c.start_sample for c in chunks] == list(starts)
    assert all(len(c.audio) == 1920 * c.frames for c in chunks)
    assert all(c.frames >= 1 for c in chunks[:-1])
    np.testing.assert_array_equal(stream.codes, offline.codes)
    audio = np.concatenate([c.audio for c in chunks])
    assert audio.shape == offline.audio.shape
    assert np.max(np.abs(audio - offline.audio)) <= 1e-5
    m = stream.metrics
    assert m.frames == len(offline.codes) and m.chunks == len(chunks)
    assert m.audio_s == pytest.approx(offline.metrics.audio_s)
    assert 0 < m.prefill_s <= m.ttfb_s <= m.wall_s and m.rtf == pytest.approx(m.wall_s / m.audio_s)
    assert m.prefill_s <= m.generation_s <= m.wall_s
    return chunks


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(first=st.integers(1, 6), rest=st.integers(1, 9), seed=st.integers(0, 2**32), layout=st.booleans())
def test_any_schedule_equals_offline(engines, first, rest, seed, layout):
    engine = engines["0.6B-custom"]
    options = dict(voice="serena", seed=seed, max_new_tokens=40, non_streaming_mode=layout)
    offline = engine.synthesize(TEXT, **options)
    chunks = _check_stream(engine.stream(TEXT, first_chunk_frames=first, chunk_frames=rest, **options), offline)
    assert chunks[0].frames == min(first, len(offline.codes))


def test_the_ramp_holds_each_size_for_three_chunks():
    """Each frame more a chunk delays the chunk's first sample by about a frame's generation and
    decode; three chunks of each size let a stream a little faster than real time win that back."""
    assert [ChunkSchedule(1, 4).size(i) for i in range(10)] == [1, 2, 2, 2, 3, 3, 3, 4, 4, 4]
    assert [ChunkSchedule(2, 3).size(i) for i in range(5)] == [2, 3, 3, 3, 3]
    assert [ChunkSchedule(6, 4).size(i) for i in range(3)] == [6, 4, 4]  # a first chunk above the rest
    assert [ChunkSchedule(1, 1).size(i) for i in range(3)] == [1, 1, 1]


def test_default_schedule_starts_with_one_frame(engines):
    engine = engines["1.7B-design"]
    options = dict(instruct="A calm voice.", seed=11, max_new_tokens=30)
    offline = engine.synthesize(TEXT, **options)
    chunks = _check_stream(engine.stream(TEXT, **options), offline)
    assert len(offline.codes) > 20
    # one frame more every RAMP_HOLD (3) chunks, up to chunk_frames
    assert [c.frames for c in chunks[:8]] == [1, 2, 2, 2, 3, 3, 3, 4]
    assert {c.frames for c in chunks[7:-1]} == {4}


def test_a_consumer_that_falls_behind_catches_up_in_longer_chunks(engines):
    """With max_chunk_frames, a later chunk takes the frames already waiting (up to that many):
    a consumer slower than generation gets fewer, longer chunks, and the same codes and audio."""
    engine = engines["0.6B-custom"]
    options = dict(voice="serena", seed=4, max_new_tokens=60, ignore_eos=True)
    offline = engine.synthesize(TEXT, **options)
    opened = time.perf_counter()
    stream = engine.stream(TEXT, first_chunk_frames=1, chunk_frames=2, max_chunk_frames=7, **options)
    first = next(stream)
    # the consumer is away: every frame is made and waits in the queue (it holds them all), and the
    # worker, meeting the token limit after the last frame, queues the end and leaves
    stream._worker.join(timeout=600)
    assert not stream._worker.is_alive()
    joined = time.perf_counter()
    chunks = [first, *stream]
    assert first.frames == 1  # the first chunk never grows: it is the latency
    assert len(offline.codes) == 59  # the last token never becomes a frame
    assert [c.frames for c in chunks[1:]] == [7] * 8 + [2]  # 58 waiting frames, 7 at a time
    m = stream.metrics  # generation ended before the consumer came back: the rest was decoding
    assert m.prefill_s <= m.generation_s <= joined - opened  # it ended before its worker was joined
    assert m.generation_s < m.wall_s  # and the chunks decoded afterwards count in the wall time only
    assert ChunkSchedule(1, 2, 7).limit(1) == 7 and ChunkSchedule(1, 4).limit(1) == 2  # else the ramp
    np.testing.assert_array_equal(stream.codes, offline.codes)
    audio = np.concatenate([c.audio for c in chunks])
    assert np.max(np.abs(audio - offline.audio)) <= 1e-5


def test_a_consumer_that_keeps_up_gets_its_chunk_size(engines, monkeypatch):
    """Generation held by a gate: before each chunk is asked for, exactly that chunk's frames may be
    made, so none are ever waiting and max_chunk_frames never lets a chunk take more."""
    engine = engines["0.6B-custom"]
    options = dict(voice="serena", seed=4, max_new_tokens=30, ignore_eos=True)
    offline = engine.synthesize(TEXT, **options)
    step = engine.runtime.step.decode
    permits = threading.Semaphore(0)

    def gated_step(*args, **kwargs):  # every frame after the prompt's first waits for a permit
        if not permits.acquire(timeout=60):
            raise RuntimeError("no permit came for this frame")
        return step(*args, **kwargs)

    monkeypatch.setattr(engine.runtime.step, "decode", gated_step)
    schedule = ChunkSchedule(1, 3, 3)
    stream = engine.stream(TEXT, chunk_frames=3, max_chunk_frames=3, **options)
    chunks = []
    try:
        while not (chunks and chunks[-1].is_last):
            if chunks:  # the first chunk is the prompt's frame
                permits.release(schedule.size(len(chunks)))
            chunks.append(next(stream))
    finally:
        permits.release(100)  # a failed check leaves no generation thread waiting
    _check_stream(stream, offline, chunks)
    assert len(offline.codes) == 29
    assert [c.frames for c in chunks] == [1, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 1]  # 29 frames
    with pytest.raises(ValueError, match="max_chunk_frames"):
        engine.stream(TEXT, chunk_frames=4, max_chunk_frames=3, **options)


def test_greedy_stream_is_deterministic_across_schedules(engines):
    engine = engines["1.7B-custom"]
    options = dict(voice="dylan", do_sample=False, subtalker_dosample=False, max_new_tokens=25)
    runs = [engine.stream(TEXT, first_chunk_frames=f, chunk_frames=c, **options) for f, c in [(1, 1), (2, 7)]]
    for run in runs:
        list(run)
    np.testing.assert_array_equal(runs[0].codes, runs[1].codes)


def test_closing_early_stops_generation_and_releases_the_worker(engines):
    engine = engines["0.6B-custom"]
    stream = engine.stream(TEXT, voice="ryan", seed=1, max_new_tokens=2000, ignore_eos=True)
    first = next(stream)
    assert first.frames == 1 and not first.is_last
    stream.close()
    assert not any(t.name == "kazeia-generate" and t.is_alive() for t in threading.enumerate())
    stopped_at = stream.frames_generated
    # it never ran past its queue, let alone to 2000 frames: the first chunk's frame, the one the
    # consumer may hold to look ahead, a full queue and the one made while its put waited
    assert stopped_at <= QUEUE_FRAMES + 3
    time.sleep(0.2)
    assert stream.frames_generated == stopped_at
    with pytest.raises(StopIteration):
        next(stream)


def test_breaking_out_of_a_loop_releases_the_worker(engines):
    engine = engines["0.6B-custom"]
    before = _workers()
    for _chunk in engine.stream(TEXT, voice="ryan", seed=2, max_new_tokens=2000, ignore_eos=True):
        break
    deadline = time.monotonic() + 5
    while _workers() > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _workers() == before
    with engine.stream(TEXT, voice="ryan", seed=2, max_new_tokens=2000, ignore_eos=True) as stream:
        next(stream)
    assert _workers() == before


def test_worker_errors_reach_the_caller(engines, monkeypatch):
    engine = engines["0.6B-custom"]
    calls = {"n": 0}
    original = FrameStep._predict

    def failing(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] > 3:
            raise RuntimeError("predictor exploded")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(FrameStep, "_predict", failing)
    with pytest.raises(RuntimeError, match="predictor exploded"):
        list(engine.stream(TEXT, voice="ryan", seed=3, max_new_tokens=100, ignore_eos=True))
    assert _workers() == 0


def test_ignore_eos_generates_exactly_the_limit(engines):
    speech = engines["0.6B-custom"].synthesize(TEXT, voice="ryan", seed=4, max_new_tokens=17, ignore_eos=True)
    assert speech.codes.shape == (16, 16) and (speech.codes[:, 0] < 2048).all()


@pytest.mark.parametrize("first,rest", [(0, 4), (1, 0), (1, 2.5), (True, 4)])
def test_bad_schedule(engines, first, rest):
    with pytest.raises(ValueError, match="must be an integer >= 1"):
        engines["0.6B-custom"].stream(TEXT, voice="ryan", first_chunk_frames=first, chunk_frames=rest)


def test_bad_request_fails_before_any_thread_starts(engines):
    before = _workers()
    with pytest.raises(ValueError, match="unknown voice"):
        engines["0.6B-custom"].stream(TEXT, voice="nobody")
    assert _workers() == before


def test_reference_chunked_decode_option(engines):
    """The reference's 300/25 restart decode equals the exact decode up to 300 frames, then departs."""
    engine = engines["0.6B-custom"]
    options = dict(voice="ryan", seed=6, max_new_tokens=331, ignore_eos=True)
    exact = engine.synthesize(TEXT, **options)
    chunked = engine.synthesize(TEXT, reference_chunked_decode=True, **options)
    np.testing.assert_array_equal(exact.codes, chunked.codes)
    for m in (exact.metrics, chunked.metrics):  # all 330 frames come first, then the decode
        assert m.prefill_s <= m.generation_s < m.wall_s
    cut = 300 * 1920
    assert exact.audio.shape == chunked.audio.shape == (330 * 1920,)
    assert np.max(np.abs(exact.audio[:cut] - chunked.audio[:cut])) <= 1e-5
    assert np.max(np.abs(exact.audio[cut:] - chunked.audio[cut:])) > 1e-4
    with pytest.raises(ValueError, match="reference_chunked_decode must be True or False"):
        engine.synthesize(TEXT, voice="ryan", reference_chunked_decode="yes")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", INT8, "int4"])
def test_a_prompt_on_a_team_gives_the_same_state(tiny_checkpoints, dtype):
    """The talker's pass over a prompt and the first frame's code predictor on two or three threads
    (FrameStep.prefill's team; int4 and int8 split each product's weight rows, the native step's
    too) leave the same KV cache and first frame as on one, bit for bit: which of them a request
    gets may depend on what else the engine does (test below), its codes may not."""
    engine = Engine.load(tiny_checkpoints["0.6B-custom"], dtype=dtype)
    request = engine.request(TEXT, voice=engine.voices[0], seed=4, do_sample=True)
    part = request.parts[0]
    prompt = build_prompt(engine.model, part.text_ids, request.cond, request.non_streaming_mode)
    made, openmp = [], engine.runtime.placement.prompt_team is None or engine.runtime.placement.prompt_team.openmp
    for threads in (1, 2, 3):  # explicit: torch's own count may already be 2 on a larger machine
        with torch.inference_mode():
            generator = torch.Generator().manual_seed(part.seed)
            team = cpu.Team(threads, openmp)
            state, codes = engine.runtime.step.prefill(prompt, request.sampling, generator, team)
        n = state.length  # the positions the prefill wrote (the others are never read: KVCache)
        made.append((codes, [(c.k[:, :, :n].clone(), c.v[:, :, :n].clone()) for c in state.cache.layers]))
    (codes_one, kv_one), *teams = made
    for codes, kv in teams:
        assert torch.equal(codes_one, codes)
        assert all(torch.equal(a, b) for pair in zip(kv_one, kv, strict=True) for a, b in zip(*pair, strict=True))


def test_only_a_first_prompt_alone_gets_the_team(engines, tiny_checkpoints, monkeypatch, held_neighbours):
    """A stream's first prompt runs on the engine's team (every core of the two stages) only when
    the engine has no other request running and no other stream open (the vocoder has nothing to
    decode then) and no other process takes the CPUs (kazeia/neighbours.py: a split prompt would
    wait for its share). A second stream opened meanwhile, and later segments, keep torch's
    threads."""
    engine = engines["0.6B-custom"]
    team = _threads(engine.runtime.placement.prompt_team)  # None on a one-core machine: nobody gets more
    seen = _prefill_teams(monkeypatch)
    options = {"voice": "ryan", "seed": 3, "max_new_tokens": 6}
    first = engine.stream(TEXT, **options)
    next(first)  # its prompt has run
    with engine.stream(TEXT, **options) as second:
        list(second)
    list(first)
    assert seen == [team, None]
    list(engine.stream(TEXT, **options))  # both closed: alone again
    assert seen[2:] == [team]
    long_text = LongTextOptions(segment_tokens=4)
    list(engine.stream("One two three four. Five six seven eight.", long_text=long_text, **options))
    assert len(seen) >= 5 and seen[3:] == [team] + [None] * (len(seen) - 4)  # a segment each
    held_neighbours.held = True  # another process takes the CPUs: alone, yet torch's threads
    seen.clear()
    list(engine.stream(TEXT, **options))
    assert seen == [None]
    held_neighbours.held = False
    # torch's parallel regions join the team, except where int4's own threaded products do the work
    if team is not None:
        int4 = Engine.load(tiny_checkpoints["0.6B-custom"], dtype="int4")
        assert engine.runtime.placement.prompt_team.openmp and not int4.runtime.placement.prompt_team.openmp


def test_a_first_chunk_alone_takes_the_team_and_generation_waits_for_it(engines, monkeypatch, held_neighbours):
    """A stream alone in the engine decodes its first chunk on the prompt team, and its generation
    makes no further frame until that chunk is decoded (a split decode would wait for its share on
    a core the next frame's generation held); its later chunks, and the first chunk of a stream
    opened beside another, and an offline synthesis's first block keep the vocoder's own threads;
    so does a lone stream's first chunk while another process takes the CPUs (kazeia/neighbours.py),
    its generation still waiting. The audio is the offline audio."""
    engine = engines["0.6B-custom"]
    team = _threads(engine.runtime.placement.prompt_team)  # None on a one-core machine
    own = torch.get_num_threads()
    events, stepped = [], threading.Event()
    decode_chunk, decode = Vocoder.decode_chunk, FrameStep.decode

    def decoding(self, codes, state, pause=no_pause):
        events.append(("threads", cpu.stage_team()))
        if sum(e[0] == "threads" for e in events) == 1 and team is not None and not stepped.is_set():
            stepped.wait(timeout=2.0)  # a generation that went on would step meanwhile
        audio = decode_chunk(self, codes, state, pause)
        events.append(("decoded", None))
        return audio

    def stepping(self, states, texts, pause=go_on, team=None):
        stepped.set()
        events.append(("step", None))
        return decode(self, states, texts, pause, team)

    monkeypatch.setattr(Vocoder, "decode_chunk", decoding)
    monkeypatch.setattr(FrameStep, "decode", stepping)
    options = {"voice": "ryan", "seed": 3, "max_new_tokens": 8, "ignore_eos": True}
    stepped.set()  # an offline synthesis: its first block is no first audio, and nobody waits for it
    offline = engine.synthesize(TEXT, **options)
    assert {value for name, value in events if name == "threads"} == {own}
    assert [name for name, _ in events].index("step") < [name for name, _ in events].index("decoded")
    events.clear()
    stepped.clear()
    stream = engine.stream(TEXT, **options)
    _check_stream(stream, offline)
    chunks = [value for name, value in events if name == "threads"]
    assert chunks[0] == (team or own) and set(chunks[1:]) == {own}
    if team is not None:
        assert [name for name, _ in events[:3]] == ["threads", "decoded", "step"]
    with engine.stream(TEXT, **options) as other:
        next(other)  # alone: the team (above)
        events.clear()
        with engine.stream(TEXT, **options) as beside:
            _check_stream(beside, offline)
    assert {value for name, value in events if name == "threads"} == {own}
    events.clear()
    stepped.clear()
    with engine.scheduler(max_batch=2) as scheduler:  # a server's streams: the same, alone
        _check_stream(scheduler.stream(TEXT, **options), offline)
    assert [value for name, value in events if name == "threads"][0] == (team or own)
    if team is not None:
        assert [name for name, _ in events[:3]] == ["threads", "decoded", "step"]
    held_neighbours.held = True  # another process takes the CPUs: a split decode would wait for its share
    with engine.scheduler(max_batch=2) as scheduler:
        for opened in (engine.stream, scheduler.stream):
            events.clear()
            stepped.clear()
            _check_stream(opened(TEXT, **options), offline)
            assert {value for name, value in events if name == "threads"} == {own}
            if team is not None:  # the vocoder's own threads, and generation still leaves it the cores
                assert [name for name, _ in events[:3]] == ["threads", "decoded", "step"]


def test_frame_steps_take_the_team_only_where_no_decode_can_start(tiny_checkpoints, monkeypatch, held_neighbours):
    """A frame step takes the prompt team (the vocoder's core too) for Kazeia's own products while
    nothing decodes, no other stream runs and its stream's next chunk still needs a frame
    (placement.decode_team, SpeechStream.chunk_far): a stream's decode never starts while a step
    holds the team, two streams' steps keep one thread, and without a vocoder (codes only) every
    step takes the team, unless other work takes the CPUs (kazeia/neighbours.py, held here). The
    codes are those of one thread."""
    engine = Engine.load(tiny_checkpoints["0.6B-custom"], dtype="int4")
    team = engine.runtime.placement.prompt_team
    whole = None if team is None else team.threads  # None on a one-core machine
    events: list[tuple[str, int | None]] = []
    decode_chunk, decode = Vocoder.decode_chunk, FrameStep.decode

    def decoding(self, codes, state, pause=no_pause):
        events.append(("decode", None))
        return decode_chunk(self, codes, state, pause)

    running = engine.runtime.running
    crowded: list[int | None] = []  # the threads of steps taken while both streams were open
    both_stepped = threading.Event()

    def stepping(self, states, texts, pause=go_on, team=None):
        before = running.count()
        with cpu.on(team):
            threads = cpu.native_threads()
        if min(before, running.count()) > 1:  # both open when the team was asked (none opens after)
            crowded.append(threads)
            both_stepped.set()
        events.append(("step", threads))
        try:
            return decode(self, states, texts, pause, team)
        finally:
            events.append(("end", threads))

    monkeypatch.setattr(Vocoder, "decode_chunk", decoding)
    monkeypatch.setattr(FrameStep, "decode", stepping)
    options = {"voice": "ryan", "seed": 3, "max_new_tokens": 12, "ignore_eos": True, "do_sample": True}
    request = engine.request(TEXT, **options)
    codes = [frame for frame in timeline(engine.runtime, request) if isinstance(frame, torch.Tensor)]
    assert {threads for name, threads in events if name == "step"} == {whole or 1}

    def one_thread_codes() -> torch.Tensor:
        events.clear()
        made = [frame for frame in timeline(engine.runtime, request) if isinstance(frame, torch.Tensor)]
        assert {threads for name, threads in events if name == "step"} == {1}
        return torch.stack(made)

    held_neighbours.held = True  # another process's work
    assert torch.equal(torch.stack(codes), one_thread_codes())
    held_neighbours.held = False
    monkeypatch.setattr(placement.Placement, "decode_team", lambda *args: None)  # no team at all
    assert torch.equal(torch.stack(codes), one_thread_codes())
    monkeypatch.undo()
    monkeypatch.setattr(Vocoder, "decode_chunk", decoding)
    monkeypatch.setattr(FrameStep, "decode", stepping)

    def two_streams() -> None:  # read in turn once a step ran with both open (each generates ahead)
        with engine.stream(TEXT, **options) as first, engine.stream(TEXT, **options) as second:
            assert both_stepped.wait(timeout=600)
            list(first)
            list(second)

    for run in (lambda: list(engine.stream(TEXT, chunk_frames=4, **options)), two_streams):
        events.clear()
        run()
        holding = False
        for name, threads in events:  # the steps of one generation thread at a time hold the team
            if name == "step":
                holding = threads == whole and whole is not None
            elif name == "end":
                holding = False
            else:
                assert not holding, events
    assert set(crowded) == {1}


def test_a_lone_prompt_is_built_on_the_prompt_team(tiny_checkpoints, monkeypatch, held_neighbours):
    """A stream's prompt (its text projection: first audio's path) is built on the threads its
    prefill takes: the prompt team when the stream is alone, its own stream's and a scheduler's
    alike; generation's own threads while another process takes the CPUs. The audio is the same."""
    engine = Engine.load(tiny_checkpoints["0.6B-custom"], dtype="int4")
    team = engine.runtime.placement.prompt_team
    whole = 1 if team is None else team.threads  # no team on a one-core machine
    own = engine.runtime.placement.threads
    seen: list[int] = []

    def building(*args):
        seen.append(cpu.native_threads())
        return build_prompt(*args)

    monkeypatch.setattr(utterance, "build_prompt", building)
    options = {"voice": "ryan", "seed": 3, "max_new_tokens": 6, "ignore_eos": True}
    offline = engine.synthesize(TEXT, **options)
    assert seen == [whole]
    for neighbour in (False, True):
        held_neighbours.held = neighbour
        seen.clear()
        _check_stream(engine.stream(TEXT, **options), offline)
        with engine.scheduler(max_batch=2) as scheduler:
            _check_stream(scheduler.stream(TEXT, **options), offline)
        assert seen == [own if neighbour else whole] * 2


def test_streams_that_never_started_leave_the_count(engines, monkeypatch):
    """A stream the scheduler refuses (SchedulerBusy) or whose thread cannot start counts neither
    in nor twice out: afterwards an engine with nothing open gives a first prompt its team again."""
    engine = engines["0.6B-custom"]
    team = _threads(engine.runtime.placement.prompt_team)
    seen = _prefill_teams(monkeypatch)
    options = {"voice": "ryan", "seed": 3, "max_new_tokens": 4}
    with engine.scheduler(max_batch=1, max_queue=0) as scheduler:
        # long enough to hold its place: its generation waits on its bounded queue of frames
        held = scheduler.stream(TEXT, **{**options, "max_new_tokens": 4 * QUEUE_FRAMES, "ignore_eos": True})
        next(held)
        with pytest.raises(SchedulerBusy):
            scheduler.stream(TEXT, **options)
        held.close()

    class Refused(threading.Thread):
        def start(self):
            raise RuntimeError("can't start new thread")

    monkeypatch.setattr(streaming.threading, "Thread", Refused)
    with pytest.raises(RuntimeError, match="start new thread"):
        engine.stream(TEXT, **options)
    monkeypatch.undo()
    gc.collect()  # the half-made stream's __del__ must not count it out a second time
    _prefill_teams(monkeypatch, seen)
    list(engine.stream(TEXT, **options))
    # the scheduler's prompt (no audio being decoded: the team too), then the engine's own first one
    assert seen == [team, team]


def test_live_text_decides_its_team_when_its_prompt_runs(engines, monkeypatch):
    """A live-text stream waits for its words before its prompt: whether that prompt gets the team
    is decided then, not when the stream opened. Opened alone, its words arriving while another
    stream is open: no team; the other stream, opened beside it, none either."""
    engine = engines["0.6B-custom"]
    seen = _prefill_teams(monkeypatch)
    options = {"voice": "ryan", "seed": 3, "max_new_tokens": 4}
    feed = TextFeed()
    live = engine.stream(feed, **options)  # alone when opened; its prompt waits for words
    with engine.stream(TEXT, **options) as other:
        next(other)
        feed.append("Words that come while another stream plays. ")
        feed.end()
        next(live)
    list(live)
    assert seen == [None, None]


def _threads(team: cpu.Team | None) -> int | None:
    return None if team is None else team.threads


def _prefill_teams(monkeypatch, seen: list | None = None) -> list:
    """The threads each prefill runs on from now (None: torch's), as FrameStep.prefill is asked,
    appended to `seen` (a new list by default)."""
    seen = [] if seen is None else seen
    prefill = FrameStep.prefill

    def recorded(self, prompt, opts, generator, team=None):
        seen.append(_threads(team))
        return prefill(self, prompt, opts, generator, team)

    monkeypatch.setattr(FrameStep, "prefill", recorded)
    return seen
