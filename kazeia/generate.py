"""The frame loop: talker prefill, then one talker step + 15 code-predictor steps per frame.

`frames()` is the only generation loop; offline synthesis, streaming and every front end consume it.
It follows the reference loop exactly (spec §3.7): the talker samples codebook 0, the code predictor
fills codebooks 1..15, the summed embeddings of the 16 codes plus the next text-track vector become
the talker's next input. Generation ends when the talker samples EOS or has sampled
`max_new_tokens` tokens; that last token never becomes a frame.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from .code_predictor import CodePredictor
from .layers import KVCache
from .prompt import Prompt
from .sampling import SamplingOptions, choose, talker_scores
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


def _frame_embedding(talker: Talker, predictor: CodePredictor, codes: torch.Tensor) -> torch.Tensor:
    """codes (1, 16) -> (1, 1, H): sum of the codebook-0 row and the 15 predictor rows."""
    rows = [talker.codec_embedding(codes[:, :1])]
    rows += [emb(codes[:, g + 1 : g + 2]) for g, emb in enumerate(predictor.codec_embedding)]
    return torch.cat(rows, dim=1).sum(1, keepdim=True)


@torch.inference_mode()
def frames(
    talker: Talker,
    predictor: CodePredictor,
    prompt: Prompt,
    opts: SamplingOptions,
    eos_id: int,
    generator: torch.Generator | None,
    should_stop: Callable[[], bool] | None = None,
) -> Iterator[torch.Tensor]:
    """Yield one (16,) int64 code frame at a time until EOS, `max_new_tokens` or `should_stop()`."""
    length = prompt.embeds.shape[1]
    cache = TalkerCache(talker, length + min(opts.max_new_tokens, CACHE_BLOCK))
    cp_cache = predictor.new_cache()
    hidden = talker(prompt.embeds, cache.layers, 0)[:, -1:]  # (1, 1, H)
    generated = torch.empty(1, 0, dtype=torch.long, device=hidden.device)

    def next_token(h: torch.Tensor) -> torch.Tensor:
        scores = talker_scores(talker.codec_head(h[:, -1]), generated, opts, eos_id)
        return choose(scores, opts.do_sample, opts.temperature, opts.top_k, opts.top_p, generator)

    token = next_token(hidden)  # (1,)
    step = 0
    while True:
        generated = torch.cat((generated, token[:, None]), dim=1)
        if int(token) == eos_id or generated.shape[1] >= opts.max_new_tokens:
            return
        if should_stop is not None and should_stop():
            return
        codes = _predict_codes(predictor, talker, cp_cache, hidden, token, opts, generator)
        yield codes[0]
        text = prompt.trailing[:, step : step + 1] if step < prompt.trailing.shape[1] else prompt.pad
        x = _frame_embedding(talker, predictor, codes) + text
        cache.reserve(length + step + 1)
        hidden = talker(x, cache.layers, length + step)
        step += 1
        token = next_token(hidden)
