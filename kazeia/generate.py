"""The frame loop: `prefill`, then `decode_frame` once per frame.

A frame is 16 codes: the talker samples codebook 0 from its hidden state, the code predictor fills
codebooks 1..15 (`predict_codes`), and the summed embeddings of the 16 codes plus the next
text-track vector are the talker's next input (spec §3.7). `prefill` runs the talker over the
prompt and makes the first frame; `decode_frame` runs one talker step on the previous frame and
makes the next. `frames()` is the only generation loop; offline synthesis, streaming and every
front end consume it. Generation ends when the talker samples EOS or has sampled `max_new_tokens`
tokens (that last token never becomes a frame), when the runaway guard stops it, or when the text
source or `should_stop` says so; `frames()` returns which (its finish reason).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Generator
from dataclasses import dataclass

import torch

from . import cpu
from .layers import KVCache
from .model import TTSModel
from .prompt import Prompt, frame_embedding
from .runaway import CANCELLED, EOS, GUARD, LENGTH, Guard
from .sampling import SamplingOptions, sample, talker_scores
from .talker import Talker

CACHE_BLOCK = 256  # talker KV positions allocated at a time (grown by whole blocks)


class TalkerCache:
    """The talker's per-request KV cache, grown in blocks so long requests never overflow."""

    def __init__(self, talker: Talker, needed: int):
        self.talker = talker
        self.layers = talker.new_cache(_round_up(needed))

    def reserve(self, needed: int) -> None:
        if needed <= self.layers[0].capacity:
            return
        grown = self.talker.new_cache(_round_up(needed + CACHE_BLOCK))
        for old, new in zip(self.layers, grown, strict=True):
            used = old.capacity
            new.k[:, :, :used], new.v[:, :, :used] = old.k, old.v
        self.layers = grown


def _round_up(n: int) -> int:
    return -(-n // CACHE_BLOCK) * CACHE_BLOCK


VOICED_CACHE_BYTES = 64 << 20  # keys and values kept per model (a 0.6B or 1.7B voice: ~0.2 MB a position)


class VoicedCache:
    """The talker's keys and values over prompts' voice positions (`Prompt.voiced`: instruct, role
    and control ids, speaker or x-vector), by the exact input vectors there, least recently used
    first out beyond `limit` bytes. `prefill` always runs those positions apart from the rest, so a
    prompt's results are the same bits whether they are found here or computed."""

    def __init__(self, limit: int = VOICED_CACHE_BYTES):
        self.limit, self.size = limit, 0
        # key -> (per layer (keys, values), bytes it counts for)
        self._entries: OrderedDict[tuple, tuple[list[tuple[torch.Tensor, torch.Tensor]], int]] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def key(embeds: torch.Tensor) -> tuple:
        data = embeds.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()
        return embeds.dtype, tuple(embeds.shape), data

    def get(self, key: tuple) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        with self._lock:
            found = self._entries.get(key)
            if found is None:
                return None
            self._entries.move_to_end(key)
            return found[0]

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.size = 0

    def put(self, key: tuple, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        size = sum(k.nbytes + v.nbytes for k, v in layers) + len(key[2])
        with self._lock:
            if size > self.limit or key in self._entries:
                return
            self._entries[key] = layers, size
            self.size += size
            while self.size > self.limit:
                self.size -= self._entries.popitem(last=False)[1][1]


_VOICED: weakref.WeakKeyDictionary[TTSModel, VoicedCache] = weakref.WeakKeyDictionary()
_VOICED_LOCK = threading.Lock()


def voiced_cache(model: TTSModel) -> VoicedCache:
    """`model`'s VoicedCache (made on first use)."""
    with _VOICED_LOCK:
        if model not in _VOICED:
            _VOICED[model] = VoicedCache()
        return _VOICED[model]


def _voiced_positions(model: TTSModel, embeds: torch.Tensor, layers: list[KVCache]) -> None:
    """Fill `layers` at positions [0, n) with the talker's keys and values over `embeds` (1, n, H):
    from the model's VoicedCache, else computed (and kept there)."""
    cache, key, n = voiced_cache(model), VoicedCache.key(embeds), embeds.shape[1]
    stored = cache.get(key)
    if stored is None:
        model.talker(embeds, layers, 0)
        cache.put(key, [(layer.k[:, :, :n].clone(), layer.v[:, :, :n].clone()) for layer in layers])
        return
    for layer, (k, v) in zip(layers, stored, strict=True):
        layer.write(0, k, v)


@dataclass
class Decoding:
    """One request's state between frames."""

    opts: SamplingOptions
    generator: torch.Generator | None  # every random draw of the request
    cache: TalkerCache
    predictor_cache: list[KVCache]  # reused (overwritten from position 0) every frame
    history: torch.Tensor  # (1, max_new_tokens) int64: the codebook-0 tokens sampled so far
    length: int  # prompt positions
    frames: int = 0  # frames made so far
    codes: torch.Tensor | None = None  # (1, 16) the last frame


def prefill(
    model: TTSModel,
    prompt: Prompt,
    opts: SamplingOptions,
    generator: torch.Generator | None,
    prompt_threads: int | Callable[[], int] | None = None,
    openmp: bool = True,
):
    """The talker over the prompt, then the first frame: -> (Decoding, codes (1, 16) or None).
    prompt_threads: the threads of both (`cpu.team`, with torch's regions where `openmp`; None:
    torch's)."""
    talker, device = model.talker, prompt.embeds.device
    length = prompt.embeds.shape[1]
    state = Decoding(
        opts,
        generator,
        TalkerCache(talker, length + min(opts.max_new_tokens, CACHE_BLOCK)),
        model.code_predictor.new_cache(),
        torch.empty(1, opts.max_new_tokens, dtype=torch.long, device=device),
        length,
    )
    # The voice's positions apart from the text's, always: the same bits whether cached or not.
    voiced = prompt.voiced if 0 < prompt.voiced < length else 0
    with cpu.team(prompt_threads, openmp):
        if voiced:
            _voiced_positions(model, prompt.embeds[:, :voiced], state.cache.layers)
        hidden = talker(prompt.embeds[:, voiced:], state.cache.layers, voiced)[:, -1:]  # (1, 1, H)
        return state, _frame(model, state, hidden)


def decode_frame(model: TTSModel, state: Decoding, text: torch.Tensor) -> torch.Tensor | None:
    """The next frame: the talker steps on the last frame's embedding plus `text` (1, 1, H), its
    text-track vector, then samples codebook 0 and the code predictor the rest. -> codes (1, 16),
    or None at EOS or the token limit."""
    n = state.frames
    if n + 1 >= state.opts.max_new_tokens:  # this frame's token would be the last one: never a frame
        return None
    x = frame_embedding(model.talker, model.code_predictor, state.codes) + text  # (1, 1, H)
    state.cache.reserve(state.length + n)
    hidden = model.talker(x, state.cache.layers, state.length + n - 1)
    return _frame(model, state, hidden)


def _frame(model: TTSModel, state: Decoding, hidden: torch.Tensor) -> torch.Tensor | None:
    """Codebook 0 from the talker's hidden (1, 1, H); None at EOS, else the frame's 16 codes."""
    opts, n = state.opts, state.frames
    logits = model.talker.codec_head(hidden[:, -1])
    scores = talker_scores(logits, state.history[:, :n], opts, model.cfg.talker.codec_eos_id)
    token = sample(scores, opts.do_sample, opts.temperature, opts.top_k, opts.top_p, state.generator)
    state.history[:, n] = token
    if int(token) == model.cfg.talker.codec_eos_id:
        return None
    state.codes = predict_codes(model, state, hidden, token)
    state.frames += 1
    return state.codes


def predict_codes(model: TTSModel, state: Decoding, hidden: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """The code predictor's 15 steps: hidden (1, 1, H) talker state and first (1,) codebook-0 token
    -> the frame's 16 codes (1, 16)."""
    predictor, opts, cache = model.code_predictor, state.opts, state.predictor_cache

    def pick(out: torch.Tensor, g: int) -> torch.Tensor:
        logits = predictor.lm_head[g](out[:, -1]).float()
        return sample(
            logits, opts.subtalker_dosample, opts.subtalker_temperature, opts.subtalker_top_k, opts.subtalker_top_p,
            state.generator,
        )  # fmt: skip

    x = torch.cat((hidden, model.talker.codec_embedding(first[:, None])), dim=1)  # (1, 2, H)
    codes = [first, pick(predictor(x, cache, 0), 0)]
    for g in range(1, predictor.num_groups):
        x = predictor.codec_embedding[g - 1](codes[-1][:, None])  # (1, 1, H)
        codes.append(pick(predictor(x, cache, g + 1), g))
    return torch.stack(codes, dim=1)


class StepCancelled(Exception):
    """Raised by a `Steps` whose request was cancelled while its step waited (ends `frames`)."""


class Steps:
    """How `frames` runs its steps: this one at once, in the caller's thread. A scheduler's steps
    (kazeia/scheduler.py) run them in its own thread instead, batched with other requests';
    `exclusive()` then keeps the caller's own model work (its prompt, live text's embeddings) from
    running beside them: the model runs in one thread at a time, on generation's own core(s).
    prompt_threads: the prefill's threads (None: torch's), for a prefill that has the machine to
    itself: before a stream's first audio its vocoder has nothing to do. openmp: torch's parallel
    regions take them too; not where Kazeia's own threaded kernels do the work (int4: the two
    kinds of threads then fight over the cores, 1.3x slower than either alone)."""

    prompt_threads: int | None = None
    openmp: bool = True

    def __init__(self, prompt_threads: int | None = None, openmp: bool = True):
        self.prompt_threads, self.openmp = prompt_threads, openmp

    def exclusive(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def prefill(self, model: TTSModel, prompt: Prompt, opts: SamplingOptions, generator: torch.Generator | None):
        return prefill(model, prompt, opts, generator, self.prompt_threads, self.openmp)

    def decode(self, model: TTSModel, state: Decoding, text: torch.Tensor) -> torch.Tensor | None:
        return decode_frame(model, state, text)


SOLO = Steps()


@torch.inference_mode()
def frames(
    model: TTSModel,
    prompt: Prompt,
    opts: SamplingOptions,
    generator: torch.Generator | None,
    should_stop: Callable[[], bool] | None = None,
    guard: Guard | None = None,
    steps: Steps = SOLO,
) -> Generator[torch.Tensor, None, str]:
    """Yield one (16,) int64 code frame at a time until EOS, `max_new_tokens`, the `guard`
    (kazeia/runaway.py), the end of a live text source or `should_stop()` (polled before each
    frame's work); return the finish reason (runaway.FINISH_REASONS). `steps` runs the prefill and
    each frame's step (at once by default; a scheduler's batch them with other requests')."""
    if should_stop is not None and should_stop():
        return CANCELLED
    try:
        state, codes = steps.prefill(model, prompt, opts, generator)
        while codes is not None:
            yield codes[0]
            if guard is not None and guard.stops(int(codes[0, 0])):
                return GUARD
            text = prompt.text_at(state.frames - 1)  # live text may wait here for the next token
            if text is None or (should_stop is not None and should_stop()):
                return CANCELLED
            codes = steps.decode(model, state, text)
    except StepCancelled:
        return CANCELLED
    return LENGTH if state.frames + 1 >= opts.max_new_tokens else EOS
