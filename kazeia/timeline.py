"""A request's frames, segment after segment (`Engine.timeline`): each segment's prompt, its seed
and its guard, live text's prompt and trailing text track, and the `Segment` after its last frame.

Also who runs a first segment's prefill outside a scheduler (`FirstPrefill`, counting the engine's
work with `Running`): on every core of the two stages while nothing else is open (docs/design.md,
"Generation beside the vocoder"). Tensors and control flow only; the engine owns the model.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Generator, Iterator
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from . import generate
from .live import live_trailing
from .model import TTSModel
from .prompt import CLOSING_IDS, ROLE_IDS, Conditioning, Prompt, build_prompt, needs_whole_text
from .request import Part, Request, bounded
from .runaway import CANCELLED, Guard
from .sampling import SamplingOptions
from .streaming import Segment
from .voices import Voice

if TYPE_CHECKING:
    from .engine import Engine


def segments(
    engine: Engine,
    request: Request,
    should_stop: Callable[[], bool] | None,
    first: generate.Steps,
    steps: generate.Steps,
) -> Iterator[torch.Tensor | Segment]:
    """`Engine.timeline` (its docstring) with the first segment's steps `first`, the others' `steps`."""
    rate, per_frame = engine.vocoder.cfg.sample_rate, engine.vocoder.cfg.samples_per_frame
    start, previous = 0, None
    for index, part in enumerate(request.parts or (None,)):
        made: list[torch.Tensor] = []
        guard = None
        if index == 1:
            first = steps
        if part is None:  # live text: one segment, as long as max_new_tokens allows
            reason = yield from _kept(_live_frames(engine, request, should_stop, first), made)
            text = request.live.text if request.live is not None else ""
        else:
            cond = _continued(request, previous)
            with steps.exclusive():
                prompt = build_prompt(engine.model, part.text_ids, cond, request.non_streaming_mode)
            generator = torch.Generator(device=engine.device).manual_seed(part.seed)
            guard = Guard(part.budget, request.long_text.loop_frames) if request.guarded else None
            frames = generate.frames(engine.model, prompt, request.options, generator, should_stop, guard, first)
            reason, text = (yield from _kept(frames, made)), part.text
        end = start + len(made) * per_frame
        yield Segment(index, text, start, end, reason, rate)
        if reason == CANCELLED:
            return
        looped = guard is not None and guard.looped
        start, previous = end, (None if looped else part, made)


def _live_frames(
    engine: Engine, request: Request, should_stop: Callable[[], bool] | None, steps: generate.Steps
) -> Generator[torch.Tensor, None, str]:
    prompt = _live_prompt(engine, request, should_stop, steps)
    if prompt is None:  # stopped while waiting for live text
        return CANCELLED
    generator = torch.Generator(device=engine.device).manual_seed(request.seed)
    return (yield from generate.frames(engine.model, prompt, request.options, generator, should_stop, None, steps))


def _live_prompt(
    engine: Engine, request: Request, should_stop: Callable[[], bool] | None, steps: generate.Steps
) -> Prompt | None:
    live = request.live
    assert live is not None
    live.should_stop = should_stop
    whole = needs_whole_text(request.cond, request.non_streaming_mode)
    if not live.start() or not (live.wait_for_end() if whole else live.need(1)):
        return None
    if whole:  # all of the text goes into the prompt: it must fit the model's positions too
        bounded(engine.rules, request, len(live.ids))
    ids = engine.tokenizer.wrap_assistant(live.ids if whole else live.ids[:1])
    with steps.exclusive():
        prompt = build_prompt(engine.model, ids, request.cond, request.non_streaming_mode)
    if not whole:  # the trailing text track, one token per frame as it arrives

        def embed(token: int) -> torch.Tensor:
            with steps.exclusive():
                return engine.model.talker.embed_text(torch.tensor([[token]], device=engine.device))

        prompt.text_source = live_trailing(live, embed, prompt.eos, prompt.pad)
    return prompt


class Running:
    """How many timelines and open streams an engine has (a scheduler's stream counts as both):
    `enter` counts one in, `leave` one out."""

    def __init__(self) -> None:
        self._lock, self._count = threading.Lock(), 0

    def enter(self) -> None:
        with self._lock:
            self._count += 1

    def leave(self) -> None:
        with self._lock:
            self._count -= 1

    def count(self) -> int:
        with self._lock:
            return self._count


class FirstPrefill(generate.Steps):
    """The steps of a request's first segment outside a scheduler: its prefill on every core of the
    two stages (`prompt_threads`, a `cpu.team`) if, when it runs, the engine has nothing open or
    running but this request (live text may wait long for its first words); else on torch's."""

    def __init__(self, running: Running, prompt_threads: int, openmp: bool):
        super().__init__(prompt_threads, openmp)
        self.running = running

    def prefill(self, model: TTSModel, prompt: Prompt, opts: SamplingOptions, generator: torch.Generator | None):
        threads = self.prompt_threads if self.running.count() == 1 else None
        return generate.prefill(model, prompt, opts, generator, threads, self.openmp)


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
