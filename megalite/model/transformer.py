"""The pre-norm transformer layer: x + attn(norm(x)), then x + mlp(norm(x))."""

import torch
import torch.nn.functional as F
from torch import nn

from megalite.model.attention import SelfAttention
from megalite.model.config import GPTConfig
from megalite.model.norms import build_norm


class MLP(nn.Module):
    """GeLU MLP, or SwiGLU (Shazeer 2020) with a separate gate projection so the up and
    gate weights are each split by rows under tensor parallelism."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        h, f, bias = config.hidden_size, config.ffn_hidden_size, config.add_bias_linear
        self.swiglu = config.swiglu
        self.linear_fc1 = nn.Linear(h, f, bias=bias)
        self.linear_fc1_gate = nn.Linear(h, f, bias=bias) if config.swiglu else None
        self.linear_fc2 = nn.Linear(f, h, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            return self.linear_fc2(F.silu(self.linear_fc1_gate(x)) * self.linear_fc1(x))
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class TransformerLayer(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.input_layernorm = build_norm(config)
        self.self_attention = SelfAttention(config)
        self.pre_mlp_layernorm = build_norm(config)
        self.mlp = MLP(config)
        self.dropout = nn.Dropout(config.hidden_dropout)

    def forward(self, x: torch.Tensor, rotary_angles: torch.Tensor | None) -> torch.Tensor:
        x = x + self.dropout(self.self_attention(self.input_layernorm(x), rotary_angles))
        return x + self.dropout(self.mlp(self.pre_mlp_layernorm(x)))
