"""The tensor-parallel communication operators, as autograd functions.

Megatron-LM (Shoeybi et al. 2019, §3) splits a layer with two conjugate operators:
`f` (identity forward, all-reduce backward) before a column-parallel layer and `g`
(all-reduce forward, identity backward) after a row-parallel one. Sequence parallelism
(Korthikanti et al. 2022, §4.2.2) replaces them by an all-gather along the sequence dim
before the column-parallel layer and a reduce-scatter after the row-parallel one, and their
backwards swap: all-gather <-> reduce-scatter.

Every operator takes the tensor-parallel process group as an argument; `group=None` (or a
group of one rank) means no tensor parallelism and the operator is the identity. The
collectives are looked up on `torch.distributed` at each call, so a benchmark can wrap
them to count bytes.
"""

from functools import partial

import torch
import torch.distributed as dist

from megalite.errors import ConfigError
from megalite.parallel_state import (all_gather_first_dim, group_rank, group_size,
                                     reduce_scatter_into)


def _check_divisible(x: torch.Tensor, dim: int, parts: int, op: str):
    if x.shape[dim] % parts:
        raise ConfigError(f"{op}: dim {dim} of a tensor of shape {tuple(x.shape)} has size "
                          f"{x.shape[dim]}, not divisible by the tensor-parallel size {parts}")


# The collectives, over a group of more than one rank (`_operator` skips them on one). Each
# returns a new tensor and never writes into its input, which autograd may have saved.

def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, group=group)
    return out


def all_reduce_(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """x all-reduced in place over `group` (over one rank or none: as it is), returned.
    For a tensor no autograd graph has saved."""
    if group_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


def _split(x: torch.Tensor, group, *, dim: int, op: str) -> torch.Tensor:
    """This rank's contiguous chunk of `dim`."""
    _check_divisible(x, dim, group_size(group), op)
    return x.chunk(group_size(group), dim=dim)[group_rank(group)].contiguous()


def _all_gather_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    """[..., n] on each rank -> [..., tp * n]: gather along dim 0, then move the rank blocks."""
    tp = group_size(group)
    stacked = all_gather_first_dim(x, group).view(tp, *x.shape)     # [tp, ..., n]
    return stacked.movedim(0, -2).reshape(*x.shape[:-1], tp * x.shape[-1])


def _reduce_scatter_first_dim(x: torch.Tensor, group, *, op: str) -> torch.Tensor:
    """[n, ...] on each rank -> this rank's [n / tp, ...] block of the sum over ranks."""
    _check_divisible(x, 0, group_size(group), op)
    x = x.contiguous()
    out = x.new_empty((x.shape[0] // group_size(group), *x.shape[1:]))
    reduce_scatter_into(out, x, group=group)
    return out


def _operator(name: str, forward, backward):
    """An autograd operator: `forward(x, group)` on the way in, `backward(grad, group)` on
    its gradient. Each pair below is a collective and its conjugate. Over one rank it is
    the identity both ways, so it returns x itself and puts no node into the graph (a
    node per linear layer costs a small model's step a few per cent on a CPU)."""
    def fwd(ctx, x, group):
        ctx.group = group
        return forward(x, group)

    def bwd(ctx, grad):
        return backward(grad, ctx.group), None

    function = type(name, (torch.autograd.Function,),
                    {"forward": staticmethod(fwd), "backward": staticmethod(bwd)})

    def apply(x: torch.Tensor, group) -> torch.Tensor:
        return function.apply(x, group) if group_size(group) > 1 else x

    apply.__name__ = apply.__qualname__ = name
    return apply


def _identity(x, group):
    return x


# Tensor-parallel region (Megatron-LM §3): f, g and the last-dim scatter/gather.

copy_to_tensor_model_parallel_region = _operator(
    "CopyToTensorModelParallelRegion", _identity, _all_reduce)
"""f: identity forward, all-reduce backward (before a column-parallel layer)."""

reduce_from_tensor_model_parallel_region = _operator(
    "ReduceFromTensorModelParallelRegion", _all_reduce, _identity)
"""g: all-reduce forward, identity backward (after a row-parallel layer)."""

scatter_to_tensor_model_parallel_region = _operator(
    "ScatterToTensorModelParallelRegion",
    partial(_split, dim=-1, op="scatter_to_tensor_model_parallel_region"), _all_gather_last_dim)
"""Keep this rank's chunk of the last dim; backward all-gathers the last dim."""

gather_from_tensor_model_parallel_region = _operator(
    "GatherFromTensorModelParallelRegion", _all_gather_last_dim,
    partial(_split, dim=-1, op="gather_from_tensor_model_parallel_region"))
"""All-gather the last dim; backward keeps this rank's chunk."""


# Sequence-parallel region (Korthikanti et al. 2022): the same along dim 0 (sequence).

scatter_to_sequence_parallel_region = _operator(
    "ScatterToSequenceParallelRegion",
    partial(_split, dim=0, op="scatter_to_sequence_parallel_region"), all_gather_first_dim)
"""Keep this rank's chunk of dim 0 (sequence); backward all-gathers dim 0."""

reduce_scatter_to_sequence_parallel_region = _operator(
    "ReduceScatterToSequenceParallelRegion",
    partial(_reduce_scatter_first_dim, op="reduce_scatter_to_sequence_parallel_region"),
    all_gather_first_dim)
"""Reduce-scatter dim 0 (sequence); backward all-gathers dim 0."""

_GATHER_SP = "gather_from_sequence_parallel_region"
# A gathered tensor feeding a tensor-parallel layer gets a partial gradient on each rank.
_gather_sp_partial_grads = _operator("GatherFromSequenceParallelRegion", all_gather_first_dim,
                                     partial(_reduce_scatter_first_dim, op=_GATHER_SP))
_gather_sp_whole_grads = _operator("GatherFromSequenceParallelRegionSplitGrad",
                                   all_gather_first_dim, partial(_split, dim=0, op=_GATHER_SP))


def gather_from_sequence_parallel_region(x, group, tensor_parallel_output_grad=True):
    """All-gather dim 0 (sequence); backward reduce-scatters dim 0 when the gathered tensor
    feeds a tensor-parallel layer (partial grads per rank), else keeps this rank's chunk."""
    if tensor_parallel_output_grad:
        return _gather_sp_partial_grads(x, group)
    return _gather_sp_whole_grads(x, group)
