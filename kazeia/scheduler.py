"""Continuous batching: many streams generated together, each exactly as it would be alone.

A `Scheduler` owns the frame steps of a runtime's streams (`Engine.scheduler(max_batch=...)`); each
stream keeps its own thread, frame loop, vocoder state and chunk queue. At every frame boundary the
scheduler's thread runs the waiting prefills (joining streams: prompt and first frame; several side
by side), then one frame step (kazeia/frame.py) for every admitted stream whose next step waits. A
stream waiting for live text or for its consumer has no step waiting: the others go on without it.
A stream arriving during a step builds its prompt and runs its prefill at the step's next pause
(`_let_prompts_in`), the step's rows waiting untouched. Admission is first come, first served
(kazeia/admission.py); a cancelled stream leaves the queue at once, or its pending step is dropped
at the next frame boundary (generate.StepCancelled).

Generation is paced to the vocoders: a stream is stepped while its vocoder is short of frames
(SpeechStream.needs_frames); while none is, the steps wait, so streams leave the batched steps
together rather than long before their audio is out. The streams' vocoders take turns
(kazeia/lanes.py), generation's own cores decoding too while it waits. How many decodes and prompts
run at once, and on which threads, is kazeia/placement.py's; measured effects: docs/design.md.
Batch invariance (frame.py) makes every stream's codes and audio independent of which others share
its steps and of the turns. Non-goals: priorities between requests; batching prompts.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from functools import partial

import torch

from . import cpu, generate
from .admission import Admission, SchedulerBusy, SchedulerClosed, Ticket
from .frame import Decoding
from .generate import StepCancelled
from .lanes import VocoderLanes
from .options import StreamOptions, SynthesisOptions, with_overrides
from .prompt import Prompt
from .request import Request, build_request
from .runtime import Runtime
from .sampling import SamplingOptions
from .segment import Segment
from .streaming import SpeechStream, open_stream
from .utterance import timeline

log = logging.getLogger(__name__)
GRACE_S = 0.005  # how long a step waits for a stream of the previous step that has not resubmitted yet
# how long a step waits, after streams' own work (their prompts), for a prefill to follow: Python
# hands the interpreter between threads every 5 ms (sys.getswitchinterval), so a stream that has
# just built its prompt may take longer than GRACE_S to submit it, and would wait a whole step
PROMPT_GRACE_S = 0.02
PACE_POLL_S = 0.005  # how often waiting steps look whether a stream's vocoder now needs frames


@dataclass(frozen=True)
class SchedulerStats:
    """What the scheduler has done so far."""

    steps: int  # batched steps run
    prefills: int  # prompts run (a stream's segments each have one)
    batch_sizes: dict[int, int]  # streams in a step -> how many steps had that many
    active: int  # streams admitted now
    waiting: int  # streams queued now
    queue_waits_s: tuple[float, ...]  # seconds from `stream` to admission, the latest streams

    @property
    def mean_batch(self) -> float:
        return sum(k * v for k, v in self.batch_sizes.items()) / self.steps if self.steps else 0.0


class _Work:
    """One step a stream waits for: its prefill or its next frame."""

    def __init__(self, owner: Ticket, prefill: tuple | None = None, decode: tuple | None = None):
        self.owner, self.prefill, self.decode = owner, prefill, decode
        self.done = threading.Event()
        self.result = None
        self.error: BaseException | None = None

    def finish(self, result=None, error: BaseException | None = None) -> None:
        self.result, self.error = result, error
        self.done.set()


class _ScheduledSteps(generate.Steps):
    """generate.Steps that hand each step to the scheduler's thread and wait for it."""

    def __init__(self, scheduler: Scheduler, ticket: Ticket):
        self.scheduler, self.ticket = scheduler, ticket

    def prefill(self, prompt: Prompt, opts: SamplingOptions, generator: torch.Generator | None):
        return self.scheduler._wait(_Work(self.ticket, prefill=(prompt, opts, generator)))

    def decode(self, state: Decoding, text: torch.Tensor) -> torch.Tensor | None:
        return self.scheduler._wait(_Work(self.ticket, decode=(state, text)))

    def exclusive(self) -> AbstractContextManager:
        return self.scheduler._exclusive()


class Scheduled:
    """The frames of a stream generated in a scheduler's steps (a streaming.FrameSource): queued
    when made (`Scheduler.source`), admitted when its frames are first asked for, its place given
    back when they end."""

    def __init__(self, scheduler: Scheduler, ticket: Ticket, request: Request, should_stop):
        self.scheduler, self.ticket, self.request, self.should_stop = scheduler, ticket, request, should_stop
        self.lanes = scheduler.lanes

    def frames(self, stop: Callable[[], bool]) -> Iterator[torch.Tensor | Segment]:
        should_stop = self.should_stop
        self.ticket.should_stop = stop if should_stop is None else (lambda: stop() or should_stop())
        return self.scheduler._admitted(self.ticket, self.request)

    def pace(self, needs_frames: Callable[[], bool], chunk_far: Callable[[], bool]) -> None:
        self.ticket.needs_frames, self.ticket.chunk_far = needs_frames, chunk_far

    def release(self) -> None:
        self.scheduler.admission.release(self.ticket)


class Scheduler:
    """Generates the streams of one runtime together (module docstring). Use it in a `with` block
    or call `close()`; `stream` takes `Engine.stream`'s arguments and returns its kind of stream."""

    def __init__(
        self,
        runtime: Runtime,
        max_batch: int = 4,
        max_queue: int = 16,
        on_step: Callable[[int], None] | None = None,
        vocoder_lanes: int | None = None,
        spare_lanes: int | None = None,
        prompts_at_once: int | None = None,
    ):
        """`on_step(size)`: called after each batched step with its number of streams (metrics).
        `vocoder_lanes`: decodes of its streams at once (`VocoderLanes`); `spare_lanes`: decodes
        that may run, besides, on generation's own cores while it has nothing to run (0: none);
        `prompts_at_once`: how many prompts that wait at one frame boundary run side by side
        (`_prefills_held`; 1: one after the other). None: kazeia/placement.py's default."""
        placement, step = runtime.placement, runtime.step
        self.admission = Admission(max_batch, max_queue, step.max_batch)
        self.lanes = VocoderLanes(placement.vocoder_lanes(vocoder_lanes), placement.spare_lanes(spare_lanes))
        self.runtime, self.step = runtime, step
        self.on_step = on_step
        self._lock = threading.Condition()
        self._model_lock = threading.Lock()  # held by whoever runs the model (generate.Steps.exclusive)
        self._urgent = 0  # streams waiting for the model, or holding it, for their own work (`_exclusive`)
        self._pending: list[_Work] = []
        self._closed = False
        self._steps = self._prefills = 0
        self._sizes: Counter[int] = Counter()
        self._side_by_side = placement.prompts_at_once(prompts_at_once)
        self._helpers = ThreadPoolExecutor(self._side_by_side - 1, "kazeia-prompt") if self._side_by_side > 1 else None
        self._prompting = 0  # prompts running now
        self._together = 1  # prompts this frame boundary runs side by side (`_prefills_held`)
        self._thread = threading.Thread(target=self._run, name="kazeia-scheduler", daemon=True)
        self._thread.start()

    # -- streams ------------------------------------------------------------------------------
    def stream(
        self,
        text,
        options: SynthesisOptions | None = None,
        *,
        should_stop: Callable[[], bool] | None = None,
        **overrides,
    ) -> SpeechStream:
        """`Engine.stream(text, options, **overrides)` with its steps run by this scheduler. Raises
        SchedulerBusy when `max_queue` streams are already waiting for admission. Streams that
        share the CPU often fall behind their generation: `max_chunk_frames` (e.g. 16) lets them
        catch up (options.ChunkSchedule)."""
        started = time.perf_counter()
        chosen = with_overrides(StreamOptions, options, overrides)
        request = build_request(self.runtime.caps, text, chosen)
        schedule = chosen.schedule
        return open_stream(self.runtime, request, self.source(request, should_stop), schedule, started)

    def source(self, request: Request, should_stop: Callable[[], bool] | None = None) -> Scheduled:
        """The frames of `request` through this scheduler, for a SpeechStream. The stream is queued
        now (SchedulerBusy when the queue is full); its frames wait for admission when they are
        first asked for. `should_stop`: as `Engine.stream`'s."""
        return Scheduled(self, self.admission.enqueue(), request, should_stop)

    def _admitted(self, ticket: Ticket, request: Request) -> Iterator[torch.Tensor | Segment]:
        try:
            if not self.admission.admit(ticket):
                return
            yield from timeline(self.runtime, request, ticket.should_stop, _ScheduledSteps(self, ticket))
        finally:
            self.admission.release(ticket)

    @property
    def stats(self) -> SchedulerStats:
        admission = self.admission
        with self._lock:
            return SchedulerStats(
                self._steps, self._prefills, dict(self._sizes), admission.active, admission.waiting,
                tuple(admission.waits),
            )  # fmt: skip

    def close(self) -> None:
        """Stop taking streams, fail the steps of those still running (SchedulerClosed), end the thread."""
        self.admission.close()
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join()
        if self._helpers is not None:
            self._helpers.shutdown(wait=False)  # idle: the scheduler's thread waits for its prompts

    def __enter__(self) -> Scheduler:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- steps --------------------------------------------------------------------------------
    def _wait(self, work: _Work):
        with self._lock:
            if self._closed:
                raise SchedulerClosed("the scheduler is closed")
            self._pending.append(work)
            self._lock.notify_all()
        work.done.wait()
        if work.error is not None:
            raise work.error
        return work.result

    @contextmanager
    def _exclusive(self) -> Iterator[None]:
        """The model for a stream's own work (its prompt, live text's embeddings): before the next
        step, or at the running step's next pause (`_let_prompts_in`), so that a joining stream's
        prefill runs there rather than one step later. On the team a lone prompt would take."""
        with self._lock:
            self._urgent += 1
        team = self.runtime.placement.scheduled_prompt_team(self.lanes.decoding, 1, lambda: 1)
        try:
            with self._model_lock, cpu.on(team):
                yield
        finally:
            with self._lock:
                self._urgent -= 1
                self._lock.notify_all()

    def _run(self) -> None:
        previous: set[Ticket] = set()  # the streams that got a frame from the last step
        while True:
            with self._lock:
                self._idle(lambda: bool(self._pending) or self._closed, poll=None)  # submissions notify
                if self._closed:
                    for work in self._pending:
                        work.finish(error=SchedulerClosed("the scheduler was closed"))
                    self._pending = []
                    return
                self._lock.wait_for(partial(self._resubmitted, previous), GRACE_S)
                if self._urgent:  # a stream's own work goes first (`_exclusive`), then its prefill may follow
                    self._after_own_work()
                self._idle(self._due, poll=PACE_POLL_S)  # a stream's need of frames changes without a notice
                prefills = [w for w in self._pending if w.prefill is not None]
                decodes = [w for w in self._pending if w.decode is not None]
                self._pending = []
                self.lanes.generating(True)
            if prefills:
                with self._model_lock:
                    self._prefills_held(prefills)
            previous = self._decode(decodes) if decodes else set()

    def _idle(self, until: Callable[[], bool], poll: float | None) -> None:
        """Wait (holding the lock) until `until()`, the spare lanes decoding meanwhile; looking
        again at each notice, and every `poll` seconds when given."""
        if until():
            return
        self.lanes.generating(False)
        while not until():
            self._lock.wait(poll)

    def _due(self) -> bool:
        """Is the waiting work to run now? A prefill always is (a stream waits for its first audio);
        steps when a stream's vocoder is short of frames (SpeechStream.needs_frames), or one was
        cancelled (its step is dropped at once). Otherwise generation waits and its cores decode."""
        if self._closed:
            return True
        return any(w.prefill is not None or w.owner.should_stop() or w.owner.needs_frames() for w in self._pending)

    def _resubmitted(self, previous: set[Ticket]) -> bool:
        """Has every stream of the last step submitted its next one (or the scheduler closed)?"""
        return self._closed or not previous - {w.owner for w in self._pending}

    def _after_own_work(self) -> None:
        """Wait (holding the lock) for the streams' own work on the model to end, then up to
        PROMPT_GRACE_S for the prefill it may submit."""
        self._lock.wait_for(lambda: not self._urgent or self._closed)
        self._lock.wait_for(self._prefill_waiting, PROMPT_GRACE_S)

    def _prefill_waiting(self) -> bool:
        return self._closed or any(w.prefill is not None for w in self._pending)

    def _let_prompts_in(self) -> None:
        """A step's pause (FrameStep.decode; this thread holds the model): a stream's own work
        that waits for the model (its prompt being built: `_exclusive`) goes now, then the prompts
        waiting run, and the step goes on. A stream that joins during a step so starts within a
        stage of it (at most a few ms) rather than at its end; the step's rows wait untouched."""
        with self._lock:
            if self._closed or not (self._urgent or self._prefill_waiting()):
                return
            urgent = bool(self._urgent)
        if urgent:
            self._model_lock.release()
            try:
                with self._lock:
                    self._after_own_work()
            finally:
                self._model_lock.acquire()
        with self._lock:
            prefills = [w for w in self._pending if w.prefill is not None]
            self._pending = [w for w in self._pending if w.prefill is None]
        if prefills:
            self._prefills_held(prefills)

    def _prefills_held(self, prefills: list[_Work]) -> None:
        """Prompts, the caller holding the model: one at a time on the prompt team, or, where
        several wait and the team holds several stages' threads, that many side by side (the
        scheduler's thread and its helpers each taking the next), each on a share of the team
        (placement.scheduled_prompt_team). A prompt's threads never change its results."""
        width = self._together = min(len(prefills), self._side_by_side)
        waiting = deque(prefills)

        def take() -> None:
            while True:
                try:
                    work = waiting.popleft()  # atomic: each prompt is taken once
                except IndexError:
                    return
                self._prefill(work)

        # no helper (one prompt, or prompts_at_once=1): this thread takes them all, in order
        helping = [self._helpers.submit(take) for _ in range(width - 1)] if self._helpers else []
        take()
        for future in helping:
            future.result()

    def _prefill(self, work: _Work) -> None:
        """One prompt (`_prefills_held`: the caller holds the model)."""
        if work.owner.should_stop():
            work.finish(error=StepCancelled())
            return
        with self._lock:
            self._prompting += 1
        try:
            prompt, opts, generator = work.prefill  # type: ignore[misc]
            prompting = lambda: self._prompting  # noqa: E731
            team = self.runtime.placement.scheduled_prompt_team(self.lanes.decoding, self._together, prompting)
            work.finish(self.step.prefill(prompt, opts, generator, team))
        except BaseException as error:  # the stream's thread raises it
            work.finish(error=error)
        with self._lock:
            self._prompting -= 1
            self._prefills += 1

    def _decode(self, decodes: list[_Work]) -> set[Ticket]:
        """One batched step for the waiting streams; the set of those that got a frame."""
        going = []
        for work in decodes:
            if work.owner.should_stop():
                work.finish(error=StepCancelled())
            else:
                going.append(work)
        if not going:
            return set()
        try:
            with self._model_lock:
                states, texts = [w.decode[0] for w in going], [w.decode[1] for w in going]  # type: ignore[index]
                far = [w.owner.chunk_far for w in going]  # decode_team; others: a prompt, a stream not stepped
                others = lambda: self._prompting > 0 or self.runtime.running.count() > len(far)  # noqa: E731
                team = self.runtime.placement.decode_team(self.runtime.decoding, others, far)
                results = self.step.decode(states, texts, self._let_prompts_in, team)
        except BaseException as error:
            for work in going:
                work.finish(error=error)
            return set()
        with self._lock:
            self._steps += 1
            self._sizes[len(going)] += 1
        if self.on_step is not None:
            try:
                self.on_step(len(going))
            except Exception:  # a metrics callback must not stop every stream's steps
                log.exception("kazeia: the scheduler's on_step callback failed")
        for work, codes in zip(going, results, strict=True):
            work.finish(codes)
        return {w.owner for w, codes in zip(going, results, strict=True) if codes is not None}


__all__ = ["Scheduler", "SchedulerBusy", "SchedulerClosed", "SchedulerStats"]
