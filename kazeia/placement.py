"""Where work runs: every decision about threads, teams, lanes and who runs a prompt.

Two stages run side by side on the CPU: generation (the talker and code predictor, bound by memory
bandwidth) and the vocoder (bound by arithmetic), each in a thread of its own with `stage_threads()`
torch threads by default: half the cores each, so they never share a core, and batch-1 generation's
hundreds of small parallel regions a frame never wait at a barrier for a thread that is not running
(docs/design.md). Prompts are the exception: before a stream's first audio its vocoder has nothing
to decode, so a prompt may take both stages' threads (`Placement.prompt_team`) while nothing else
needs them, and while no other process takes the CPUs (kazeia/neighbours.py):

* outside a scheduler, a request's first prompt while the engine has no other request or stream
  open (`first_prompt_team`, counting them with `Running`);
* in a scheduler, a prompt while no stream's audio is being decoded and no other prompt runs;
  several prompts waiting at once share the team (`scheduled_prompt_team`, `prompts_at_once`).

A stream's first chunk may take the team too while the engine runs nothing else
(`first_chunk_team`, one stage's threads beside a busy neighbour); its generation waits for that
chunk rather than take a core from it. After
it, a frame step takes the team while the vocoder has nothing to decode and cannot start before
the step ends, and no other process wants the CPUs (`decode_team`, kazeia/neighbours.py): a
stream's vocoder decodes a chunk, then waits for the next one, and its core would sit idle.

The streams of a scheduler decode their audio in turns (kazeia/lanes.py): `vocoder_lanes` decodes at
once, by default as many as fit beside generation's threads. The mechanisms live elsewhere: a
team is applied by `cpu.team` (Kazeia's own products split their weight rows over the calling
thread's team, `cpu.native_threads`), a lane taken through `lanes.VocoderLanes`; this module decides
the sizes. Non-goals:
which product kernels a model uses (kazeia/model.py).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from . import cpu
from .neighbours import NEIGHBOURS
from .products import own_threads

# Decodes that may run on generation's own cores while generation waits (kazeia/lanes.py): one, so
# that a stream short of audio is decoded without waiting for a vocoder lane.
SPARE_LANES = 1
# The longest first chunk that takes the team (`first_chunk_team`): its decode is the wait for first
# audio; a longer one is decoded while generation goes on (its generation would wait for all of it).
FIRST_CHUNK_TEAM_FRAMES = 2


def stage_threads() -> int:
    """torch threads per stage by default: half the CPUs this process may run on, at least one."""
    return max(1, cpu.usable_cpus() // 2)


def set_stage_threads(threads: int | None, device: torch.device) -> None:
    """Give each stage `threads` torch threads (default on the CPU: `stage_threads()`); process-wide
    (`torch.set_num_threads`). A bad count is a ValueError naming it."""
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads must be an integer >= 1, got {threads!r}")
    if threads is not None or device.type == "cpu":
        torch.set_num_threads(threads or stage_threads())


class Running:
    """How many requests and open streams an engine has (a stream's request counts by its stream):
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

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        """The block counted in while it runs."""
        self.enter()
        try:
            yield
        finally:
            self.leave()


def _others_busy() -> bool:
    """Whether another process takes the CPUs, as a prompt sees it: not where that cannot be told
    (it keeps its team, as where no neighbour could be read at all)."""
    return NEIGHBOURS.busy(unknown=False)


@dataclass(frozen=True)
class Placement:
    """The thread decisions of one loaded model (`for_model`)."""

    threads: int  # torch threads of each stage (generation, the vocoder)
    usable_cpus: int  # the CPUs this process may run on
    # every core of the two stages, for a prompt that has the machine to itself; None where there is
    # no more than one stage's threads (one core, a GPU). Its `openmp` is False where Kazeia's own
    # products split a prompt's rows themselves (int4, native int8): the two kinds of threads would
    # fight over the cores.
    prompt_team: cpu.Team | None

    @classmethod
    def for_model(cls, model: nn.Module, device: torch.device) -> Placement:
        threads, usable = torch.get_num_threads(), cpu.usable_cpus()
        prompt_threads = min(usable, 2 * threads)
        team = None
        if device.type == "cpu" and prompt_threads > threads:
            team = cpu.Team(prompt_threads, not any(own_threads(m) for m in model.modules()))
            NEIGHBOURS.busy()  # the first look: the first prompt can tell
        return cls(threads, usable, team)

    def first_prompt_team(self, running: Running) -> Callable[[], cpu.Team | None]:
        """The team of a request's first prompt outside a scheduler, asked when it runs: the prompt
        team while `running` counts this request alone and no other process takes the CPUs
        (kazeia/neighbours.py), else torch's threads."""
        return lambda: self.prompt_team if running.count() == 1 and not _others_busy() else None

    def first_chunk_team(self, running: Running, frames: int = 1) -> Callable[[], int | None] | None:
        """The threads of a stream's first chunk, asked at each of its convolutions: the prompt
        team's while `running` counts this stream alone, the vocoder's own while another process
        takes the CPUs (kazeia/neighbours.py: a split decode would wait for its share), None (the
        vocoder's own, generation not waiting) once anything else of this engine runs; None where
        there is no team, or where the first chunk is longer than
        `FIRST_CHUNK_TEAM_FRAMES` (`frames`: a throughput choice, such as an offline synthesis's
        blocks, not first audio). While its first chunk may take the team, a stream's generation
        waits for it (kazeia/producer.py): a split decode would otherwise wait for its share on a
        core the next frame's generation holds."""
        team = self.prompt_team
        if team is None or not isinstance(team.threads, int) or frames > FIRST_CHUNK_TEAM_FRAMES:
            return None
        alone, whole = self.threads, team.threads
        return lambda: (alone if _others_busy() else whole) if running.count() == 1 else None

    def decode_team(
        self, decoding: Running, others: Callable[[], bool], far: Sequence[Callable[[], bool]]
    ) -> cpu.Team | None:
        """The team of generation's frame steps: the prompt team's threads while no decode runs
        (`decoding` counts them), nothing else needs the cores (`others()`: a prompt, another
        stream) and each of the step's streams' next chunk still needs a frame (`far`:
        SpeechStream.chunk_far), else generation's own. Asked at each of Kazeia's products (a
        native step: once a stack), so a step takes the vocoder's core only while the vocoder has
        nothing to decode and cannot start before the step ends, and no other process takes this
        process's CPUs (kazeia/neighbours.py: a split step waits for its share). Only Kazeia's own
        products take it (torch's regions keep their count: a step's products are native wherever
        a team helps); their results do not depend on their threads. None where there is no such
        team (one core)."""
        team = self.prompt_team
        if team is None or not isinstance(team.threads, int):
            return None
        alone, whole = self.threads, team.threads

        def now() -> int:
            busy = decoding.count() > 0 or others() or not all(ready() for ready in far)
            return alone if busy or NEIGHBOURS.busy() else whole

        return cpu.Team(now, False)

    def vocoder_lanes(self, lanes: int | None) -> int:
        """Decodes of a scheduler's streams at once: `lanes`, or as many as fit beside generation's
        threads on the usable cores (each decode taking as many), at least one."""
        if lanes is not None:
            return lanes
        return max(1, (self.usable_cpus - self.threads) // self.threads)

    def spare_lanes(self, wanted: int | None) -> int:
        """Decodes that may run on generation's cores while it waits: `wanted`, or `SPARE_LANES`."""
        return SPARE_LANES if wanted is None else wanted

    def prompts_at_once(self, wanted: int | None) -> int:
        """Prompts waiting together that a scheduler runs side by side: `wanted`, or as many as the
        prompt team holds stages' threads (one where there is no team)."""
        if wanted is not None:
            if isinstance(wanted, bool) or not isinstance(wanted, int) or wanted < 1:
                raise ValueError(f"prompts_at_once must be an integer >= 1 or None, got {wanted!r}")
            return wanted
        team = self.prompt_team
        if team is None or not isinstance(team.threads, int):
            return 1
        return max(1, team.threads // max(1, self.threads))

    def scheduled_prompt_team(
        self, decoding: Callable[[], bool], together: int, running: Callable[[], int]
    ) -> cpu.Team | None:
        """The team of a scheduler's prompt starting now: the prompt team while no decode holds a
        lane (`decoding()`), no other prompt runs beside it (`together` side by side) and no other
        process takes the CPUs (kazeia/neighbours.py), else generation's own threads, shared by the
        prompts running (`running()`). Where torch's
        regions take the team it is decided once, here; where Kazeia's products do, it is asked
        again at each product, so a prompt takes cores as they free."""
        team = self.prompt_team
        if team is None:
            return None
        if team.openmp:
            return None if decoding() or together > 1 or _others_busy() else team
        alone, whole = self.threads, team.threads  # generation's own threads; the whole team
        assert isinstance(whole, int)

        def now() -> int:
            return max(1, (alone if decoding() or _others_busy() else whole) // max(1, running()))

        return cpu.Team(now, False)
