"""LayerNorm and RMSNorm, selected by --normalization: torch's fused kernels
(F.layer_norm, F.rms_norm), each returning its input's dtype."""

import torch
import torch.nn.functional as F
from torch import nn

from megalite.config import GPTConfig
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
        y = F.rms_norm(x.float(), self.weight.shape, self.weight.float(), self.eps)
        return y.to(x.dtype)


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm whose output has its input's dtype. CUDA autocast runs layer_norm in
    fp32 and returns fp32 (CPU autocast does not): cast back, or the tensor-parallel
    collectives and GEMM inputs after the norm would carry fp32, twice the bytes."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).to(x.dtype)


def build_norm(config: GPTConfig, size: int | None = None,
               partial_grad: bool | None = None) -> nn.Module:
    """A norm over the last `size` channels (default hidden_size). `partial_grad`: whether
    each TP rank's gradient is a partial sum to all-reduce over TP (params.py); by default,
    under SP, where the norm is fed this rank's sequence shard."""
    kind = RMSNorm if config.normalization == "RMSNorm" else LayerNorm
    norm = kind(size or config.hidden_size, config.norm_epsilon)
    for param in norm.parameters():
        mark_sequence_parallel(param, config.sequence_parallel if partial_grad is None
                               else partial_grad)
    return norm
