"""Build the talker and code predictor of a checkpoint and load `model.safetensors` into them.

Modules are built on the meta device and receive the memory-mapped tensors through one rename table
(released name prefix -> module name prefix); loading is strict. Speaker-encoder tensors (Base
checkpoints) are recognised and left for the voice-clone path.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from .checkpoint import assign, load_tensors
from .code_predictor import CodePredictor
from .config import CheckpointError, ModelConfig
from .talker import Talker

# Released prefix -> module prefix, first match wins.
RENAMES = (
    ("talker.code_predictor.model.", "code_predictor."),
    ("talker.code_predictor.", "code_predictor."),
    ("talker.model.", "talker."),
    ("talker.", "talker."),
)
SKIPPED_PREFIXES = ("speaker_encoder.",)  # Base checkpoints only; not used for synthesis from text


class TTSModel(nn.Module):
    """Talker + code predictor of one checkpoint."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.talker = Talker(cfg.talker)
        self.code_predictor = CodePredictor(
            cfg.code_predictor, cfg.talker.stack.hidden_size, cfg.code_predictor_vocab, cfg.talker.num_code_groups
        )

    @classmethod
    def load(cls, cfg: ModelConfig, path: Path, device: torch.device | str, dtype: torch.dtype) -> TTSModel:
        with torch.device("meta"):
            model = cls(cfg)
        tensors = rename(load_tensors(path), str(path))
        assign(model, tensors, str(path), device=device, dtype=dtype, released_name=released_name)
        return model.eval()


def rename(tensors: Mapping[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    """Map released tensor names onto module names; an unknown name is an error naming it."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name.startswith(SKIPPED_PREFIXES):
            continue
        for released, ours in RENAMES:
            if name.startswith(released):
                out[ours + name[len(released) :]] = tensor
                break
        else:
            raise CheckpointError(f"{where}: unexpected tensor {name}")
    return out


def released_name(name: str) -> str:
    """Inverse of `rename`, for error messages: module name -> released tensor name."""
    head, _, rest = name.partition(".")
    if head == "talker":
        top = rest.startswith(("text_projection.", "codec_head."))
        return ("talker." if top else "talker.model.") + rest
    if head == "code_predictor":
        top = rest.startswith(("lm_head.", "small_to_mtp_projection."))
        return ("talker.code_predictor." if top else "talker.code_predictor.model.") + rest
    return name
