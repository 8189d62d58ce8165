"""Causal self-attention with multi-head or grouped-query heads, tensor-parallel.

The fused QKV projection's output rows are laid out per query group:
[q heads of group 0, k_0, v_0, q heads of group 1, k_1, v_1, ...] (Megatron's layout).
A column-parallel split of those rows into contiguous blocks therefore hands whole query
groups to each tensor-parallel rank (Shoeybi et al. 2019, §3: heads split across ranks,
QKV column-parallel, output projection row-parallel), so the same full weight serves
every TP size.
"""

import torch
from torch import nn

from megalite.context_parallel import context_parallel_attention
from megalite.documents import Documents
from megalite.config import GPTConfig
from megalite.model.norms import build_norm
from megalite.model.rotary import apply_rotary
from megalite.parallel_state import group_size
from megalite.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megalite.tensor_parallel.random import checkpoint, model_parallel_rng


class CoreAttention(nn.Module):
    """What SelfAttention and MultiLatentAttention share: the core attention of their heads,
    over the CP group, with dropout and selective recompute. `softmax_scale`: None for
    1/sqrt(head dim)."""

    def __init__(self, config: GPTConfig, tp_group=None, rng_tracker=None, cp_group=None,
                 softmax_scale: float | None = None):
        super().__init__()
        self.config, self.softmax_scale = config, softmax_scale
        # Under context parallelism x holds this rank's chunks of each sequence; the core
        # attention reaches the keys and values of the others (docs/design.md §10).
        self.cp_group = cp_group if group_size(cp_group) > 1 else None
        # Attention dropout acts on this rank's heads (and, under CP, queries) only: its
        # mask must differ per TP and CP rank, so it draws from the model-parallel stream.
        # With one rank of each there is nothing to tell apart, and the default stream
        # serves: dynamo cannot trace the generator swap (a graph break in every compiled
        # layer, at the compile default's TP 1 and CP 1).
        self.rng_tracker = rng_tracker if group_size(tp_group) * group_size(cp_group) > 1 \
            else None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               documents: Documents | None) -> torch.Tensor:
        """q, k, v [batch, seq, heads, dim] (the backends' layout; grouped K/V heads stay
        grouped) -> [seq, batch, heads x value dim], for the output projection."""
        if self.config.recompute_granularity == "selective" and torch.is_grad_enabled():
            # Selective recompute (Korthikanti et al. 2022 §4.2): the core attention
            # holds the most activation memory per flop; keep only q, k, v.
            out = checkpoint(self._core_attention, self.rng_tracker, q, k, v, documents)
        else:
            out = self._core_attention(q, k, v, documents)
        return out.transpose(0, 1).flatten(2)

    def _core_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        documents: Documents | None = None) -> torch.Tensor:
        c = self.config
        dropout = c.attention_dropout if self.training else 0.0
        with model_parallel_rng(self.rng_tracker, dropout != 0.0):  # no draws: no swap
            # Without CP (cp_group None) this is core_attention itself.
            return context_parallel_attention(
                q, k, v, cp_group=self.cp_group, comm_type=c.cp_comm_type,
                backend=c.attention_backend, dropout_p=dropout,
                softmax_scale=self.softmax_scale, documents=documents)


class SelfAttention(CoreAttention):
    def __init__(self, config: GPTConfig, tp_group=None, rng_tracker=None, cp_group=None,
                 fp8=None):
        super().__init__(config, tp_group, rng_tracker, cp_group)
        c = config
        self.num_groups = c.num_query_groups // group_size(tp_group)
        self.heads_per_group = c.num_attention_heads // c.num_query_groups
        qkv_size = c.query_projection_size + 2 * c.kv_projection_size
        self.linear_qkv = ColumnParallelLinear(c.hidden_size, qkv_size, group=tp_group,
                                               bias=c.add_bias_linear,
                                               sequence_parallel=c.sequence_parallel, fp8=fp8)
        self.linear_proj = RowParallelLinear(c.query_projection_size, c.hidden_size,
                                             group=tp_group, bias=c.add_bias_linear,
                                             sequence_parallel=c.sequence_parallel, fp8=fp8)
        if c.qk_layernorm:
            # One weight per channel, shared by all heads; each TP rank normalises its own
            # heads, so its gradient is a partial sum over TP (SP or not), as the router's.
            tp_split = group_size(tp_group) > 1
            self.q_layernorm = build_norm(c, c.kv_channels, partial_grad=tp_split)
            self.k_layernorm = build_norm(c, c.kv_channels, partial_grad=tp_split)

    def forward(self, x: torch.Tensor, rope_table: torch.Tensor | None,
                kv_cache=None, documents: Documents | None = None) -> torch.Tensor:
        """x: [seq, batch, hidden] (a sequence shard under SP) -> same shape. Generation
        passes this layer's `kv_cache`: `append(k, v)` stores the keys and values of x's
        positions after the cached ones and returns those of every position so far (the
        RoPE table then starts at x's first position). `documents`: attention block-causal
        over them (--reset-attention-mask). With reset positions the RoPE table is
        [seq, batch, 2, rotary dim]: each row's position within its document."""
        c = self.config
        qkv = self.linear_qkv(x)
        s, b, _ = qkv.shape
        qkv = qkv.view(s, b, self.num_groups, self.heads_per_group + 2, c.kv_channels)
        # One split, not an index per tensor: its backward is one concatenation, where each
        # index's backward would zero-fill a tensor of qkv's size and copy into it.
        q, k, v = qkv.split([self.heads_per_group, 1, 1], dim=3)
        q = q.reshape(s, b, self.num_groups * self.heads_per_group, c.kv_channels)
        k, v = k.squeeze(3), v.squeeze(3)
        if c.qk_layernorm:  # per head, before RoPE (Megatron, Qwen3)
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        if rope_table is not None:  # cos/sin for every position of x's rows
            q, k = apply_rotary(q, rope_table[:s]), apply_rotary(k, rope_table[:s])
        # Backends take [batch, seq, heads, dim]; grouped K/V heads stay grouped.
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))
        if kv_cache is not None:
            k, v = kv_cache.append(k, v)
        return self.linear_proj(self.attend(q, k, v, documents))
