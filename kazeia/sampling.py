"""Sampling options and the logit processing of the reference generation loop.

The talker's codebook-0 logits go through, in this order: repetition penalty over the codebook-0
tokens generated so far, the min-new-tokens rule (EOS masked for the first `MIN_NEW_TOKENS`
tokens), suppression of the control rows 2048..3071 except EOS, then (when sampling) temperature,
top-k and top-p. The code predictor's logits only get temperature/top-k/top-p. Every random draw
takes an explicit `torch.Generator`; no global RNG state is read or written.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from .config import CheckpointError, read_json
from .errors import RequestError

# Where generation_config.json leaves a field out, the reference falls back to its own value, which
# differs from the released files' for this one field (8192).
FILE_FALLBACKS = {"max_new_tokens": 2048}
# Temperatures and the repetition penalty divide float32 logits (|x| < ~100): below this the
# quotients overflow to infinity and sampling meets NaN. Anything that small is greedy in effect.
MIN_DIVISOR = 1e-3
MAX_SEED = 2**63  # seeds are integers in [0, MAX_SEED)
MIN_NEW_TOKENS = 2  # the reference masks EOS for the first two talker tokens
CONTROL_ROWS = 1024  # the last 1024 codec rows are control/conditioning ids, never sampled (except EOS)


Warpers = tuple[bool, float, int, float]  # do_sample, temperature, top_k, top_p: one draw's settings


@dataclass(frozen=True)
class SamplingOptions:
    """Generation options, named as in the reference's `generate_*` functions (the defaults are the
    released generation_config.json's). A call sets them through `SynthesisOptions` (kazeia/options.py,
    where each is described); a checkpoint's own defaults fill what a call leaves out."""

    do_sample: bool = True  # talker: sample codebook 0 (False: greedy argmax)
    temperature: float = 0.9  # talker logits are divided by this before top-k/top-p
    top_k: int = 50  # keep the k most likely codebook-0 tokens (0: no limit)
    top_p: float = 1.0  # nucleus: keep the smallest set with this probability mass (1.0: off)
    repetition_penalty: float = 1.05  # >1 discourages repeating generated codebook-0 tokens (1.0: off)
    max_new_tokens: int = 8192  # talker tokens incl. the final EOS/cut-off one; frames <= this - 1
    subtalker_dosample: bool = True  # code predictor: sample codebooks 1..15 (False: greedy)
    subtalker_temperature: float = 0.9  # code predictor: temperature
    subtalker_top_k: int = 50  # code predictor: top-k (0: no limit)
    subtalker_top_p: float = 1.0  # code predictor: top-p (1.0: off)
    ignore_eos: bool = False  # never sample EOS: exactly max_new_tokens - 1 frames (benchmarks)

    @property
    def talker_warpers(self) -> Warpers:
        """How codebook 0 is drawn (`sample`)."""
        return self.do_sample, self.temperature, self.top_k, self.top_p

    @property
    def predictor_warpers(self) -> Warpers:
        """How codebooks 1..15 are drawn (`sample`)."""
        return self.subtalker_dosample, self.subtalker_temperature, self.subtalker_top_k, self.subtalker_top_p

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    def __post_init__(self) -> None:
        for name in ("do_sample", "subtalker_dosample", "ignore_eos"):
            if not isinstance(getattr(self, name), bool):
                raise RequestError(name, f"{name} must be True or False, got {getattr(self, name)!r}")
        for name in ("temperature", "subtalker_temperature"):
            _check(name, getattr(self, name), float, _safe_divisor, f"a number >= {MIN_DIVISOR:g}")
        for name in ("top_k", "subtalker_top_k"):
            _check(name, getattr(self, name), int, lambda v: v >= 0, "an integer >= 0")
        for name in ("top_p", "subtalker_top_p"):
            _check(name, getattr(self, name), float, lambda v: 0 < v <= 1, "a number in (0, 1]")
        _check("repetition_penalty", self.repetition_penalty, float, _safe_divisor, f"a number >= {MIN_DIVISOR:g}")
        # Two tokens at least: the first can never be EOS, so every call yields one frame or more.
        _check("max_new_tokens", self.max_new_tokens, int, lambda v: v >= 2, "an integer >= 2")

    @classmethod
    def from_file(cls, path: Path) -> SamplingOptions:
        """A checkpoint's defaults: the fields its `generation_config.json` sets (other keys are the
        file's own business), the reference's fallbacks for the rest (FILE_FALLBACKS, else these
        fields' defaults)."""
        data = {**FILE_FALLBACKS, **read_json(path)}
        try:
            return cls(**{name: data[name] for name in cls.names() if name in data})
        except RequestError as e:
            raise CheckpointError(f"{path}: {e}") from None


def _safe_divisor(value: float) -> bool:
    return MIN_DIVISOR <= value < float("inf")


def _check(name: str, value, kind: type, ok, what: str) -> None:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int and not isinstance(value, int):
        number = False
    if not number or value != value or not ok(value):
        raise RequestError(name, f"{name} must be {what}, got {value!r}")


def talker_scores(logits: torch.Tensor, generated: torch.Tensor, opts: SamplingOptions, eos_id: int) -> torch.Tensor:
    """logits (B, V) -> processed float32 scores; generated (B, n) codebook-0 tokens so far."""
    scores = logits.float()
    if opts.repetition_penalty != 1.0 and generated.shape[1] > 0:
        picked = torch.gather(scores, 1, generated)
        picked = torch.where(picked < 0, picked * opts.repetition_penalty, picked / opts.repetition_penalty)
        scores = scores.scatter(1, generated, picked)
    allow_eos = not opts.ignore_eos and generated.shape[1] >= MIN_NEW_TOKENS
    return scores.masked_fill(_blocked(scores.shape[-1], eos_id, scores.device, allow_eos), float("-inf"))


@functools.lru_cache(maxsize=32)
def _blocked(vocab: int, eos_id: int, device: torch.device, allow_eos: bool) -> torch.Tensor:
    """(V,) bool: the control rows, EOS included unless allowed (built once, not every step)."""
    blocked = torch.zeros(vocab, dtype=torch.bool, device=device)
    blocked[vocab - CONTROL_ROWS :] = True
    blocked[eos_id] = not allow_eos
    return blocked


def sample(scores: torch.Tensor, warpers: Warpers, generators: list[torch.Generator | None]) -> torch.Tensor:
    """scores (B, V) float32 -> token ids (B,) by argmax or by sampling with the given warpers, row b
    drawing from generators[b] (None: torch's global generator, as the reference's calls do).

    Each row gets exactly what `torch.multinomial(probs[b:b+1], 1, generator=generators[b])` gives
    it, with the generator left in the same state: for one sample, torch draws an exponential per
    vocabulary entry into a tensor shaped like the row and takes argmax(probs / draws). Written out
    here so that B rows share every operation but the draws, and the warpers work row by row, so
    a row's token never depends on the others
    (tests/test_sampling.py checks both against torch.multinomial)."""
    do_sample, temperature, top_k, top_p = warpers
    if not do_sample:
        return scores.argmax(dim=-1)
    if temperature != 1.0:
        scores = scores / temperature
    if top_k > 0:
        k = min(top_k, scores.shape[-1])
        kth = torch.topk(scores, k).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        ordered, order = torch.sort(scores, descending=False)
        cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= (1 - top_p)
        drop[..., -1:] = False  # always keep the most likely token
        scores = scores.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    probs = scores.softmax(dim=-1)
    if not bool(torch.isfinite(probs).all()):  # what torch.multinomial refuses too
        raise RuntimeError("probability tensor contains either inf, nan or element < 0")
    draws = torch.empty_like(probs)
    for row, generator in zip(draws, generators, strict=True):
        row.exponential_(1, generator=generator)
    return (probs / draws).argmax(dim=-1)


def sample_rows(scores: torch.Tensor, warpers: list[Warpers], generators: list[torch.Generator | None]) -> torch.Tensor:
    """scores (B, V) -> token ids (B,), row b sampled with warpers[b] from generators[b]; rows with
    the same warpers share one `sample` call."""
    if all(w == warpers[0] for w in warpers):
        return sample(scores, warpers[0], generators)
    tokens = torch.empty(scores.shape[0], dtype=torch.long, device=scores.device)
    for w in dict.fromkeys(warpers):
        rows = [b for b, other in enumerate(warpers) if other == w]
        tokens[rows] = sample(scores[rows], w, [generators[b] for b in rows])
    return tokens
