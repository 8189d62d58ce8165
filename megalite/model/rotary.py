"""Rotary position embedding (Su et al. 2021), in the non-interleaved "rotate half" form
Megatron and HF Llama use, so exported weights need no permutation. Every layer reads the
one cos/sin table of its chunk (GPTModel.rope_table), the rows of its positions; multi-latent
attention's RoPE part its own (model_rotary_table, YaRN's where --rope-type yarn)."""

import math

import torch

from megalite.config import GPTConfig


def uses_rotary(config: GPTConfig) -> bool:
    """Whether positions come from rotary angles over --seq-length (multi-latent attention's
    RoPE part has them whatever --position-embedding-type says)."""
    return config.position_embedding_type == "rope" or config.multi_latent_attention


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
    # cos and sin [seq, batch or 1, 1, rotary_dim], broadcast over the heads (and samples)
    cos, sin = (table.unsqueeze(-3) if table.dim() == 4 else table[:, None, None]).unbind(-2)
    x_rot = x[..., :rot_dim].float()
    x_rot = (x_rot * cos + _rotate_half(x_rot) * sin).to(x.dtype)
    if rot_dim == x.shape[-1]:
        return x_rot
    return torch.cat([x_rot, x[..., rot_dim:]], dim=-1)


# YaRN (Peng et al. 2023, §3.2-3.4) as DeepSeek-V3 and Megatron's YarnRotaryEmbedding build it.

def yarn_mscale(scaling_factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature term, 0.1 * mscale * ln(s) + 1 (1 without extension)."""
    return 1.0 if scaling_factor <= 1 else 0.1 * mscale * math.log(scaling_factor) + 1.0


def yarn_frequencies(seq_length: int, rotary_dim: int, base: float, scaling_factor: float,
                     original_max_positions: int, beta_fast: float, beta_slow: float,
                     device=None) -> torch.Tensor:
    """Angles [seq, rotary_dim] as rotary_frequencies, with YaRN's blend of each frequency:
    dimensions that turn more than beta_fast times over the original context keep theirs,
    those under beta_slow turns are divided by the scaling factor (interpolated), a linear
    ramp between (the correction range rounded outwards, as Megatron and DeepSeek do)."""
    def dim_of(turns: float) -> float:
        return (rotary_dim * math.log(original_max_positions / (turns * 2 * math.pi))
                / (2 * math.log(base)))
    low = max(math.floor(dim_of(beta_fast)), 0)
    high = min(math.ceil(dim_of(beta_slow)), rotary_dim - 1)
    high = high + 0.001 if low == high else high  # no zero-width ramp
    extra = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, device=device,
                                         dtype=torch.float32) / rotary_dim))
    ramp = ((torch.arange(rotary_dim // 2, device=device, dtype=torch.float32) - low)
            / (high - low)).clamp(0, 1)
    keep = 1.0 - ramp  # 1: extrapolate (the original frequency), 0: interpolate
    inv_freq = extra / scaling_factor * (1 - keep) + extra * keep
    angles = torch.outer(torch.arange(seq_length, device=device, dtype=torch.float32), inv_freq)
    return torch.cat([angles, angles], dim=-1)


def model_rotary_table(config: GPTConfig, device=None) -> torch.Tensor:
    """The model's cos/sin table [seq_length, 2, rotary dim]: of its heads' first
    kv_channels x --rotary-percent channels, or of multi-latent attention's RoPE part
    (qk_pos_emb_head_dim channels), YaRN's there with --rope-type yarn (times its cos/sin
    factor mscale / mscale_all_dim, both through yarn_mscale)."""
    c, mla = config, config.multi_latent_attention
    dim = c.qk_pos_emb_head_dim if mla else int(c.kv_channels * c.rotary_percent)
    if c.rope_type == "rope" or not mla:
        return rotary_table(rotary_frequencies(c.seq_length, dim, c.rotary_base, device))
    angles = yarn_frequencies(c.seq_length, dim, c.rotary_base, c.rotary_scaling_factor,
                              c.yarn_original_max_position_embeddings, c.yarn_beta_fast,
                              c.yarn_beta_slow, device)
    factor = (yarn_mscale(c.rotary_scaling_factor, c.mscale)
              / yarn_mscale(c.rotary_scaling_factor, c.mscale_all_dim))
    return rotary_table(angles) * factor


def mla_softmax_scale(config: GPTConfig) -> float:
    """Multi-latent attention's softmax scale: yarn_mscale(s, mscale_all_dim)^2 over the
    square root of the whole query/key head (no-RoPE and RoPE parts), Megatron's."""
    c = config
    head = c.qk_head_dim + c.qk_pos_emb_head_dim
    return yarn_mscale(c.rotary_scaling_factor, c.mscale_all_dim) ** 2 / math.sqrt(head)


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """MLA's RoPE part rotates channel pairs (2i, 2i+1) (DeepSeek's interleaved layout):
    the even channels then the odd ones, for apply_rotary's halves. The result stays in this
    order: q and k are permuted alike, and their dot product does not see it (Megatron)."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
