"""The code predictor: a 5-layer Qwen3 decoder that fills codebooks 1..15 of each frame.

Tensors only. Per frame it sees the talker's final hidden state and the codebook-0 embedding, then
one position per predicted code; its 17-position KV cache is reused (overwritten from position 0)
every frame. `codec_embedding[g]` embeds codebook g+1 at talker width; `lm_head[g]` predicts codebook g+1.
"""

from __future__ import annotations

import torch
from torch import nn

from .config import TransformerConfig
from .layers import Decoder, KVCache, table


class CodePredictor(Decoder):
    """The decoder stack (`Decoder`) with 15 codec embeddings (talker width, codebooks 1..15), 15
    heads and, where the widths differ (1.7B), the talker -> predictor projection."""

    def __init__(self, cfg: TransformerConfig, talker_dim: int, vocab: int, num_code_groups: int):
        super().__init__(cfg)
        self.cfg = cfg
        groups = num_code_groups - 1  # codebooks predicted here (15)
        self.codec_embedding = nn.ModuleList(table(vocab, talker_dim) for _ in range(groups))
        self.lm_head = nn.ModuleList(nn.Linear(cfg.hidden_size, vocab, bias=False) for _ in range(groups))
        # 1.7B: talker width 2048 -> predictor width 1024; 0.6B: same width, no weights.
        if talker_dim != cfg.hidden_size:
            self.small_to_mtp_projection = nn.Linear(talker_dim, cfg.hidden_size, bias=True)
        else:
            self.small_to_mtp_projection = nn.Identity()

    @property
    def num_groups(self) -> int:
        return len(self.lm_head)

    def new_cache(self, capacity: int | None = None, batch: int = 1) -> list[KVCache]:
        """The per-frame cache: [h, c0] then one position per predicted code (17 positions)."""
        return super().new_cache(self.num_groups + 2 if capacity is None else capacity, batch)

    def forward(self, x: torch.Tensor, cache: list[KVCache], start: int) -> torch.Tensor:
        """x (B, T, talker_dim) at positions [start, start+T) -> final-normed hidden (B, T, cp_dim)."""
        return self.decode(self.small_to_mtp_projection(x), cache, start)
