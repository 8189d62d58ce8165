"""Rotary position embedding (Su et al. 2021), in the non-interleaved "rotate half" form
Megatron and HF Llama use, so exported weights need no permutation."""

import torch


def rotary_frequencies(seq_length: int, rotary_dim: int, base: int,
                       device=None) -> torch.Tensor:
    """Angles [seq, rotary_dim]: position p times base^(-2i/rotary_dim), each half repeated."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, device=device,
                                            dtype=torch.float32) / rotary_dim))
    angles = torch.outer(torch.arange(seq_length, device=device, dtype=torch.float32), inv_freq)
    return torch.cat([angles, angles], dim=-1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Rotate the first angles.shape[-1] channels of x [seq, batch, heads, dim];
    the rest (with --rotary-percent < 1) pass through unchanged."""
    rot_dim = angles.shape[-1]
    angles = angles[:, None, None, :]
    x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    x_rot = (x_rot.float() * angles.cos() + _rotate_half(x_rot.float()) * angles.sin())
    return torch.cat([x_rot.to(x.dtype), x_pass], dim=-1)
