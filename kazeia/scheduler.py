"""Continuous batching: many streams generated together, each exactly as it would be alone.

A `Scheduler` owns the frame steps of an engine's streams (`engine.scheduler(max_batch=...)`). Each
stream keeps its own thread, frame generator, vocoder state and chunk queue (SpeechStream); only
its steps go elsewhere: to the scheduler's thread, which at every frame boundary runs the waiting
prefills (joining requests: each its prompt and its first frame; several side by side, below) and
then one batched step (kazeia/batch.py) for every active stream whose next step is waiting. All
waiting prompts go first: a joining stream has no audio yet, a running one has its buffer (with 4
clients arriving together, first audio at p95 came ~25 % sooner than with one prompt a boundary, at
the same throughput: BENCHMARKS.md). A prompt runs on the engine's prompt team (every core) while
no stream's audio is being decoded and no other prompt runs, else on generation's threads. A stream
waiting for live text, or for its consumer to take audio, simply has no step waiting: the others go
on without it. A stream that arrives while a step runs does not wait for its end: the step pauses
between its stages (after the talker, after each of the predictor's 15 steps: a few ms each) for
the stream to build its prompt and run its prefill, then goes on (`_let_prompts_in`); its rows
wait untouched, so no result changes. With 4 int8 clients on 2 cores that brought the median first
audio from 0.36-0.39 to 0.27-0.29 s (bfloat16 vocoder; BENCHMARKS.md), at the same throughput.
A stream that ends (EOS, its limits, cancellation) stops submitting; nothing else changes.

Admission is first come, first served: at most `max_batch` streams are admitted at once, at most
`max_queue` more wait (`stream` raises `SchedulerBusy` beyond that), and a stream waits for its
turn in its own thread. A cancelled stream leaves the queue at once, or its pending step is
dropped at the next frame boundary (generate.StepCancelled), so cancellation takes effect within a
frame. Batch invariance (batch.py) makes every stream's codes and audio independent of which
others share its steps, when they join and when they leave.

The streams' vocoders take turns (`VocoderLanes`): on few cores, every stream decoding at once
would take the CPU from the scheduler's thread, the one all of them wait for. At most `lanes`
decodes run at once (by default as many as fit beside generation's threads: one where each stage
has half the cores, as `Engine.load` sets by default); a stream's first chunk goes before any
other (its listener hears nothing yet), then the chunk whose stream has the least audio ahead of
its listener. Decodes pause: between its ~20 stages (`Vocoder.decode_chunk`'s `pause`) a chunk
that is not a first one hands its lane to a first chunk that waits, so a joining stream does not
wait for another's whole chunk (~0.24 s for 4 frames on one Zen 4 core). A prompt takes the cores
no decode holds, product by product where the products are Kazeia's own (int8, int4). (Pausing
the decodes for prompts as well gave first audio ~25 % sooner at the median but ~8 % less
throughput: the vocoder is the slower stage at 4 streams on 2 cores.) The turns change when audio
is made, never which: each stream's chunks and audio are those it would have alone.

Generation is paced to the vocoders. A stream is stepped while its vocoder is short of frames
(fewer made and not yet decoding than its next two chunks take: SpeechStream.needs_frames); while
no waiting stream is, the steps wait (a prefill or a cancelled stream's step never does), and then
all waiting streams step together. Unpaced, generation ran ahead of the slower vocoder and each
stream left the batched steps long before its audio was out (with 4 clients on 2 cores, ~20 % of
each request's time), so the steps were smaller and cost more a frame. While generation waits, its
own cores decode as well: a spare lane (`VocoderLanes`'s `spare`) takes a chunk only then, and its
decode (unless a first chunk's) stops at its next pause point while a step or a prompt runs, or
moves to a lane that frees.

Prompts that wait at the same frame boundary run side by side (`prompts_at_once`, by default as
many as the prompt team holds stages' threads: two where each stage has half the cores), each on
its share of the cores: a prompt's glue between products and its first frame run on one thread, so
one prompt on two threads was only ~1.4x as fast as on one, and two side by side finished ~30 %
sooner than one after the other.

Non-goals: priorities between requests, and batching prompts (each prefill is its own, between
steps).
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
from typing import TYPE_CHECKING

import torch

from . import cpu, generate
from .batch import Batch
from .generate import Decoding, StepCancelled
from .lanes import VocoderLanes
from .model import TTSModel
from .prompt import Prompt
from .request import Request
from .sampling import SamplingOptions

if TYPE_CHECKING:
    from .engine import Engine
    from .streaming import Segment, SpeechStream

log = logging.getLogger(__name__)
GRACE_S = 0.005  # how long a step waits for a stream of the previous step that has not resubmitted yet
# how long a step waits, after streams' own work (their prompts), for a prefill to follow: Python
# hands the interpreter between threads every 5 ms (sys.getswitchinterval), so a stream that has
# just built its prompt may take longer than GRACE_S to submit it, and would wait a whole step
PROMPT_GRACE_S = 0.02
PACE_POLL_S = 0.005  # how often waiting steps look whether a stream's vocoder now needs frames
RECENT = 1024  # queue waits kept for the statistics


class SchedulerBusy(Exception):
    """The scheduler's queue is full."""


class SchedulerClosed(RuntimeError):
    """The scheduler was closed; it takes no more streams and ends those it runs."""


@dataclass(frozen=True)
class SchedulerStats:
    """What the scheduler has done so far."""

    steps: int  # batched steps run
    prefills: int  # prompts run (a stream's segments each have one)
    batch_sizes: dict[int, int]  # streams in a step -> how many steps had that many
    active: int  # streams admitted now
    waiting: int  # streams queued now
    queue_waits_s: tuple[float, ...]  # seconds from `stream` to admission, the RECENT latest streams

    @property
    def mean_batch(self) -> float:
        return sum(k * v for k, v in self.batch_sizes.items()) / self.steps if self.steps else 0.0


class _Work:
    """One step a stream waits for: its prefill or its next frame."""

    def __init__(self, owner: _Ticket, prefill: tuple | None = None, decode: tuple | None = None):
        self.owner, self.prefill, self.decode = owner, prefill, decode
        self.done = threading.Event()
        self.result = None
        self.error: BaseException | None = None

    def finish(self, result=None, error: BaseException | None = None) -> None:
        self.result, self.error = result, error
        self.done.set()


class _Ticket:
    """A stream's place: queued, then admitted, then released."""

    def __init__(self) -> None:
        self.should_stop: Callable[[], bool] = lambda: False  # set when its stream starts
        # whether its stream's vocoder is short of frames (SpeechStream.needs_frames), once it is made
        self.needs_frames: Callable[[], bool] = lambda: True
        self.queued_at = time.perf_counter()
        self.admitted = False


class _ScheduledSteps(generate.Steps):
    """generate.Steps that hand each step to the scheduler's thread and wait for it."""

    def __init__(self, scheduler: Scheduler, ticket: _Ticket):
        self.scheduler, self.ticket = scheduler, ticket

    def prefill(self, model: TTSModel, prompt: Prompt, opts: SamplingOptions, generator: torch.Generator | None):
        return self.scheduler._wait(_Work(self.ticket, prefill=(prompt, opts, generator)))

    def decode(self, model: TTSModel, state: Decoding, text: torch.Tensor) -> torch.Tensor | None:
        return self.scheduler._wait(_Work(self.ticket, decode=(state, text)))

    def exclusive(self) -> AbstractContextManager:
        return self.scheduler._exclusive()


class Scheduler:
    """Generates the streams of one engine together (module docstring). Use it in a `with` block or
    call `close()`; `stream` takes `Engine.stream`'s arguments and returns its kind of stream."""

    def __init__(
        self,
        engine: Engine,
        max_batch: int = 4,
        max_queue: int = 16,
        on_step: Callable[[int], None] | None = None,
        vocoder_lanes: int | None = None,
        spare_lanes: int = 1,
        prompts_at_once: int | None = None,
    ):
        """`on_step(size)`: called after each batched step with its number of streams (metrics).
        `vocoder_lanes`: decodes of its streams at once (`VocoderLanes`); None: as many as fit
        beside generation's threads (torch's thread count, which each decode also takes) on the
        cores this process may use, at least one: one where each stage has half the cores.
        `spare_lanes`: decodes that may run, besides, on generation's own cores while it has
        nothing to run (0: none). `prompts_at_once`: how many prompts that wait at one frame
        boundary run side by side (`_prefill_all`); None: as many as the engine's prompt team holds
        stages' threads (two where each stage has half the cores), 1: one after the other."""
        if vocoder_lanes is None:  # the cores that generation's threads leave, each decode taking as many
            threads = torch.get_num_threads()
            vocoder_lanes = max(1, (cpu.usable_cpus() - threads) // threads)
        self.lanes = VocoderLanes(vocoder_lanes, spare_lanes)
        batch = Batch(engine.model)
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or not 1 <= max_batch <= batch.max_batch:
            raise ValueError(f"max_batch must be an integer from 1 to {batch.max_batch}, got {max_batch!r}")
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 0:
            raise ValueError(f"max_queue must be an integer >= 0, got {max_queue!r}")
        self.engine, self.batch = engine, batch
        self.max_batch, self.max_queue, self.on_step = max_batch, max_queue, on_step
        self._lock = threading.Condition()
        self._model_lock = threading.Lock()  # held by whoever runs the model (generate.Steps.exclusive)
        self._urgent = 0  # streams waiting for the model, or holding it, for their own work (`_exclusive`)
        self._queue: deque[_Ticket] = deque()  # waiting for admission, first come first
        self._active = 0
        self._pending: list[_Work] = []
        self._closed = False
        self._steps = self._prefills = 0
        self._sizes: Counter[int] = Counter()
        self._waits: deque[float] = deque(maxlen=RECENT)
        if prompts_at_once is None:  # as many as the prompt team holds stages' threads
            team = engine.prompt_team
            prompts_at_once = 1 if team is None else max(1, team[0] // max(1, torch.get_num_threads()))
        elif isinstance(prompts_at_once, bool) or not isinstance(prompts_at_once, int) or prompts_at_once < 1:
            raise ValueError(f"prompts_at_once must be an integer >= 1 or None, got {prompts_at_once!r}")
        self._side_by_side = prompts_at_once
        self._helpers = ThreadPoolExecutor(self._side_by_side - 1, "kazeia-prompt") if self._side_by_side > 1 else None
        self._prompting = 0  # prompts running now
        self._together = 1  # prompts this frame boundary runs side by side (`_prefill_all`)
        self._thread = threading.Thread(target=self._run, name="kazeia-scheduler", daemon=True)
        self._thread.start()

    # -- streams ------------------------------------------------------------------------------
    def stream(self, text, **options) -> SpeechStream:
        """`Engine.stream(text, **options)` with its steps run by this scheduler. Raises
        SchedulerBusy when `max_queue` streams are already waiting for admission. Streams that
        share the CPU often fall behind their generation: `max_chunk_frames` (e.g. 16) lets them
        catch up (streaming.ChunkSchedule)."""
        return self.engine.stream(text, scheduler=self, **options)

    def source(
        self, request: Request, should_stop: Callable[[], bool] | None = None
    ) -> Callable[[Callable[[], bool]], Iterator[torch.Tensor | Segment]]:
        """For SpeechStream: `make_frames(stop)` giving `Engine.timeline(request)` through this
        scheduler. The stream is queued now (SchedulerBusy when the queue is full); its frames
        wait for admission when they are first asked for. `should_stop`: as `Engine.stream`'s.
        The returned callable's `release()` gives the place back when its stream could not be
        made (its frames are then never asked for; a queued ticket would hold the queue's head)."""
        ticket = self._enqueue()

        def make_frames(stop: Callable[[], bool]) -> Iterator[torch.Tensor | Segment]:
            ticket.should_stop = stop if should_stop is None else (lambda: stop() or should_stop())
            return self._admitted(ticket, request)

        make_frames.release = lambda: self._release(ticket)  # type: ignore[attr-defined]
        make_frames.pace = lambda needs_frames: setattr(ticket, "needs_frames", needs_frames)  # type: ignore[attr-defined]
        return make_frames

    def _admitted(self, ticket: _Ticket, request: Request) -> Iterator[torch.Tensor | Segment]:
        try:
            if not self._admit(ticket):
                return
            yield from self.engine.timeline(request, ticket.should_stop, _ScheduledSteps(self, ticket))
        finally:
            self._release(ticket)

    @property
    def stats(self) -> SchedulerStats:
        with self._lock:
            return SchedulerStats(
                self._steps, self._prefills, dict(self._sizes), self._active, len(self._queue), tuple(self._waits)
            )

    def close(self) -> None:
        """Stop taking streams, fail the steps of those still running (SchedulerClosed), end the thread."""
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

    # -- admission ----------------------------------------------------------------------------
    def _enqueue(self) -> _Ticket:
        with self._lock:
            if self._closed:
                raise SchedulerClosed("the scheduler is closed")
            if self._active + len(self._queue) >= self.max_batch + self.max_queue:
                raise SchedulerBusy(f"{len(self._queue)} streams are already waiting (max_queue={self.max_queue})")
            ticket = _Ticket()
            self._queue.append(ticket)
            return ticket

    def _admit(self, ticket: _Ticket) -> bool:
        """Wait until `ticket` is first in the queue and a place is free; False if it was stopped
        (or the scheduler closed) meanwhile."""
        with self._lock:
            while True:
                if self._closed or ticket.should_stop():
                    return False
                if self._queue[0] is ticket and self._active < self.max_batch:
                    self._queue.popleft()
                    self._active += 1
                    ticket.admitted = True
                    self._waits.append(time.perf_counter() - ticket.queued_at)
                    self._lock.notify_all()  # the next in line may be admitted too
                    return True
                self._lock.wait(0.05)  # polls the stop flag

    def _release(self, ticket: _Ticket) -> None:
        with self._lock:
            if ticket.admitted:
                self._active -= 1
                ticket.admitted = False
            elif ticket in self._queue:
                self._queue.remove(ticket)
            self._lock.notify_all()

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
        prefill runs there rather than one step later."""
        with self._lock:
            self._urgent += 1
        try:
            with self._model_lock:
                yield
        finally:
            with self._lock:
                self._urgent -= 1
                self._lock.notify_all()

    def _run(self) -> None:
        previous: set[_Ticket] = set()  # the streams that got a frame from the last step
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
                self._prefill_all(prefills)
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

    def _resubmitted(self, previous: set[_Ticket]) -> bool:
        """Has every stream of the last step submitted its next one (or the scheduler closed)?"""
        return self._closed or not previous - {w.owner for w in self._pending}

    def _after_own_work(self) -> None:
        """Wait (holding the lock) for the streams' own work on the model to end, then up to
        PROMPT_GRACE_S for the prefill it may submit."""
        self._lock.wait_for(lambda: not self._urgent or self._closed)
        self._lock.wait_for(self._prefill_waiting, PROMPT_GRACE_S)

    def _prefill_waiting(self) -> bool:
        return self._closed or any(w.prefill is not None for w in self._pending)

    def _prefill_all(self, prefills: list[_Work]) -> None:
        """The prompts waiting at this frame boundary (`_prefills_held`), holding the model."""
        with self._model_lock:
            self._prefills_held(prefills)

    def _let_prompts_in(self) -> None:
        """A step's pause (Batch.decode_frames; this thread holds the model): a stream's own work
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
        scheduler's thread and its helpers each taking the next), each on a share of the team (see
        `_prompt_threads`). A prompt's threads never change its results, so neither does this."""
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
            # every core while no decode holds one and no other prompt runs: checked at each of
            # Kazeia's own products (int8, int4), else once, at its start
            threads, openmp = self._prompt_threads(self.engine.prompt_team)
            made = generate.prefill(self.engine.model, prompt, opts, generator, threads, openmp)
            work.finish(made)
        except BaseException as error:  # the stream's thread raises it
            work.finish(error=error)
        with self._lock:
            self._prompting -= 1
            self._prefills += 1

    def _prompt_threads(self, team: tuple[int, bool] | None) -> tuple[int | Callable[[], int] | None, bool]:
        """generate.prefill's (prompt_threads, openmp) for a prompt now (`_prefill`): the team
        while no decode holds a lane and no other prompt runs; otherwise generation's own threads,
        shared by the prompts running side by side."""
        if team is None:
            return None, True
        threads, openmp = team
        if openmp:  # decided once: shared if other prompts run beside it, at any time
            return (None, True) if self.lanes.decoding() or self._together > 1 else team
        alone = cpu.native_threads()

        def now() -> int:
            running = max(1, self._prompting)
            return max(1, (alone if self.lanes.decoding() else threads) // running)

        return now, False

    def _decode(self, decodes: list[_Work]) -> set[_Ticket]:
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
                results = self.batch.decode_frames(states, texts, self._let_prompts_in)
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
