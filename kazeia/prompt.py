"""Text, voice and options -> the talker's prefill vectors and its trailing text track.

This is the one place that knows the dual-track prompt layouts (reference spec §5.2-5.3). Each
position's input is the sum of a text-track vector (`E_t`, the talker's projected text embedding)
and a codec-track vector (`E_c`, a codec-embedding row). The text ids come from `text.py` as the
full assistant template: 3 role ids, the text tokens, 5 closing ids.

Layouts (`non_streaming_mode`):
  True  - all text tokens sit in the prefill, each over `codec_pad`; every decode step adds tts_pad.
  False - only the first text token sits in the prefill; the rest, then tts_eos, are added one per
          generated frame (the trailing text track), then tts_pad.

Base (voice clone) checkpoints put the reference's x-vector where a preset speaker's codec row
goes. In ICL mode the reference transcript and the target text form one text track, the
reference's code frames one codec track (after codec_bos), laid side by side (`False`) or one after
the other (`True`), and the talker continues the reference frames (spec §5.3 d). The reference
package then decodes reference + generated frames together and cuts the reference part off at a
float-rounded sample (`voices.icl_cut`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .code_predictor import CodePredictor
from .config import ModelConfig
from .errors import RequestError
from .model import TTSModel
from .talker import Talker
from .text import CLOSING_IDS, ROLE_IDS

if TYPE_CHECKING:
    from .voices import Voice


@dataclass(frozen=True)
class Conditioning:
    """Resolved voice conditioning of one request (ids, and a cloned voice; see kazeia/request.py
    for the name lookup)."""

    language_id: int | None  # codec row of the language (after the dialect rule), None for auto
    speaker_id: int | None  # codec row of a preset speaker, None for none
    instruct_ids: tuple[int, ...] | None  # full instruct template ids, None for none
    voice: Voice | None = None  # Base checkpoints: its x-vector (and ICL reference) instead of a speaker
    ref_text_ids: tuple[int, ...] | None = None  # ICL voices: the reference transcript's tokens (no template ids)

    @property
    def reference_codes(self) -> torch.Tensor | None:
        """(frames, 16) an ICL voice's reference codes, which the talker continues (spec §5.3 d);
        None for other voices."""
        return None if self.voice is None else self.voice.ref_codes

    @property
    def icl(self) -> bool:
        return self.reference_codes is not None


@dataclass
class Prompt:
    """Talker inputs of one request."""

    embeds: torch.Tensor  # (1, L, H) prefill vectors
    trailing: torch.Tensor  # (1, M, H) text-track vectors added to decode steps 0..M-1
    pad: torch.Tensor  # (1, 1, H) tts_pad text vector, added once the trailing track is used up
    eos: torch.Tensor  # (1, 1, H) tts_eos text vector
    # Leading positions of `embeds` that come from the voice alone (instruct, role and control ids,
    # the speaker row or x-vector), never from the text: the same in every request of that voice
    # (frame.FrameStep.prefill keeps the talker's keys and values over them).
    voiced: int = 0
    # Live text (kazeia/live.py): step -> text vector, waiting for text to arrive; None = stop.
    text_source: Callable[[int], torch.Tensor | None] | None = None

    def text_at(self, step: int) -> torch.Tensor | None:
        """The text-track vector added to decode step `step` (None: stopped while waiting for text)."""
        if self.text_source is not None:
            return self.text_source(step)
        return self.trailing[:, step : step + 1] if step < self.trailing.shape[1] else self.pad


def embed_tokens(talker: Talker, ids: torch.Tensor) -> torch.Tensor:
    """(1, m) text ids -> (1, m, H), one token at a time: live text can only embed tokens as they
    arrive, and embedding the whole-text trailing track the same way makes both bit-identical."""
    if ids.shape[1] == 0:
        return talker.embed_text(ids)
    return torch.cat([talker.embed_text(ids[:, i : i + 1]) for i in range(ids.shape[1])], dim=1)


def frame_embedding(talker: Talker, predictor: CodePredictor, codes: torch.Tensor) -> torch.Tensor:
    """codes (T, 16) -> (T, 1, H): per frame, the sum of its codebook-0 row and 15 predictor rows
    (the codec-track vector of a generated or reference frame)."""
    rows = [talker.codec_embedding(codes[:, :1])]
    rows += [emb(codes[:, g + 1 : g + 2]) for g, emb in enumerate(predictor.codec_embedding)]
    return torch.cat(rows, dim=1).sum(1, keepdim=True)


def _ids(values, device) -> torch.Tensor:
    return torch.tensor([list(values)], dtype=torch.long, device=device)


def needs_whole_text(cond: Conditioning, non_streaming_mode: bool) -> bool:
    """Whether the layout puts all of the text in the prompt (live text must have ended first):
    `non_streaming_mode=True`, and ICL voices, whose text track is laid beside the reference's codes."""
    return non_streaming_mode or cond.icl


def has_text(text_ids) -> bool:
    """Whether an assistant template holds any text token between its role and closing ids."""
    return len(text_ids) > ROLE_IDS + CLOSING_IDS


def prompt_positions(
    cond: Conditioning, text_tokens: int, non_streaming_mode: bool, reference: tuple[int, int] | None = None
) -> int:
    """Talker positions the prompt of `build_prompt` takes for `text_tokens` text tokens (those
    between the template's role and closing ids): known before any tensor is made, to bound a
    request by the model's positions. `reference`: (transcript tokens, frames) of the in-context
    reference, when not the voice's own (a long text's previous segment)."""
    control = (3 if cond.language_id is None else 4) + (cond.speaker_id is not None) + (cond.voice is not None)
    head = len(cond.instruct_ids or ()) + ROLE_IDS + control + 1  # instruct, role, control rows, codec_pad
    if reference is None and cond.reference_codes is not None:
        reference = (len(cond.ref_text_ids or ()), cond.reference_codes.shape[0])
    if reference is not None:
        text_track = reference[0] + text_tokens + 1  # transcript + text + tts_eos
        codec_track = 1 + reference[1]  # codec_bos + the reference frames
        return head + (text_track + codec_track if non_streaming_mode else codec_track)
    return head + (text_tokens + 2 if non_streaming_mode else 1)


@torch.inference_mode()
def build_prompt(model: TTSModel, text_ids, cond: Conditioning, non_streaming_mode: bool) -> Prompt:
    """Lay out one request. `text_ids` is the full assistant template (role + text + closing ids)."""
    talker, predictor, cfg = model.talker, model.code_predictor, model.cfg
    t = cfg.talker
    device = talker.codec_embedding.weight.device
    ids = _ids(text_ids, device)
    if not has_text(text_ids):
        raise RequestError("text", "text produced no tokens")
    E_c = talker.codec_embedding
    bos, eos, pad = talker.embed_text(_ids([cfg.tts_bos_id, cfg.tts_eos_id, cfg.tts_pad_id], device)).chunk(3, dim=1)

    if cond.language_id is None:
        control = [t.codec_nothink_id, t.codec_think_bos_id, t.codec_think_eos_id]
    else:
        control = [t.codec_think_id, t.codec_think_bos_id, cond.language_id, t.codec_think_eos_id]
    if cond.speaker_id is not None:
        control.append(cond.speaker_id)
    codec = E_c(_ids(control + [t.codec_pad_id, t.codec_bos_id], device))  # (1, n, H)
    if cond.voice is not None:  # the x-vector goes where a speaker row would
        x_vector = cond.voice.x_vector.to(device=device, dtype=codec.dtype).view(1, 1, -1)
        codec = torch.cat((codec[:, :-2], x_vector, codec[:, -2:]), dim=1)
    n = codec.shape[1]

    # Codec positions 0..n-2 over tts_pad (and tts_bos on the last); codec_bos is held back.
    control_part = torch.cat((pad.expand(-1, n - 2, -1), bos), dim=1) + codec[:, :-1]
    parts = [talker.embed_text(ids[:, :ROLE_IDS]), control_part]
    if cond.instruct_ids:
        parts.insert(0, talker.embed_text(_ids(cond.instruct_ids, device)))

    voiced = sum(part.shape[1] for part in parts)
    text = ids[:, ROLE_IDS:-CLOSING_IDS]  # (1, m)
    if cond.icl:
        icl, trailing = _icl(talker, predictor, cfg, cond, text, (eos, pad), non_streaming_mode)
        parts.append(icl)
    elif non_streaming_mode:
        text_track = torch.cat((talker.embed_text(text), eos), dim=1)
        parts.append(text_track + E_c(_ids([t.codec_pad_id] * (text.shape[1] + 1), device)))
        parts.append(pad + E_c(_ids([t.codec_bos_id], device)))
        trailing = pad
    else:
        parts.append(talker.embed_text(text[:, :1]) + codec[:, -1:])
        trailing = torch.cat((embed_tokens(talker, text[:, 1:]), eos), dim=1)
    return Prompt(embeds=torch.cat(parts, dim=1), trailing=trailing, pad=pad, eos=eos, voiced=voiced)


def _icl(
    talker: Talker, predictor: CodePredictor, cfg: ModelConfig, cond: Conditioning, text, eos_pad, non_streaming_mode
):
    """ICL positions after the prefix, and the trailing text track (spec §5.3 d).

    Text track: reference transcript + target text + tts_eos (T1 vectors); codec track: codec_bos,
    then each reference frame's summed code embeddings (T2 vectors). `True` puts the text over
    codec_pad, then the codec track over tts_pad; `False` adds the tracks position by position,
    the longer text continuing as the trailing track, a shorter one padded with tts_pad.
    """
    eos, pad = eos_pad
    t, device = cfg.talker, text.device
    ref = _ids(_required(cond.ref_text_ids), device)
    text_track = torch.cat((talker.embed_text(torch.cat((ref, text), dim=1)), eos), dim=1)  # (1, T1, H)
    codes = _required(cond.reference_codes).to(device)  # (T, 16)
    frames = frame_embedding(talker, predictor, codes).transpose(0, 1)  # (1, T, H)
    codec_track = torch.cat((talker.codec_embedding(_ids([t.codec_bos_id], device)), frames), dim=1)  # (1, T2, H)
    t1, t2 = text_track.shape[1], codec_track.shape[1]
    if non_streaming_mode:
        over_pad = text_track + talker.codec_embedding(_ids([t.codec_pad_id] * t1, device))
        return torch.cat((over_pad, codec_track + pad), dim=1), pad
    if t1 > t2:
        return text_track[:, :t2] + codec_track, text_track[:, t2:]
    return torch.cat((text_track, pad.expand(-1, t2 - t1, -1)), dim=1) + codec_track, pad


def _required(value):
    if value is None:
        raise ValueError("an ICL prompt needs the voice's reference codes and transcript tokens")
    return value
