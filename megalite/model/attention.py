"""Causal self-attention with multi-head or grouped-query heads.

The fused QKV projection's output rows are laid out per query group:
[q heads of group 0, k_0, v_0, q heads of group 1, k_1, v_1, ...] (Megatron's layout).
Splitting those rows into contiguous blocks therefore hands whole query groups to each
tensor-parallel rank, so the same weight tensor serves every TP size.
"""

import torch
import torch.nn.functional as F
from torch import nn

from megalite.model.config import GPTConfig
from megalite.model.rotary import apply_rotary


class SelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        c = config
        self.heads_per_group = c.num_attention_heads // c.num_query_groups
        qkv_size = c.query_projection_size + 2 * c.kv_projection_size
        self.linear_qkv = nn.Linear(c.hidden_size, qkv_size, bias=c.add_bias_linear)
        self.linear_proj = nn.Linear(c.query_projection_size, c.hidden_size,
                                     bias=c.add_bias_linear)

    def forward(self, x: torch.Tensor, rotary_angles: torch.Tensor | None) -> torch.Tensor:
        """x: [seq, batch, hidden] -> [seq, batch, hidden]."""
        s, b, _ = x.shape
        c = self.config
        qkv = self.linear_qkv(x).view(s, b, c.num_query_groups, self.heads_per_group + 2,
                                      c.kv_channels)
        q = qkv[:, :, :, :-2].reshape(s, b, c.num_attention_heads, c.kv_channels)
        k, v = qkv[:, :, :, -2], qkv[:, :, :, -1]
        if rotary_angles is not None:
            q, k = apply_rotary(q, rotary_angles), apply_rotary(k, rotary_angles)
        # SDPA wants [batch, heads, seq, dim]; enable_gqa shares each K/V head across its
        # group inside the kernel instead of materialising repeated K/V.
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True,
            dropout_p=c.attention_dropout if self.training else 0.0,
            enable_gqa=c.num_query_groups != c.num_attention_heads)
        out = out.permute(2, 0, 1, 3).reshape(s, b, c.query_projection_size)
        return self.linear_proj(out)
