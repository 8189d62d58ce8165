"""The pre-norm transformer layer: x + attn(norm(x)), then x + mlp(norm(x)).

Under sequence parallelism (Korthikanti et al. 2022) the norms and dropouts here see only
this rank's shard of the sequence; the column-parallel layers all-gather it and the
row-parallel layers reduce-scatter back to it.
"""

import torch
import torch.nn.functional as F
from torch import nn

from megalite.model.attention import SelfAttention
from megalite.model.mla import MultiLatentAttention
from megalite.model.moe import MoELayer, activation
from megalite.config import GPTConfig
from megalite.model.norms import build_norm
from megalite.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megalite.tensor_parallel.params import mark_stacked
from megalite.tensor_parallel.random import model_parallel_rng


class MLP(nn.Module):
    """GeLU MLP, or SwiGLU (Shazeer 2020) with the gate and up projections fused into one
    column-parallel GEMM (Megatron's layout): linear_fc1's full weight is [gate; up],
    stacked so that TP rank r holds [gate block r; up block r] and splits its own output in
    two (params.mark_stacked). fc1 is column-parallel, fc2 row-parallel: one all-reduce per
    MLP (Shoeybi et al. §3), and under SP one all-gathered input instead of two."""

    def __init__(self, config: GPTConfig, tp_group=None, fp8=None):
        super().__init__()
        h, f, bias, sp = (config.hidden_size, config.ffn_hidden_size, config.add_bias_linear,
                          config.sequence_parallel)
        self.swiglu = config.swiglu
        self.linear_fc1 = ColumnParallelLinear(h, 2 * f if self.swiglu else f, group=tp_group,
                                               bias=bias, sequence_parallel=sp, fp8=fp8)
        if self.swiglu:
            for param in self.linear_fc1.parameters():
                mark_stacked(param, 2)
        self.linear_fc2 = RowParallelLinear(f, h, group=tp_group, bias=bias, sequence_parallel=sp,
                                            fp8=fp8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(activation(self.linear_fc1(x), self.swiglu))


class TransformerLayer(nn.Module):
    def __init__(self, config: GPTConfig, tp_group=None, rng_tracker=None, cp_group=None,
                 fp8=None, layer_index: int = 0, ep_group=None):
        """`fp8`: the recipe of this layer's FP8 GEMMs (tensor_parallel/fp8.py), or None;
        `layer_index`: its global index, which says whether its MLP is a MoE layer
        (config.moe_layer_pattern); `ep_group`: the expert-parallel group of a MoE layer."""
        super().__init__()
        self.input_layernorm = build_norm(config)
        if config.multi_latent_attention:  # FP8 GEMMs: refused with MLA (validation/mla.py)
            self.self_attention = MultiLatentAttention(config, tp_group, rng_tracker, cp_group)
        else:
            self.self_attention = SelfAttention(config, tp_group, rng_tracker, cp_group, fp8)
        self.pre_mlp_layernorm = build_norm(config)
        if config.is_moe_layer(layer_index):
            self.mlp = MoELayer(config, tp_group, cp_group, dense_mlp=MLP, ep_group=ep_group)
        else:
            self.mlp = MLP(config, tp_group, fp8)
        self.dropout = SequenceParallelDropout(config, rng_tracker)
        if config.compile_layers:
            self.compile()  # in place: parameter names and the module tree stay as they are

    def forward(self, x: torch.Tensor, rope_table: torch.Tensor | None,
                kv_cache=None, documents=None) -> torch.Tensor:
        x = x + self.dropout(self.self_attention(self.input_layernorm(x), rope_table, kv_cache,
                                                 documents))
        return x + self.dropout(self.mlp(self.pre_mlp_layernorm(x)))


class SequenceParallelDropout(nn.Module):
    """Dropout on the residual stream and the embedding's output. Without SP every TP rank
    holds the same activations and must drop the same elements (default RNG, seeded alike on
    all TP ranks); under SP each rank holds a different sequence shard, so it draws from its
    own TP-rank stream."""

    def __init__(self, config: GPTConfig, rng_tracker=None):
        super().__init__()
        self.p, self.sequence_parallel = config.hidden_dropout, config.sequence_parallel
        self.rng_tracker = rng_tracker

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        with model_parallel_rng(self.rng_tracker, self.sequence_parallel):
            return F.dropout(x, self.p, training=True)
