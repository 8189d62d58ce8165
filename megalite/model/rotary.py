"""Rotary position embedding (Su et al. 2021), in the non-interleaved "rotate half" form
Megatron and HF Llama use, so exported weights need no permutation. Every layer reads the
one cos/sin table of its chunk (GPTModel.rope_table), the rows of its positions."""

import torch


def rotary_frequencies(seq_length: int, rotary_dim: int, base: int, device=None) -> torch.Tensor:
    """Angles [seq, rotary_dim]: position p times base^(-2i/rotary_dim), each half repeated."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, device=device,
                                            dtype=torch.float32) / rotary_dim))
    angles = torch.outer(torch.arange(seq_length, device=device, dtype=torch.float32), inv_freq)
    return torch.cat([angles, angles], dim=-1)


def rotary_table(angles: torch.Tensor) -> torch.Tensor:
    """[seq, 2, rotary_dim]: the cosines and sines of `angles`, in fp32 (see
    GPTModel.rope_table for why not in the activation dtype)."""
    return torch.stack([angles.cos(), angles.sin()], dim=1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate the first rotary_dim channels of x [seq, batch, heads, dim] by the rows of
    `table` (rotary_table) for its seq positions, [seq, 2, rotary_dim], or per sample
    [seq, batch, 2, rotary_dim] (positions restarting in each document); the rest (with
    --rotary-percent < 1) pass through unchanged. Computed in fp32, returned in x's dtype."""
    rot_dim = table.shape[-1]
    if table.dim() == 4:
        cos, sin = table[:, :, None, 0], table[:, :, None, 1]
    else:
        cos, sin = table[:, None, None, 0], table[:, None, None, 1]
    x_rot = x[..., :rot_dim].float()
    x_rot = (x_rot * cos + _rotate_half(x_rot) * sin).to(x.dtype)
    if rot_dim == x.shape[-1]:
        return x_rot
    return torch.cat([x_rot, x[..., rot_dim:]], dim=-1)
