"""The frame loop: talker prefill, then one talker step + 15 code-predictor steps per frame.

`frames()` is the only generation loop; offline synthesis, streaming and every front end consume it.
It follows the reference loop exactly (spec §3.7): the talker samples codebook 0, the code predictor
fills codebooks 1..15, the summed embeddings of the 16 codes plus the next text-track vector become
the talker's next input. Generation ends when the talker samples EOS or has sampled
`max_new_tokens` tokens; that last token never becomes a frame.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from .code_predictor import CodePredictor
from .layers import KVCache
from .prompt import Prompt, frame_embedding
from .sampling import SamplingOptions, choose, talker_scores
from .talker import Talker

CACHE_BLOCK = 256  # talker KV positions allocated at a time (grown by whole blocks)


@dataclass
class FrameStats:
    """Where generation time goes (filled in when passed to `frames`; for benchmarks)."""

    prefill_s: float = 0.0  # talker over the prompt, first token included
    talker_s: float = 0.0  # talker steps: next input, decoder step, head, sampling
    predictor_s: float = 0.0  # code predictor: 15 steps with sampling
    frames: int = 0

    def clock(self, device: torch.device) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()


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


def _predict_codes(
    predictor: CodePredictor,
    talker: Talker,
    cache: list[KVCache],
    hidden: torch.Tensor,
    first: torch.Tensor,
    opts: SamplingOptions,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """hidden (1, 1, H) talker state, first (1,) codebook-0 token -> the frame's 16 codes (1, 16)."""
    sample = lambda logits: choose(  # noqa: E731 - the predictor's fixed warper settings
        logits.float(),
        opts.subtalker_dosample,
        opts.subtalker_temperature,
        opts.subtalker_top_k,
        opts.subtalker_top_p,
        generator,
    )
    x = torch.cat((hidden, talker.codec_embedding(first[:, None])), dim=1)  # (1, 2, H)
    out = predictor(x, cache, 0)
    codes = [first, sample(predictor.lm_head[0](out[:, -1]))]
    for g in range(1, predictor.num_groups):
        x = predictor.codec_embedding[g - 1](codes[-1][:, None])  # (1, 1, H)
        out = predictor(x, cache, g + 1)
        codes.append(sample(predictor.lm_head[g](out[:, -1])))
    return torch.stack(codes, dim=1)


@torch.inference_mode()
def frames(
    talker: Talker,
    predictor: CodePredictor,
    prompt: Prompt,
    opts: SamplingOptions,
    eos_id: int,
    generator: torch.Generator | None,
    should_stop: Callable[[], bool] | None = None,
    stats: FrameStats | None = None,
) -> Iterator[torch.Tensor]:
    """Yield one (16,) int64 code frame at a time until EOS, `max_new_tokens` or `should_stop()`."""
    device = prompt.embeds.device
    clock = (lambda: stats.clock(device)) if stats is not None else (lambda: 0.0)
    started = clock()
    length = prompt.embeds.shape[1]
    cache = TalkerCache(talker, length + min(opts.max_new_tokens, CACHE_BLOCK))
    cp_cache = predictor.new_cache()
    history = torch.empty(1, opts.max_new_tokens, dtype=torch.long, device=device)  # codebook-0 tokens

    def next_token(h: torch.Tensor, n: int) -> torch.Tensor:
        scores = talker_scores(talker.codec_head(h[:, -1]), history[:, :n], opts, eos_id)
        token = choose(scores, opts.do_sample, opts.temperature, opts.top_k, opts.top_p, generator)
        history[:, n] = token
        return token

    hidden = talker(prompt.embeds, cache.layers, 0)[:, -1:]  # (1, 1, H)
    token = next_token(hidden, 0)  # (1,)
    step = 0
    if stats is not None:
        stats.prefill_s += clock() - started
    while True:
        if int(token) == eos_id or step + 1 >= opts.max_new_tokens:
            return
        if should_stop is not None and should_stop():
            return
        mark = clock()
        codes = _predict_codes(predictor, talker, cp_cache, hidden, token, opts, generator)
        if stats is not None:
            stats.predictor_s += clock() - mark
            stats.frames += 1
        yield codes[0]
        mark = clock()
        text = prompt.text_at(step)  # live text may wait here for the next token
        if text is None:
            return
        x = frame_embedding(talker, predictor, codes) + text
        cache.reserve(length + step + 1)
        hidden = talker(x, cache.layers, length + step)
        step += 1
        token = next_token(hidden, step)
        if stats is not None:
            stats.talker_s += clock() - mark
