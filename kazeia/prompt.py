"""Text, voice and options -> the talker's prefill vectors and its trailing text track.

This is the one place that knows the dual-track prompt layouts (reference spec §5.2-5.3). Each
position's input is the sum of a text-track vector (`E_t`, the talker's projected text embedding)
and a codec-track vector (`E_c`, a codec-embedding row). The text ids come from `text.py` as the
full assistant template: 3 role ids, the text tokens, 5 closing ids.

Layouts (`non_streaming_mode`):
  True  - all text tokens sit in the prefill, each over `codec_pad`; every decode step adds tts_pad.
  False - only the first text token sits in the prefill; the rest, then tts_eos, are added one per
          generated frame (the trailing text track), then tts_pad.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import ModelConfig
from .talker import Talker

ROLE_IDS = 3  # <|im_start|> assistant \n
CLOSING_IDS = 5  # <|im_end|> \n <|im_start|> assistant \n


@dataclass(frozen=True)
class Conditioning:
    """Resolved voice conditioning of one request (ids only; see `engine.py` for name lookup)."""

    language_id: int | None  # codec row of the language (after the dialect rule), None for auto
    speaker_id: int | None  # codec row of a preset speaker, None for none
    instruct_ids: tuple[int, ...] | None  # full instruct template ids, None for none


@dataclass
class Prompt:
    """Talker inputs of one request."""

    embeds: torch.Tensor  # (1, L, H) prefill vectors
    trailing: torch.Tensor  # (1, M, H) text-track vectors added to decode steps 0..M-1
    pad: torch.Tensor  # (1, 1, H) tts_pad text vector, added once the trailing track is used up


def _ids(values, device) -> torch.Tensor:
    return torch.tensor([list(values)], dtype=torch.long, device=device)


@torch.inference_mode()
def build_prompt(
    talker: Talker, cfg: ModelConfig, text_ids: list[int], cond: Conditioning, non_streaming_mode: bool
) -> Prompt:
    """Lay out one request. `text_ids` is the full assistant template (role + text + closing ids)."""
    t = cfg.talker
    device = talker.codec_embedding.weight.device
    ids = _ids(text_ids, device)
    if ids.shape[1] <= ROLE_IDS + CLOSING_IDS:
        raise ValueError("text produced no tokens")
    E_c = talker.codec_embedding
    bos, eos, pad = talker.embed_text(_ids([cfg.tts_bos_id, cfg.tts_eos_id, cfg.tts_pad_id], device)).chunk(3, dim=1)

    if cond.language_id is None:
        control = [t.codec_nothink_id, t.codec_think_bos_id, t.codec_think_eos_id]
    else:
        control = [t.codec_think_id, t.codec_think_bos_id, cond.language_id, t.codec_think_eos_id]
    if cond.speaker_id is not None:
        control.append(cond.speaker_id)
    codec = E_c(_ids(control + [t.codec_pad_id, t.codec_bos_id], device))  # (1, n, H)
    n = codec.shape[1]

    # Codec positions 0..n-2 over tts_pad (and tts_bos on the last); codec_bos is held back.
    control_part = torch.cat((pad.expand(-1, n - 2, -1), bos), dim=1) + codec[:, :-1]
    parts = [talker.embed_text(ids[:, :ROLE_IDS]), control_part]
    if cond.instruct_ids:
        parts.insert(0, talker.embed_text(_ids(cond.instruct_ids, device)))

    text = ids[:, ROLE_IDS:-CLOSING_IDS]  # (1, m)
    if non_streaming_mode:
        text_track = torch.cat((talker.embed_text(text), eos), dim=1)
        parts.append(text_track + E_c(_ids([t.codec_pad_id] * (text.shape[1] + 1), device)))
        parts.append(pad + E_c(_ids([t.codec_bos_id], device)))
        trailing = pad
    else:
        parts.append(talker.embed_text(text[:, :1]) + codec[:, -1:])
        trailing = torch.cat((talker.embed_text(text[:, 1:]), eos), dim=1)
    return Prompt(embeds=torch.cat(parts, dim=1), trailing=trailing, pad=pad)
