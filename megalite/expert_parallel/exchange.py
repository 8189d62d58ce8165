"""Token exchange across the expert-parallel group: the EP paths of `TokenDispatcher`.

Each EP rank holds experts [r * E/EP, (r+1) * E/EP) of every MoE layer and routes its own
tokens (T of them: under TP the whole gathered sequence, identical on every TP rank, whose
expert shards then compute partial sums the layer reduce-scatters afterwards). A (token,
choice) pair must reach the rank holding its expert, in the order the local path gives
(by local expert, stable in token order), and come back:

- all-to-all (Megatron's MoEAlltoAllTokenDispatcher): sort this rank's pairs by global
  expert, which groups them by destination rank; exchange the per-expert counts first (one
  small all-to-all, so every rank knows its receive sizes), then the tokens with
  `all_to_all_single` and those split sizes; the received rows come ordered by (source
  rank, local expert), so a stable sort by local expert finishes the dispatch. Combine is
  the exact inverse: unsort, all-to-all back with the splits swapped, unpermute, weight.
- all-gather (Megatron's MoEAllGatherTokenDispatcher): every EP rank gathers every rank's
  tokens, keeps the pairs of its own experts, and combine reduce-scatters the weighted
  outputs, so each token's rank receives the sum of its choices from all ranks.

The backward of each collective is its conjugate (all-to-all with swapped splits;
all-gather <-> reduce-scatter), written as autograd Functions. Probabilities stay on the
routing rank (all-to-all) and the weighting is done there in fp32, as the local path does.
"""

import torch
import torch.distributed as dist

from megalite.parallel_state import all_gather_first_dim, group_rank, group_size
from megalite.tensor_parallel.mappings import (gather_from_sequence_parallel_region,
                                               reduce_scatter_to_sequence_parallel_region)


class _AllToAll(torch.autograd.Function):
    """Rows of `x` cut by `input_splits` go to the ranks in order; `output_splits` rows come
    from each. Backward: the same exchange with the splits swapped."""

    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        x = x.contiguous()
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x, output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return _AllToAll.apply(grad, input_splits, output_splits, ctx.group), None, None, None


def sort_by_expert(indices: torch.Tensor, keep: torch.Tensor, num_experts: int):
    """The kept (token, choice) pairs as flat indices t * k + j, ordered by expert (stable in
    token order: a token picks an expert once), and the count per expert."""
    experts = indices.reshape(-1)
    kept = keep.reshape(-1).nonzero().squeeze(1)
    order = kept[torch.argsort(experts[kept], stable=True)]
    return order, torch.bincount(experts[kept], minlength=num_experts)


def weighted_sum(rows: torch.Tensor, order: torch.Tensor, probs: torch.Tensor,
                 dtype: torch.dtype) -> torch.Tensor:
    """[T, h]: each pair's row (rows[i] belongs to pair order[i]) times its probability,
    summed over the k choices, in fp32 (or wider); dropped pairs contribute nothing."""
    tokens, k = probs.shape
    wide = torch.promote_types(rows.dtype, torch.float32)
    full = rows.new_zeros((tokens * k, rows.shape[1]), dtype=wide)
    full = full.index_copy(0, order, rows.to(wide))
    return (full.view(tokens, k, -1) * probs.unsqueeze(-1)).sum(1).to(dtype)


class AllToAllDispatch:
    """One micro-batch's all-to-all dispatch over `group` and its combine (module
    docstring); a new one per dispatch, as it keeps the permutation for the combine."""

    def __init__(self, num_experts: int, group):
        self.num_experts, self.group, self.ep = num_experts, group, group_size(group)
        self.local_experts = num_experts // self.ep

    def dispatch(self, hidden, probs, indices, keep):
        self.probs, self.dtype, k = probs, hidden.dtype, probs.shape[1]
        self.order, counts = sort_by_expert(indices, keep, self.num_experts)
        send = counts.view(self.ep, self.local_experts)
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, group=self.group)  # [source rank, expert]
        self.input_splits = send.sum(1).tolist()
        self.output_splits = received.sum(1).tolist()
        rows = _AllToAll.apply(hidden.index_select(0, self.order // k), self.output_splits,
                               self.input_splits, self.group)
        expert_of_row = torch.arange(self.local_experts, device=rows.device).repeat(
            self.ep).repeat_interleave(received.reshape(-1))
        self.local_order = torch.argsort(expert_of_row, stable=True)
        return rows.index_select(0, self.local_order), received.sum(0)

    def combine(self, expert_output):
        rows = torch.zeros_like(expert_output).index_copy(0, self.local_order, expert_output)
        rows = _AllToAll.apply(rows, self.input_splits, self.output_splits, self.group)
        return weighted_sum(rows, self.order, self.probs, self.dtype)


class AllGatherDispatch:
    """One micro-batch's all-gather dispatch over `group` and its combine (module
    docstring). Every EP rank must route the same number of tokens."""

    def __init__(self, num_experts: int, group):
        self.num_experts, self.group, ep = num_experts, group, group_size(group)
        self.local_experts = num_experts // ep
        self.first = group_rank(group) * self.local_experts

    def dispatch(self, hidden, probs, indices, keep):
        self.dtype = hidden.dtype
        hidden = gather_from_sequence_parallel_region(hidden, self.group)
        self.probs = gather_from_sequence_parallel_region(probs, self.group)
        local = all_gather_first_dim(indices, self.group) - self.first
        mine = all_gather_first_dim(keep.to(torch.uint8), self.group).bool() & (local >= 0) & (
            local < self.local_experts)
        self.order, counts = sort_by_expert(local.clamp(0, self.local_experts - 1), mine,
                                            self.local_experts)
        return hidden.index_select(0, self.order // probs.shape[1]), counts

    def combine(self, expert_output):
        out = weighted_sum(expert_output, self.order, self.probs,
                           torch.promote_types(expert_output.dtype, torch.float32))
        return reduce_scatter_to_sequence_parallel_region(out, self.group).to(self.dtype)
