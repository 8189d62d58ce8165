"""The mixture-of-experts MLP (Shazeer et al. 2017; Fedus et al. 2021; DeepSeek-V3 2024):
router -> dispatch -> routed experts -> combine, plus shared experts every token goes
through (docs/design.md "Mixture of experts").

Under TP + SP the layer all-gathers the sequence over TP first (as a column-parallel layer
does), so every TP rank routes all of the micro-batch's tokens identically; the experts are
split over TP like the dense MLP (fc1 by columns, fc2 by rows: partial sums), and the
combined output is reduce-scattered back to this rank's sequence shard. The router then gets
partial gradients on each TP rank (through the partial expert outputs), so its weight is
tagged sequence parallel and its gradient summed over TP, like a norm's under SP.

The balancing losses reach the gradient as Megatron's MoEAuxLossAutoScaler adds them: not
to the reported loss but into backward, with the gradient `aux_loss_scale` (set per step by
`set_aux_loss_scale`: 1 / micro-batches per global batch, times the fp16 loss scale) divided
by TP, since every TP rank computes the same losses.
"""

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from megalite.config import GPTConfig
from megalite.expert_parallel.dispatch import TokenDispatcher
from megalite.expert_parallel.grouped_gemm import grouped_linear
from megalite.model.router import TopKRouter, counting_forward, expert_capacity
from megalite.parallel_state import group_size
from megalite.tensor_parallel.mappings import (all_reduce_, gather_from_sequence_parallel_region,
                                               reduce_scatter_to_sequence_parallel_region)
from megalite.tensor_parallel.params import (mark_expert_parallel, mark_sequence_parallel,
                                             mark_stacked, mark_tensor_parallel)


class ExpertWeight(nn.Module):
    """One stacked weight [local experts, out, in] of the routed experts, split over TP along
    `partition_dim` (1 or 2) and over EP along dim 0."""

    def __init__(self, num_local_experts: int, out_size: int, in_size: int, partition_dim: int,
                 stride: int = 1):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_local_experts, out_size, in_size))
        mark_tensor_parallel(self.weight, partition_dim)
        mark_expert_parallel(self.weight)
        if stride > 1:
            mark_stacked(self.weight, stride)


class GroupedExperts(nn.Module):
    """The routed experts as two stacked weights: linear_fc1 [E, 2F, h] with SwiGLU (each
    expert's [gate; up], stacked per TP rank as the dense fc1), else [E, F, h], and
    linear_fc2 [E, h, F]; this TP rank holds F / TP of each expert's hidden units."""

    def __init__(self, config: GPTConfig, num_local_experts: int, tp_size: int):
        super().__init__()
        h, f = config.hidden_size, config.moe_ffn_hidden_size // tp_size
        self.swiglu, self.grouped = config.swiglu, config.moe_grouped_gemm
        parts = 2 if self.swiglu else 1
        self.linear_fc1 = ExpertWeight(num_local_experts, parts * f, h, partition_dim=1,
                                       stride=parts)
        self.linear_fc2 = ExpertWeight(num_local_experts, h, f, partition_dim=2)

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """x [N, h] grouped by expert -> [N, h] (partial sums over TP)."""
        y = activation(grouped_linear(x, self.linear_fc1.weight, tokens_per_expert, self.grouped),
                       self.swiglu)
        return grouped_linear(y, self.linear_fc2.weight, tokens_per_expert, self.grouped)


def activation(y: torch.Tensor, swiglu: bool) -> torch.Tensor:
    """The MLP's activation of fc1's output: GeLU, or SwiGLU (Shazeer 2020) of its
    [gate; up] halves (the dense MLP's and each routed expert's)."""
    if swiglu:
        gate, up = y.chunk(2, dim=-1)
        return F.silu(gate) * up
    return F.gelu(y)


class MoELayer(nn.Module):
    """`mlp` of a MoE transformer layer: router, experts, shared_experts (a dense MLP of
    --moe-shared-expert-intermediate-size, when set)."""

    def __init__(self, config: GPTConfig, tp_group=None, cp_group=None, dense_mlp=None,
                 ep_group=None):
        """`dense_mlp(config, tp_group)` builds the shared experts (model/transformer.MLP);
        `ep_group` the expert-parallel group this rank's E / EP experts are one block of."""
        super().__init__()
        self.config, self.tp_group, self.ep_group = config, tp_group, ep_group
        self.sequence_parallel = config.sequence_parallel
        # The router sees the whole (TP-gathered) sequence of its CP rank: the balancing
        # counts are summed over CP only.
        self.router = TopKRouter(config, count_group=cp_group)
        mark_sequence_parallel(self.router.weight, group_size(tp_group) > 1)
        self.experts = GroupedExperts(config, config.num_experts // group_size(ep_group),
                                      group_size(tp_group))
        self.dispatcher = TokenDispatcher(config.num_experts, ep_group=ep_group,
                                          kind=config.moe_token_dispatcher_type)
        self.shared_experts = None
        if config.moe_shared_expert_intermediate_size is not None:
            shared = dataclasses.replace(
                config, ffn_hidden_size=config.moe_shared_expert_intermediate_size)
            self.shared_experts = dense_mlp(shared, tp_group)
        self.aux_loss_scale = 1.0
        self.metrics: dict[str, torch.Tensor] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [s, b, h] (this rank's s / TP under SP) -> the same shape."""
        gathered = (gather_from_sequence_parallel_region(x, self.tp_group)
                    if self.sequence_parallel else x)
        s, b, h = gathered.shape
        tokens = gathered.reshape(s * b, h)
        routing = self.router(tokens, num_sequences=b)
        expert_input, tokens_per_expert = self.dispatcher.dispatch(
            tokens, routing.probs, routing.indices, routing.keep)
        if self.config.moe_pad_expert_input_to_capacity:
            expert_output = self._padded_experts(expert_input, tokens_per_expert, s * b)
        else:
            expert_output = self.experts(expert_input, tokens_per_expert)
        out = self.dispatcher.combine(expert_output).view(s, b, h)
        if routing.losses:
            scale = self.aux_loss_scale / group_size(self.tp_group)
            out = AuxLossBackward.apply(out, sum(routing.losses.values()), scale)
        if counting_forward():
            # Under EP tokens_per_expert counts this rank's experts' pairs from every EP
            # rank; the report wants this rank's routing over all E experts.
            self._record(routing, tokens_per_expert if group_size(self.ep_group) == 1
                         else torch.bincount(routing.indices[routing.keep],
                                             minlength=self.config.num_experts))
        if self.sequence_parallel:
            out = reduce_scatter_to_sequence_parallel_region(out, self.tp_group)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

    def _padded_experts(self, x: torch.Tensor, tokens_per_expert: torch.Tensor,
                        num_tokens: int) -> torch.Tensor:
        """The experts on inputs padded with zero rows to the capacity of each (fixed
        shapes, Megatron's --moe-pad-expert-input-to-capacity); a zero row's output is
        dropped, so the result is the unpadded experts'."""
        c = self.config
        # An expert receives up to a capacity from each EP rank's tokens.
        capacity = expert_capacity(num_tokens, c.num_experts, c.moe_router_topk,
                                   c.moe_expert_capacity_factor) * group_size(self.ep_group)
        starts = torch.cumsum(tokens_per_expert, 0) - tokens_per_expert
        experts = torch.repeat_interleave(torch.arange(len(tokens_per_expert),
                                                       device=x.device), tokens_per_expert)
        rows = experts * capacity + torch.arange(x.shape[0], device=x.device) - starts[experts]
        padded = x.new_zeros(len(tokens_per_expert) * capacity, x.shape[1]).index_copy(0, rows, x)
        out = self.experts(padded, torch.full_like(tokens_per_expert, capacity))
        return out[rows]

    @torch.no_grad()
    def _record(self, routing, tokens_per_expert: torch.Tensor):
        """Sums over this step's micro-batches, for the log line (training_log.py)."""
        values = {name: loss.detach() for name, loss in routing.losses.items()}
        values["tokens_per_expert"] = tokens_per_expert.float()
        for name, value in values.items():
            self.metrics[name] = self.metrics.get(name, 0) + value


class AuxLossBackward(torch.autograd.Function):
    """Megatron's MoEAuxLossAutoScaler: `output` unchanged forward; in backward the auxiliary
    loss gets the gradient `scale`, as if `scale x aux_loss` had been added to the loss."""

    @staticmethod
    def forward(ctx, output, aux_loss, scale: float):
        ctx.save_for_backward(aux_loss)
        ctx.scale = scale
        return output

    @staticmethod
    def backward(ctx, grad):
        (aux_loss,) = ctx.saved_tensors
        return grad, torch.full_like(aux_loss, ctx.scale), None


def modules_of(chunks, kind: type) -> list:
    """The modules of type `kind` in the model chunks `chunks`."""
    return [m for chunk in chunks for m in chunk.modules() if isinstance(m, kind)]


def set_aux_loss_scale(chunks, scale: float):
    """The gradient each micro-batch's auxiliary losses get (see the module docstring)."""
    for layer in modules_of(chunks, MoELayer):
        layer.aux_loss_scale = scale


@torch.no_grad()
def update_expert_bias(chunks, group=None):
    """DeepSeek-V3 §2.1.2, after each step: b_i += u x sign(mean load - load_i), the loads
    the pairs each expert received over the global batch (summed over `group`, the ranks
    holding the batch's other samples and sequence chunks); the counts restart."""
    for layer in modules_of(chunks, MoELayer):
        router = layer.router
        if router.expert_bias is None:
            continue
        load = all_reduce_(router.local_tokens_per_expert, group)
        rate = layer.config.moe_router_bias_update_rate
        router.expert_bias += torch.sign(load.mean() - load) * rate
        load.zero_()
