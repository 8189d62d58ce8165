"""LayerNorm and RMSNorm, selected by --normalization."""

import torch
from torch import nn

from megalite.model.config import GPTConfig
from megalite.tensor_parallel.params import mark_sequence_parallel


class RMSNorm(nn.Module):
    """Zhang & Sennrich 2019: x / rms(x) * weight, no mean subtraction and no bias.
    Computed in fp32 whatever the activation dtype, because the mean of squares of bf16
    activations loses the precision the normalisation exists to provide."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


def build_norm(config: GPTConfig) -> nn.Module:
    if config.normalization == "RMSNorm":
        norm = RMSNorm(config.hidden_size, config.norm_epsilon)
    else:
        norm = nn.LayerNorm(config.hidden_size, eps=config.norm_epsilon)
    for param in norm.parameters():
        # Under SP each rank's norm sees a different sequence shard: its grads are partial
        # sums to all-reduce across the TP group.
        mark_sequence_parallel(param, config.sequence_parallel)
    return norm
