"""The frame loop: `frames()` yields a request's frames one at a time, from its prompt to its end.

It is the only generation loop; offline synthesis, streaming, batched serving and every front end
consume it. Its steps (the prefill, then one frame step after another: kazeia/frame.py) are run by a
`Steps`: `CallerSteps` runs them at once in the caller's thread, a scheduler's batch them with
other requests' in its own thread (kazeia/scheduler.py). Generation ends when the talker samples EOS or
reaches `max_new_tokens` (frame.py), when the runaway guard stops it, or when the text source or
`should_stop` says so; `frames()` returns which (its finish reason, kazeia/runaway.py).
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable, Generator

import torch

from . import cpu
from .frame import Decoding, FrameStep
from .prompt import Prompt
from .runaway import CANCELLED, EOS, GUARD, LENGTH, RunawayGuard
from .sampling import SamplingOptions


class StepCancelled(Exception):
    """Raised by a `Steps` whose request was cancelled while its step waited (ends `frames`)."""


class Steps(abc.ABC):
    """Who runs one request's steps. `exclusive()` holds the model for the request's own work
    between steps (its prompt, live text's embeddings) where others may be running it, on the
    threads its prefill would take then (the prompt's text projection is on first audio's path)."""

    @abc.abstractmethod
    def prefill(
        self, prompt: Prompt, opts: SamplingOptions, generator: torch.Generator | None
    ) -> tuple[Decoding, torch.Tensor | None]:
        """The prompt's prefill and first frame (`FrameStep.prefill`)."""

    @abc.abstractmethod
    def decode(self, state: Decoding, text: torch.Tensor) -> torch.Tensor | None:
        """The request's next frame (`FrameStep.decode`)."""

    def exclusive(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


class CallerSteps(Steps):
    """Each step at once, in the caller's thread, on the frame step alone (B = 1). `team()`: the
    threads of the prefill, asked when it starts; `decode_team`: those of each frame step
    (kazeia/placement.py; None: torch's)."""

    def __init__(
        self,
        step: FrameStep,
        team: Callable[[], cpu.Team | None] = lambda: None,
        decode_team: cpu.Team | None = None,
    ):
        self.step, self.team, self.decode_team = step, team, decode_team

    def prefill(self, prompt: Prompt, opts: SamplingOptions, generator: torch.Generator | None):
        return self.step.prefill(prompt, opts, generator, self.team())

    def decode(self, state: Decoding, text: torch.Tensor) -> torch.Tensor | None:
        return self.step.decode([state], [text], team=self.decode_team)[0]

    def exclusive(self) -> contextlib.AbstractContextManager:
        return cpu.on(self.team())


@torch.inference_mode()
def frames(
    prompt: Prompt,
    opts: SamplingOptions,
    generator: torch.Generator | None,
    steps: Steps,
    should_stop: Callable[[], bool] | None = None,
    guard: RunawayGuard | None = None,
) -> Generator[torch.Tensor, None, str]:
    """Yield one (16,) int64 code frame at a time until EOS, `max_new_tokens`, the `guard`, the end
    of a live text source or `should_stop()` (polled before each frame's work); return the finish
    reason. `steps` runs the prefill and each frame step."""
    if should_stop is not None and should_stop():
        return CANCELLED
    try:
        state, codes = steps.prefill(prompt, opts, generator)
        while codes is not None:
            yield codes[0]
            if guard is not None and guard.stops(int(codes[0, 0])):
                return GUARD
            text = prompt.text_at(state.frames - 1)  # live text may wait here for the next token
            if text is None or (should_stop is not None and should_stop()):
                return CANCELLED
            codes = steps.decode(state, text)
    except StepCancelled:
        return CANCELLED
    return LENGTH if state.at_limit else EOS
