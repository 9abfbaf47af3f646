"""The talker: a Qwen3 decoder over summed text-track and codec-track embeddings.

Tensors only. It embeds text ids (`embed_text`: embedding + the 2-layer projection MLP) and codec ids
(`codec_embedding`), runs the decoder stack over a preallocated KV cache, and scores codebook 0 with
`codec_head`. Positions are plain 1-D RoPE: the checkpoint's interleaved M-RoPE receives three equal
position streams in every code path, which is exactly plain RoPE.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import TalkerConfig
from .layers import Decoder, KVCache, table


class TextProjection(nn.Module):
    """linear_fc2(silu(linear_fc1(x))): text width (2048) -> talker width H."""

    def __init__(self, text_dim: int, dim: int):
        super().__init__()
        self.linear_fc1 = nn.Linear(text_dim, text_dim, bias=True)
        self.linear_fc2 = nn.Linear(text_dim, dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.silu(self.linear_fc1(x)))


class Talker(Decoder):
    """The decoder stack (`Decoder`) with the text embedding and projection, the codec embedding
    (talker width) and the codebook-0 head."""

    def __init__(self, cfg: TalkerConfig):
        super().__init__(cfg.stack)
        self.cfg = cfg
        self.text_embedding = table(cfg.text_vocab_size, cfg.text_hidden_size)
        self.text_projection = TextProjection(cfg.text_hidden_size, cfg.stack.hidden_size)
        self.codec_embedding = table(cfg.vocab_size, cfg.stack.hidden_size)
        self.codec_head = nn.Linear(cfg.stack.hidden_size, cfg.vocab_size, bias=False)

    def embed_text(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (B, T) text token ids -> (B, T, H) text-track vectors."""
        return self.text_projection(self.text_embedding(ids))

    def forward(self, x: torch.Tensor, cache: list[KVCache], start: int, last: bool = False) -> torch.Tensor:
        """x (B, T, H) input vectors at positions [start, start+T) -> final-normed hidden (B, T, H),
        or the last position's (B, 1, H) where `last` (`Decoder.decode`)."""
        return self.decode(x, cache, start, last)
