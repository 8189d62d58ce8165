"""Multi-latent attention (MLA; DeepSeek-V2 §2.1, DeepSeek-V3 §2.1.1), Megatron's
MLASelfAttention with its parameter names.

Per token h (hidden size d), n heads:
    c_q  = linear_q_down_proj(h)                [q_lora_rank]          (or no query latent:
    q    = linear_q_up_proj(q_layernorm(c_q))   [n, qk_head_dim + r]    q = linear_q_proj(h))
    c_kv, k_pe = linear_kv_down_proj(h)         [kv_lora_rank], [r]    (r = qk_pos_emb_head_dim)
    k_nope, v = linear_kv_up_proj(kv_layernorm(c_kv))   [n, qk_head_dim], [n, v_head_dim]
    q = [q_nope, RoPE(q_pe)], k = [k_nope, RoPE(k_pe)]  (k_pe: one part shared by all heads)
    out = linear_proj(softmax(q k^T * scale) v)
RoPE rotates only the r-channel part ("decoupled RoPE"), so the latent c_kv itself carries no
position and is what a KV cache can hold. The RoPE part is DeepSeek's interleaved pairs
(rotary.deinterleave); YaRN's cos/sin factor is in the table, its temperature in the scale
(rotary.mla_softmax_scale).

Tensor parallelism (Shoeybi et al. §3) splits the heads: the up-projections and
linear_q_proj are column-parallel, linear_proj row-parallel. The down-projections and the
latent norms are replicated on each TP rank (Megatron's TE spec: parallel_mode
"duplicated"); the column-parallel up-projections after them make their input gradients
whole (f), so their weight gradients are partial sums over TP exactly where their input is
this rank's sequence shard (SP), as a norm's. The shared k_pe feeds only this rank's heads:
f (or, under SP, the all-gather whose backward reduce-scatters) sums its gradient over TP.
"""

import torch
from torch import nn

from megalite.config import GPTConfig
from megalite.documents import Documents
from megalite.model.attention import CoreAttention
from megalite.model.norms import build_norm
from megalite.model.rotary import apply_rotary, deinterleave, mla_softmax_scale
from megalite.parallel_state import group_size
from megalite.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear,
                                             column_parallel_input, parameter)
from megalite.tensor_parallel.weight_grad import LinearStep, linear


class DuplicatedLinear(nn.Module):
    """Y = X A^T, the whole A on every TP rank, applied to this rank's input (its sequence
    shard under SP, where its gradient is then a partial sum over TP: `partial_grad`)."""

    def __init__(self, input_size: int, output_size: int, partial_grad: bool):
        super().__init__()
        self.weight = parameter(output_size, input_size, partition_dim=None,
                                sequence_parallel=partial_grad)
        self.linear_step = LinearStep()  # until the step running the model installs its own

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, None, self.linear_step)


class MultiLatentAttention(CoreAttention):
    def __init__(self, config: GPTConfig, tp_group=None, rng_tracker=None, cp_group=None):
        super().__init__(config, tp_group, rng_tracker, cp_group, mla_softmax_scale(config))
        c = config
        self.tp_group = tp_group
        self.heads = c.num_attention_heads // group_size(tp_group)
        self.q_head_dim = c.qk_head_dim + c.qk_pos_emb_head_dim
        column = dict(group=tp_group, bias=False, sequence_parallel=c.sequence_parallel)
        sp = c.sequence_parallel
        q_size = c.num_attention_heads * self.q_head_dim
        if c.q_lora_rank is None:
            self.linear_q_proj = ColumnParallelLinear(c.hidden_size, q_size, **column)
        else:
            self.linear_q_down_proj = DuplicatedLinear(c.hidden_size, c.q_lora_rank, sp)
            self.linear_q_up_proj = ColumnParallelLinear(c.q_lora_rank, q_size, **column)
        self.linear_kv_down_proj = DuplicatedLinear(
            c.hidden_size, c.kv_lora_rank + c.qk_pos_emb_head_dim, sp)
        self.linear_kv_up_proj = ColumnParallelLinear(
            c.kv_lora_rank, c.num_attention_heads * (c.qk_head_dim + c.v_head_dim), **column)
        if c.qk_layernorm:  # the latent norms (Megatron's meaning of --qk-layernorm for MLA)
            if c.q_lora_rank is not None:
                self.q_layernorm = build_norm(c, c.q_lora_rank)
            self.kv_layernorm = build_norm(c, c.kv_lora_rank)
        self.linear_proj = RowParallelLinear(c.num_attention_heads * c.v_head_dim,
                                             c.hidden_size, group=tp_group,
                                             bias=c.add_bias_linear, sequence_parallel=sp)

    def forward(self, x: torch.Tensor, rope_table: torch.Tensor, kv_cache=None,
                documents: Documents | None = None) -> torch.Tensor:
        """x: [seq, batch, hidden] (a sequence shard under SP) -> same shape; `rope_table`:
        rotary.model_rotary_table's rows of x's positions ([seq, 2, r], or per sample
        [seq, batch, 2, r] with reset positions); `documents` as SelfAttention's.
        `kv_cache` (generation: inference.LayerKVCache) holds earlier positions' latents and
        rotated k_pe, not their K and V: x's are appended, and K, V rebuilt from all."""
        q, kv_latent, k_pe = self.query_and_latent(x, rope_table)
        if kv_cache is not None:
            kv_latent, k_pe = (t.transpose(0, 1) for t in kv_cache.append(
                kv_latent.transpose(0, 1), k_pe.transpose(0, 1)))
        k, v = self.key_value(kv_latent, k_pe)
        # Backends take [batch, seq, heads, dim].
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))
        return self.linear_proj(self.attend(q, k, v, documents))

    def query_and_latent(self, x: torch.Tensor, rope_table: torch.Tensor):
        """q [seq, batch, local heads, qk_head_dim + r], the normalised KV latent
        [seq, batch, kv_lora_rank] and the rotated k_pe [seq, batch, 1, r] (what a KV cache
        keeps), of the whole sequence under SP."""
        c = self.config
        if c.q_lora_rank is None:
            q = self.linear_q_proj(x)
        else:
            q_latent = self.linear_q_down_proj(x)
            if c.qk_layernorm:
                q_latent = self.q_layernorm(q_latent)
            q = self.linear_q_up_proj(q_latent)
        kv_latent, k_pe = self.linear_kv_down_proj(x).split(
            [c.kv_lora_rank, c.qk_pos_emb_head_dim], dim=-1)
        if c.qk_layernorm:
            kv_latent = self.kv_layernorm(kv_latent)
        k_pe = column_parallel_input(k_pe, self.tp_group, c.sequence_parallel)
        s, b = q.shape[:2]
        q_nope, q_pe = q.view(s, b, self.heads, self.q_head_dim).split(
            [c.qk_head_dim, c.qk_pos_emb_head_dim], dim=-1)
        table = rope_table[:s]
        q_pe = apply_rotary(deinterleave(q_pe), table)
        k_pe = apply_rotary(deinterleave(k_pe.unsqueeze(2)), table)
        return torch.cat([q_nope, q_pe], dim=-1), kv_latent, k_pe

    def key_value(self, kv_latent: torch.Tensor, k_pe: torch.Tensor):
        """k [seq, batch, local heads, qk_head_dim + r] and v [..., v_head_dim] from the
        latent and the rotated k_pe (query_and_latent's, or a cache's of every position)."""
        c = self.config
        kv = self.linear_kv_up_proj(kv_latent)
        s, b = kv.shape[:2]
        k_nope, v = kv.view(s, b, self.heads, c.qk_head_dim + c.v_head_dim).split(
            [c.qk_head_dim, c.v_head_dim], dim=-1)
        return torch.cat([k_nope, k_pe.expand(-1, -1, self.heads, -1)], dim=-1), v
