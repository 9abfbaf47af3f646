"""An utterance: a request's frames, segment after segment, and the stream that speaks them.

`timeline` yields a request's frames and, after each segment's last frame, its `Segment`: each
segment's prompt (kazeia/prompt.py), seed and runaway guard, live text's prompt and trailing text
track, an in-context reference carried from one segment to the next. `open_stream` wires a request
to a `SpeechStream`: its frames from a `FrameSource` (`Alone` here, generated in the stream's own
thread; a scheduler's, batched with other streams: kazeia/scheduler.py), its vocoder state (an ICL
voice's primed one), its count in `runtime.running`. Everything takes a Runtime. Non-goals: the
frame step (kazeia/frame.py), chunking and decoding (kazeia/streaming.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import replace

import torch

from . import generate
from .live import live_trailing
from .prompt import Conditioning, Prompt, build_prompt, needs_whole_text
from .request import Request, bounded
from .runaway import CANCELLED, RunawayGuard
from .runtime import Runtime
from .segment import Part, Segment
from .streaming import ChunkSchedule, FrameSource, SpeechStream
from .text import CLOSING_IDS, ROLE_IDS
from .voices import Voice


def timeline(
    runtime: Runtime,
    request: Request,
    should_stop: Callable[[], bool] | None = None,
    steps: generate.Steps | None = None,
) -> Iterator[torch.Tensor | Segment]:
    """A request's (16,) code frames, each segment's last frame followed by its `Segment`. Segment k
    speaks with its own seed (segment.Part), its own talker cache and prompt: the same voice, and
    with `carry_context` the previous segment's text and frames as in-context reference (a segment
    the guard found looping is not continued). A segment the caller stops ends the utterance.
    `steps`: who runs the frame steps (None: at once, the first prompt on the placement's team
    while the engine runs nothing else). Counted in `runtime.running` while it runs."""
    runtime.running.enter()
    try:
        if steps is None:
            yield from _alone(runtime, request, should_stop)
        else:
            yield from _segments(runtime, request, should_stop, steps, steps)
    finally:
        runtime.running.leave()


def _alone(
    runtime: Runtime, request: Request, should_stop: Callable[[], bool] | None
) -> Iterator[torch.Tensor | Segment]:
    """`_segments` with each step at once, the first prompt on the placement's team while the
    runtime counts this request alone."""
    first = generate.Solo(runtime.step, runtime.placement.first_prompt_team(runtime.running))
    return _segments(runtime, request, should_stop, first, generate.Solo(runtime.step))


def _segments(
    runtime: Runtime,
    request: Request,
    should_stop: Callable[[], bool] | None,
    first: generate.Steps,
    steps: generate.Steps,
) -> Iterator[torch.Tensor | Segment]:
    """`timeline`, the first segment's steps `first`, the others' `steps`."""
    rate, per_frame = runtime.vocoder.cfg.sample_rate, runtime.vocoder.cfg.samples_per_frame
    start, previous = 0, None
    for index, part in enumerate(request.parts or (None,)):
        made: list[torch.Tensor] = []
        guard = None
        runs = first if index == 0 else steps
        if part is None:  # live text: one segment, as long as max_new_tokens allows
            reason = yield from _kept(_live_frames(runtime, request, should_stop, runs), made)
            text = request.live.text if request.live is not None else ""
        else:
            cond = _continued(request, previous)
            with runs.exclusive():
                prompt = build_prompt(runtime.model, part.text_ids, cond, request.non_streaming_mode)
            generator = torch.Generator(device=runtime.device).manual_seed(part.seed)
            guard = RunawayGuard(part.budget, request.long_text.loop_frames) if request.guarded else None
            frames = generate.frames(prompt, request.options, generator, runs, should_stop, guard)
            reason, text = (yield from _kept(frames, made)), part.text
        end = start + len(made) * per_frame
        yield Segment(index, text, start, end, reason, rate)
        if reason == CANCELLED:
            return
        looped = guard is not None and guard.looped
        start, previous = end, (None if looped else part, made)


def _live_frames(
    runtime: Runtime, request: Request, should_stop: Callable[[], bool] | None, steps: generate.Steps
) -> Generator[torch.Tensor, None, str]:
    prompt = _live_prompt(runtime, request, should_stop, steps)
    if prompt is None:  # stopped while waiting for live text
        return CANCELLED
    generator = torch.Generator(device=runtime.device).manual_seed(request.seed)
    return (yield from generate.frames(prompt, request.options, generator, steps, should_stop))


def _live_prompt(
    runtime: Runtime, request: Request, should_stop: Callable[[], bool] | None, steps: generate.Steps
) -> Prompt | None:
    live = request.live
    assert live is not None
    live.should_stop = should_stop
    whole = needs_whole_text(request.cond, request.non_streaming_mode)
    if not live.start() or not (live.wait_for_end() if whole else live.need(1)):
        return None
    if whole:  # all of the text goes into the prompt: it must fit the model's positions too
        bounded(runtime.caps, request, len(live.ids))
    ids = runtime.tokenizer.wrap_assistant(live.ids if whole else live.ids[:1])
    with steps.exclusive():
        prompt = build_prompt(runtime.model, ids, request.cond, request.non_streaming_mode)
    if not whole:  # the trailing text track, one token per frame as it arrives

        def embed(token: int) -> torch.Tensor:
            with steps.exclusive():
                return runtime.model.talker.embed_text(torch.tensor([[token]], device=runtime.device))

        prompt.text_source = live_trailing(live, embed, prompt.eos, prompt.pad)
    return prompt


def _kept(frames: Generator[torch.Tensor, None, str], into: list[torch.Tensor]) -> Generator[torch.Tensor, None, str]:
    """`frames` passed on, each also appended to `into`; returns their finish reason."""
    while True:
        try:
            frame = next(frames)
        except StopIteration as end:
            return end.value
        into.append(frame)
        yield frame


def _continued(request: Request, previous: tuple[Part | None, list[torch.Tensor]] | None) -> Conditioning:
    """A segment's conditioning: the request's voice, continuing the previous segment (None: one not
    to continue) with `carry_context` (Base checkpoints: its text and frames in place of the voice's
    reference)."""
    voice = request.cond.voice
    if not request.long_text.carry_context or previous is None or voice is None:
        return request.cond
    part, made = previous
    if part is None or not made:
        return request.cond
    context = Voice(voice.x_vector, torch.stack(made), part.text, voice.model)
    return replace(request.cond, voice=context, ref_text_ids=part.text_ids[ROLE_IDS:-CLOSING_IDS])


class Alone:
    """The frames of a stream generated in its own thread, each step at once (a `FrameSource`)."""

    lanes = None

    def __init__(self, runtime: Runtime, request: Request, should_stop: Callable[[], bool] | None = None):
        self.runtime, self.request, self.should_stop = runtime, request, should_stop

    def frames(self, stop: Callable[[], bool]) -> Iterator[torch.Tensor | Segment]:
        """`timeline`'s, counted in `runtime.running` once, by the stream (`open_stream`)."""
        either = stop if self.should_stop is None else (lambda: stop() or self.should_stop())  # type: ignore[misc]
        return _alone(self.runtime, self.request, either)

    def pace(self, needs_frames: Callable[[], bool]) -> None:
        """Unpaced: the stream's queue bounds how far generation runs ahead."""

    def release(self) -> None:
        """Nothing was taken before the stream started."""


def open_stream(
    runtime: Runtime,
    request: Request,
    source: FrameSource,
    schedule: ChunkSchedule | None = None,
    started: float | None = None,
) -> SpeechStream:
    """A `SpeechStream` speaking `request`, its frames from `source`; counted in `runtime.running`
    until it closes (its vocoder works until then)."""
    ref = request.cond.reference_codes
    state = None if ref is None else runtime.priming.state(ref)
    runtime.running.enter()
    try:
        return SpeechStream(
            source,
            runtime.vocoder,
            schedule or ChunkSchedule(),
            request.seed,
            time.perf_counter() if started is None else started,
            state,
            request.live,
            request.speed,
            on_close=runtime.running.leave,
        )
    except BaseException:  # e.g. no thread could be started: what was taken for it is given back
        runtime.running.leave()
        source.release()
        raise
