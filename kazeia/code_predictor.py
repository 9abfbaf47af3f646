"""The code predictor: a 5-layer Qwen3 decoder that fills codebooks 1..15 of each frame.

Tensors only. Per frame it sees the talker's final hidden state and the codebook-0 embedding, then
one position per predicted code; its 17-position KV cache is reused (overwritten from position 0)
every frame. `embed(g, ids)` embeds codebook g+1 at talker width; `heads[g]` predicts codebook g+1.
"""

from __future__ import annotations

import torch
from torch import nn

from .config import TransformerConfig
from .layers import Block, KVCache, RMSNorm, Rotary, cache_dtype, run_stack


class CodePredictor(nn.Module):
    def __init__(self, cfg: TransformerConfig, talker_dim: int, vocab: int, num_code_groups: int):
        super().__init__()
        self.cfg = cfg
        groups = num_code_groups - 1  # codebooks predicted here (15)
        self.codec_embedding = nn.ModuleList(nn.Embedding(vocab, talker_dim) for _ in range(groups))
        self.layers = nn.ModuleList(
            Block(
                cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size, cfg.rms_norm_eps
            )
            for _ in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.ModuleList(nn.Linear(cfg.hidden_size, vocab, bias=False) for _ in range(groups))
        # 1.7B: talker width 2048 -> predictor width 1024; 0.6B: same width, no weights.
        if talker_dim != cfg.hidden_size:
            self.small_to_mtp_projection = nn.Linear(talker_dim, cfg.hidden_size, bias=True)
        else:
            self.small_to_mtp_projection = nn.Identity()
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta)

    @property
    def num_groups(self) -> int:
        return len(self.lm_head)

    def new_cache(self, batch: int = 1) -> list[KVCache]:
        w = self.norm.weight
        capacity = self.num_groups + 2  # [h, c0] then one position per predicted code (17)
        c = self.cfg
        return [
            KVCache(batch, c.num_kv_heads, capacity, c.head_dim, w.device, cache_dtype(w.dtype, w.device))
            for _ in self.layers
        ]

    def forward(self, x: torch.Tensor, cache: list[KVCache], start: int) -> torch.Tensor:
        """x (B, T, talker_dim) at positions [start, start+T) -> final-normed hidden (B, T, cp_dim)."""
        x = self.small_to_mtp_projection(x)
        rope = self.rotary.span(start, x.shape[1], x.dtype, x.device)
        return run_stack(self.layers, self.norm, x, rope, cache, start)
