"""The frame step: the talker over a prompt (`FrameStep.prefill`), then one frame at a time for any
number of requests at once (`FrameStep.decode`, B >= 1; a stream alone is B = 1).

A frame is 16 codes: the talker samples codebook 0 from its hidden state, the code predictor fills
codebooks 1..15 in 15 steps, and the summed embeddings of the 16 codes plus the next text-track
vector are the talker's next input (spec §3.7). This module is the one place where codebook 0 is
scored and sampled, the predictor's loop runs, and EOS and the token limit end a request: a request
ends at EOS, or when the token it would sample next is its `max_new_tokens`-th (that token never
becomes a frame). Tensors and per-request state only.

B requests share one step where the model's products have row-independent forms
(`products.row_product`, `rows_shared`): each product takes all B rows in one call (its weights read
once for all), attention runs over each request's own cache at its own position
(`native.StackStep.batch`), the predictor's 15 steps run in lockstep (their positions are the same
for all) and each request samples with its own options and `torch.Generator`. Everything between the
products works row by row, and a row-independent product gives each row what it gives it alone, so
a request's codes never depend on the others in its step: batched equals alone, bit for bit. Where
some product has no such form (oneDNN's products on several threads, the int8 GEMM without the
native library, a GPU), the step runs its requests one after the other through the model's own
modules: the same results, without the shared weight reads.

A step may stop at its `pause` points (after the talker, after each predictor step but the last)
for other work on the model, e.g. a joining request's prompt (kazeia/scheduler.py); its rows wait
untouched meanwhile, so its results are the same. Non-goals: who runs a step and when
(kazeia/generate.py, kazeia/scheduler.py), prompts' layouts (kazeia/prompt.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import cpu
from .layers import Decoder, KVCache
from .lru import LRU
from .model import TTSModel
from .products import MAX_ROWS, row_product
from .prompt import Prompt, frame_embedding
from .sampling import SamplingOptions, sample_rows, talker_scores
from .talker import Talker

CACHE_BLOCK = 256  # talker KV positions allocated at a time (grown by whole blocks)
VOICED_CACHE_BYTES = 64 << 20  # voice positions' keys and values kept per model (~0.2 MB a position)

VoicedKV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values (1, nkv, n, hd) over n positions


def go_on() -> None:
    """The default `pause` of `FrameStep.decode`: go on at once."""


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

    @property
    def at_limit(self) -> bool:
        """The next token would be the `max_new_tokens`-th: it never becomes a frame."""
        return self.frames + 1 >= self.opts.max_new_tokens


def voiced_cache() -> LRU[tuple, VoicedKV]:
    """An empty cache of the talker's keys and values over voices' prompt positions (`Prompt.voiced`),
    keyed by their exact input vectors (`voiced_key`), VOICED_CACHE_BYTES at most."""
    return LRU(VOICED_CACHE_BYTES, lambda key, layers: sum(k.nbytes + v.nbytes for k, v in layers) + len(key[2]))


def voiced_key(embeds: torch.Tensor) -> tuple:
    """The cache key of a voice's input vectors (1, n, H): their dtype, shape and bytes."""
    data = embeds.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()
    return embeds.dtype, tuple(embeds.shape), data


class FrameStep:
    """The frame step of one loaded model (module docstring). `voiced`: the model's cache of voice
    positions (`voiced_cache`), None to compute them every time."""

    def __init__(self, model: TTSModel, voiced: LRU[tuple, VoicedKV] | None = None):
        self.model, self.voiced = model, voiced
        talker, predictor = model.talker, model.code_predictor
        self._heads = [row_product(talker.codec_head), *(row_product(h) for h in predictor.lm_head)]
        self._projection = row_product(predictor.small_to_mtp_projection)
        stacks = (talker.native_step, predictor.native_step)
        self.rows_shared = (
            all(s is not None and s.batch_layers is not None for s in stacks)
            and all(h is not None for h in self._heads)
            and self._projection is not None
        )

    @property
    def max_batch(self) -> int:
        """Requests one step may take (the predictor's first step has two rows each)."""
        return MAX_ROWS // 2

    @torch.inference_mode()
    def prefill(
        self, prompt: Prompt, opts: SamplingOptions, generator: torch.Generator | None, team: cpu.Team | None = None
    ) -> tuple[Decoding, torch.Tensor | None]:
        """The talker over the prompt, then the first frame -> (the request's Decoding, its first
        codes (1, 16) or None at EOS). `team`: the threads of both (`cpu.team`; None: torch's).
        The voice's positions always run apart from the text's, so their keys and values are the
        same bits whether they come from `voiced` or are computed."""
        talker, length = self.model.talker, prompt.embeds.shape[1]
        state = Decoding(
            opts,
            generator,
            TalkerCache(talker, length + min(opts.max_new_tokens, CACHE_BLOCK)),
            self.model.code_predictor.new_cache(),
            torch.empty(1, opts.max_new_tokens, dtype=torch.long, device=prompt.embeds.device),
            length,
        )
        voiced = prompt.voiced if 0 < prompt.voiced < length else 0
        with cpu.on(team):
            if voiced:
                self._voice_positions(prompt.embeds[:, :voiced], state.cache.layers)
            hidden = talker(prompt.embeds[:, voiced:], state.cache.layers, voiced, last=True)  # (1, 1, H)
            return state, self._frames([state], hidden, go_on)[0]

    @torch.inference_mode()
    def decode(
        self,
        states: list[Decoding],
        texts: list[torch.Tensor],
        pause: Callable[[], None] = go_on,
        team: cpu.Team | None = None,
    ) -> list[torch.Tensor | None]:
        """The next frame of each request: states[b] steps on the last frame's embedding plus
        texts[b] (1, 1, H), its text-track vector -> its codes (1, 16), or None at its EOS or token
        limit. `pause()`: called between the step's stages (module docstring). `team`: the step's
        threads (`cpu.team`; None: as they are); the codes do not depend on them."""
        with cpu.on(team):
            return self._decode(states, texts, pause)

    def _decode(
        self, states: list[Decoding], texts: list[torch.Tensor], pause: Callable[[], None]
    ) -> list[torch.Tensor | None]:
        if len(states) != len(texts):
            raise ValueError(f"{len(states)} requests but {len(texts)} text vectors")
        if len(states) > self.max_batch:
            raise ValueError(f"a frame step takes at most {self.max_batch} requests, got {len(states)}")
        out: list[torch.Tensor | None] = [None] * len(states)
        going = [b for b, state in enumerate(states) if not state.at_limit]
        if not going:
            return out
        talker, predictor = self.model.talker, self.model.code_predictor
        rows, places = [], []
        for b in going:
            state, n = states[b], states[b].frames
            rows.append(frame_embedding(talker, predictor, state.codes) + texts[b])  # (1, 1, H)
            state.cache.reserve(state.length + n)
            places.append((state.cache.layers, state.length + n - 1))
        hidden = self._stack(talker, torch.cat(rows), places)  # (B, 1, H)
        pause()
        for b, codes in zip(going, self._frames([states[b] for b in going], hidden, pause), strict=True):
            out[b] = codes
        return out

    def _frames(self, states: list[Decoding], hidden: torch.Tensor, pause: Callable[[], None]) -> list:
        """Codebook 0 from the talker's hidden (B, 1, H), then the predictor's codebooks: each
        request's frame (1, 16), or None at its EOS."""
        logits = self._head(0, hidden[:, -1])  # (B, V)
        spoken = [i for i, going in enumerate(self._codebook0(states, logits)) if going]
        out: list[torch.Tensor | None] = [None] * len(states)
        if spoken:
            made = self._predict([states[i] for i in spoken], hidden[spoken], pause)
            for i, frame in zip(spoken, made, strict=True):
                states[i].codes, states[i].frames = frame, states[i].frames + 1
                out[i] = frame
        return out

    def _codebook0(self, states: list[Decoding], logits: torch.Tensor) -> list[bool]:
        """Sample codebook 0 for each request from its row of logits (B, V); False at its EOS."""
        eos = self.model.cfg.talker.codec_eos_id
        scores = torch.cat([talker_scores(logits[b : b + 1], s.history[:, : s.frames], s.opts, eos) for b, s in
                            enumerate(states)])  # fmt: skip
        tokens = sample_rows(scores, [s.opts.talker_warpers for s in states], [s.generator for s in states])
        for state, token in zip(states, tokens, strict=True):
            state.history[0, state.frames] = token
        return [token != eos for token in tokens.tolist()]

    def _predict(self, states: list[Decoding], hidden: torch.Tensor, pause: Callable[[], None]) -> list[torch.Tensor]:
        """The code predictor's 15 steps in lockstep: hidden (B, 1, H) -> each request's codes (1, 16);
        `pause()` after each step but the last."""
        talker, predictor = self.model.talker, self.model.code_predictor
        first = [state.history[:, state.frames] for state in states]  # (1,) each
        # (B, 2, H): each request's hidden state, then its codebook-0 embedding
        x = torch.cat([torch.cat((hidden[b : b + 1], talker.codec_embedding(t[:, None])), dim=1) for b, t in
                       enumerate(first)])  # fmt: skip
        codes = [[token] for token in first]
        warpers = [state.opts.predictor_warpers for state in states]
        generators = [state.generator for state in states]
        for g in range(predictor.num_groups):
            if g > 0:
                pause()
                x = torch.cat([predictor.codec_embedding[g - 1](c[-1][:, None]) for c in codes])  # (B, 1, H)
            start = 0 if g == 0 else g + 1
            out = self._predictor(x, [(state.predictor_cache, start) for state in states])  # (B, T, h)
            tokens = sample_rows(self._head(g + 1, out[:, -1]).float(), warpers, generators)  # (B,)
            for b in range(len(states)):
                codes[b].append(tokens[b : b + 1])
        return [torch.stack(c, dim=1) for c in codes]

    def _stack(self, stack: Decoder, x: torch.Tensor, places: list[tuple[list[KVCache], int]]) -> torch.Tensor:
        """x (B, T, H) through `stack`, request b at places[b] = (its cache, its first position)."""
        if not self.rows_shared:
            return torch.cat([stack.decode(x[b : b + 1], cache, start) for b, (cache, start) in enumerate(places)])
        T = x.shape[1]
        spans = [(stack.rotary.span(start, T, x.dtype, x.device), cache, start) for cache, start in places]
        return stack.native_step.batch(x, spans)

    def _predictor(self, x: torch.Tensor, places: list[tuple[list[KVCache], int]]) -> torch.Tensor:
        """The code predictor's projection and stack over x (B, T, talker width)."""
        predictor = self.model.code_predictor
        if not self.rows_shared:
            return torch.cat([predictor(x[b : b + 1], cache, start) for b, (cache, start) in enumerate(places)])
        B, T = x.shape[:2]
        return self._stack(predictor, self._projection(x.reshape(B * T, -1)).view(B, T, -1), places)

    def _head(self, g: int, x: torch.Tensor) -> torch.Tensor:
        """Head g's logits (0: the talker's codec head, g: the predictor's head g) for x (B, H)."""
        if self.rows_shared:
            return self._heads[g](x)  # type: ignore[misc]
        head = self.model.talker.codec_head if g == 0 else self.model.code_predictor.lm_head[g - 1]
        return torch.cat([head(x[b : b + 1]) for b in range(x.shape[0])])

    def _voice_positions(self, embeds: torch.Tensor, layers: list[KVCache]) -> None:
        """Fill `layers` at positions [0, n) with the talker's keys and values over `embeds` (1, n, H):
        from `voiced`, else computed (and kept there)."""
        n = embeds.shape[1]
        key = voiced_key(embeds) if self.voiced is not None else None
        stored = self.voiced.get(key) if self.voiced is not None else None
        if stored is None:
            self.model.talker(embeds, layers, 0)
            if self.voiced is not None:
                self.voiced.put(key, [(layer.k[:, :, :n].clone(), layer.v[:, :, :n].clone()) for layer in layers])
            return
        for layer, (k, v) in zip(layers, stored, strict=True):
            layer.write(0, k, v)
