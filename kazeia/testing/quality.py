"""Quality guard for reduced precisions: how far an engine's outputs move from float32's.

Teacher forcing feeds both engines the same codes (the float32 engine's greedy output), so errors
do not compound: the talker's codebook-0 logits at every frame and the code predictor's 15 logit
vectors per frame are compared with float32's (relative L2 error, top-1 agreement). Free-running
greedy generation is compared too (share of identical codes), where one early disagreement changes
everything after it. Used by tests/test_quality.py (tiny checkpoints) and benchmarks/quality.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..engine import Engine
from ..prompt import build_prompt, frame_embedding

GREEDY = dict(do_sample=False, subtalker_dosample=False, ignore_eos=True)


@dataclass(frozen=True)
class Quality:
    """Errors of one engine against a float32 engine on the same text and codes."""

    talker_rel_error: float  # ||logits - logits32|| / ||logits32|| over all frames, codebook 0
    talker_top1: float  # share of frames whose teacher-forced codebook-0 argmax equals float32's
    predictor_rel_error: float  # same for the code predictor's 15 logit vectors per frame
    predictor_top1: float
    greedy_agreement: float  # share of identical codes in free-running greedy generation
    audio_snr_db: float  # vocoder output on the float32 codes vs the float32 engine's vocoder


@torch.inference_mode()
def teacher_forced_logits(
    engine: Engine, text: str, codes: torch.Tensor, **request
) -> tuple[torch.Tensor, torch.Tensor]:
    """codes (T, 16) -> talker logits (T, 2048) and code-predictor logits (T, 15, 2048), float32.

    The talker's logits are kept for the 2048 codebook-0 codes only: the control rows above them are
    never sampled (and EOS is not part of a teacher-forced frame)."""
    req = engine.request(text, **request)
    talker, predictor = engine.model.talker, engine.model.code_predictor
    prompt = build_prompt(engine.model, req.text_ids, req.cond, req.non_streaming_mode)
    T, L = codes.shape[0], prompt.embeds.shape[1]
    steps = []
    for t in range(T - 1):  # inputs after frame t, as in the frame loop
        text_vec = prompt.trailing[:, t : t + 1] if t < prompt.trailing.shape[1] else prompt.pad
        steps.append(frame_embedding(talker, predictor, codes[t : t + 1]) + text_vec)
    seq = torch.cat([prompt.embeds, *steps], dim=1)  # (1, L + T - 1, H)
    hidden = talker(seq, talker.new_cache(seq.shape[1]), 0)[0, L - 1 :]  # (T, H): states that pick c0
    codebook = predictor.lm_head[0].out_features  # 2048 codes per codebook
    talker_logits = talker.codec_head(hidden)[:, :codebook].float()
    rows = [hidden[:, None], talker.codec_embedding(codes[:, :1])]
    rows += [emb(codes[:, g + 1 : g + 2]) for g, emb in enumerate(predictor.codec_embedding[:-1])]
    out = predictor(torch.cat(rows, dim=1), predictor.new_cache(batch=T), 0)  # (T, 16, cp_dim)
    cp_logits = torch.stack([head(out[:, g + 1]) for g, head in enumerate(predictor.lm_head)], dim=1).float()
    return talker_logits, cp_logits


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _top1(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.argmax(-1) == b.argmax(-1)).float().mean())


def compare(engine: Engine, baseline: Engine, text: str, frames: int = 50, **request) -> Quality:
    """Quality of `engine` against the float32 `baseline` (same checkpoint) on `text`."""
    options = {**GREEDY, **request, "max_new_tokens": frames + 1}
    ref = baseline.synthesize(text, **options)
    codes = torch.from_numpy(ref.codes)
    t32, c32 = teacher_forced_logits(baseline, text, codes, **options)
    t, c = teacher_forced_logits(engine, text, codes, **options)
    ours = engine.synthesize(text, **options)
    audio = engine.decode(codes)
    noise = float(np.mean((audio - ref.audio) ** 2))
    snr = float("inf") if noise == 0 else 10 * np.log10(float(np.mean(ref.audio**2)) / noise)
    return Quality(
        _rel(t, t32), _top1(t, t32), _rel(c, c32), _top1(c, c32), float(np.mean(ours.codes == ref.codes)), snr
    )
