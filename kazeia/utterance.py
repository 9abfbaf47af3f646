"""An utterance: a request's frames, segment after segment.

`timeline` yields a request's frames and, after each segment's last frame, its `Segment`: each
segment's prompt (kazeia/prompt.py), seed and runaway guard, live text's prompt and trailing text
track, an in-context reference carried from one segment to the next. `Unscheduled` is the
`FrameSource` of a stream outside any scheduler: its frames generated in the stream's own thread,
each step at once (a scheduler's are batched with other streams: kazeia/scheduler.py). Everything
takes a Runtime. Non-goals: the frame step (kazeia/frame.py), chunking and decoding
(kazeia/streaming.py).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator
from dataclasses import replace

import torch

from . import generate
from .live import LivePart, LiveParts
from .prompt import Conditioning, Prompt, build_prompt, needs_whole_text
from .request import Request, bounded
from .runaway import CANCELLED, RunawayGuard
from .runtime import Runtime
from .segment import TEMPLATE_IDS, Part, Segment
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
    while the engine runs nothing else). Counted in `runtime.running` while it runs, except with
    `steps` (a scheduler's): its stream counts it (`streaming.open_stream`)."""
    if steps is not None:
        yield from _segments(runtime, request, should_stop, steps, steps)
        return
    runtime.running.enter()
    try:
        yield from _unscheduled(runtime, request, should_stop)
    finally:
        runtime.running.leave()


def _unscheduled(
    runtime: Runtime,
    request: Request,
    should_stop: Callable[[], bool] | None,
    chunk_far: Callable[[], bool] = lambda: True,
) -> Iterator[torch.Tensor | Segment]:
    """`_segments` with each step at once, the first prompt on the placement's team while the
    runtime counts this request alone, a frame step too while nothing decodes and its stream's
    next chunk still needs a frame (`chunk_far`: always without a stream)."""
    placement, running = runtime.placement, runtime.running
    steps = placement.decode_team(runtime.decoding, lambda: running.count() > 1, [chunk_far])
    first = generate.CallerSteps(runtime.step, placement.first_prompt_team(running), steps)
    return _segments(runtime, request, should_stop, first, generate.CallerSteps(runtime.step, decode_team=steps))


def _segments(
    runtime: Runtime,
    request: Request,
    should_stop: Callable[[], bool] | None,
    first: generate.Steps,
    steps: generate.Steps,
) -> Iterator[torch.Tensor | Segment]:
    """`timeline`, the first segment's steps `first`, the others' `steps`. A whole text's parts are
    planned (request.parts); a live text's come as it arrives (live.LiveParts): the same parts."""
    rate, per_frame = runtime.vocoder.cfg.sample_rate, runtime.vocoder.cfg.samples_per_frame
    start, previous = 0, None
    parts = request.parts if request.live is None else _live_parts(request, should_stop)
    for index, part in enumerate(parts):
        made: list[torch.Tensor] = []
        budget = part.budget_at if isinstance(part, LivePart) else part.budget if part else None
        guard = RunawayGuard(budget, request.long_text.loop_frames) if part and request.guarded else None
        cond = _continued(request, previous)
        runs = first if index == 0 else steps
        prompt = None if part is None else _prompt(runtime, request, part, cond, runs)
        reason = CANCELLED  # stopped while waiting for live text
        if part is not None and prompt is not None:
            generator = torch.Generator(device=runtime.device).manual_seed(part.seed)
            frames = generate.frames(prompt, request.sampling, generator, runs, should_stop, guard)
            reason = yield from _kept(frames, made)
        if isinstance(part, LivePart) and reason != CANCELLED:
            part.wait_final()  # its text, and where the next part starts
        end = start + len(made) * per_frame
        yield Segment(index, part.text if part is not None else "", start, end, reason, rate)
        if reason == CANCELLED:
            return
        looped = guard is not None and guard.looped
        start, previous = end, (None if looped else part, made)


def _live_parts(request: Request, should_stop: Callable[[], bool] | None) -> Iterator[LivePart | None]:
    """A live text's parts as they begin; None once when stopped while waiting for one."""
    live = request.live
    assert live is not None
    live.should_stop = should_stop
    options = request.sampling
    parts = LiveParts(live, request.long_text, request.seed, options.max_new_tokens, request.guarded)
    index = 0
    while (part := parts.part(index)) is not None:
        yield part
        index += 1
    if should_stop is not None and should_stop():
        yield None


def _prompt(
    runtime: Runtime, request: Request, part: Part | LivePart, cond: Conditioning, steps: generate.Steps
) -> Prompt | None:
    """A part's prompt: all of its text for the layouts that need it whole (a live part's waited
    for, its positions checked then), else its first token, a live part's trailing text track read
    as it arrives; None if stopped while waiting."""
    layout = request.non_streaming_mode
    live = isinstance(part, LivePart) and not needs_whole_text(cond, layout)
    if isinstance(part, Part):
        ids = part.text_ids
    elif not live:
        if not part.wait_final():
            return None
        ids = part.text_ids
        bounded(runtime.caps, replace(request, cond=cond), len(ids) - TEMPLATE_IDS)
    else:
        ids = tuple(runtime.tokenizer.wrap_assistant(part.parts.ids(part.index)[:1]))
    with steps.exclusive():
        prompt = build_prompt(runtime.model, ids, cond, layout)
    if live:  # the trailing text track, one token per frame as it arrives

        def embed(token: int) -> torch.Tensor:
            with steps.exclusive():
                return runtime.model.talker.embed_text(torch.tensor([[token]], device=runtime.device))

        prompt.text_source = part.trailing(embed, prompt.eos, prompt.pad)  # type: ignore[union-attr]
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
    context = Voice(voice.x_vector, torch.stack(made), part.text, voice.model)  # its frames: (n, 16) codes
    return replace(request.cond, voice=context, ref_text_ids=part.text_ids[ROLE_IDS:-CLOSING_IDS])


class Unscheduled:
    """The frames of a stream generated in its own thread, each step at once (a `FrameSource`)."""

    lanes = None

    def __init__(self, runtime: Runtime, request: Request, should_stop: Callable[[], bool] | None = None):
        self.runtime, self.request, self.should_stop = runtime, request, should_stop
        self.chunk_far: Callable[[], bool] = lambda: True

    def frames(self, stop: Callable[[], bool]) -> Iterator[torch.Tensor | Segment]:
        """`timeline`'s, counted in `runtime.running` once, by the stream (`streaming.open_stream`)."""
        either = stop if self.should_stop is None else (lambda: stop() or self.should_stop())  # type: ignore[misc]
        return _unscheduled(self.runtime, self.request, either, lambda: self.chunk_far())

    def pace(self, needs_frames: Callable[[], bool], chunk_far: Callable[[], bool]) -> None:
        """Unpaced: the stream's queue bounds how far generation runs ahead. `chunk_far`: whether
        a step may take the vocoder's core (`_unscheduled`)."""
        self.chunk_far = chunk_far

    def release(self) -> None:
        """Nothing was taken before the stream started."""
