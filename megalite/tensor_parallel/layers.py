"""Tensor-parallel layers (Megatron-LM §3; sequence parallelism: Korthikanti et al. 2022).

Activations are sequence-first (model/gpt.py), [seq / tp, batch, hidden] between layers
under sequence parallelism.

Every parameter is tagged where it is created (params.py): a shard as tensor parallel along
its `partition_dim`, a replicated one fed this rank's sequence shard as sequence parallel
(`allreduce_sequence_parallel_grads` sums its grads before the optimizer step). The matrix
products go through `weight_grad.linear` with the layer's `linear_step` (its model's, installed
by the step that runs it), so a zero-bubble schedule can defer their weight gradients to a W
pass and an FP8 weight is quantized once a step. Parameters start as zeros on the current
default device and dtype (the model builds them where they will live, then overwrites every
one).
"""

import torch
import torch.nn.functional as F
from torch import nn

from megalite.errors import ConfigError
from megalite.parallel_state import all_reduce_anywhere, group_rank, group_size
from megalite.tensor_parallel.fp8 import Fp8Recipe, fp8_linear
from megalite.tensor_parallel.params import (is_sequence_parallel, main_grad,
                                             mark_sequence_parallel, mark_tensor_parallel)
from megalite.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region, gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region, reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region, scatter_to_tensor_model_parallel_region)
from megalite.tensor_parallel.weight_grad import LinearStep, linear


def _divide(size: int, tp: int, what: str) -> int:
    if size % tp:
        raise ConfigError(f"{what} = {size} is not divisible by the tensor-parallel size "
                          f"{tp} (--tensor-model-parallel-size)")
    return size // tp


def parameter(*shape: int, partition_dim: int | None, sequence_parallel: bool = False):
    """A zero parameter of `shape`, tagged (params.py) as split over TP along `partition_dim`
    (None: replicated) and as getting a partial gradient per TP rank (`sequence_parallel`)."""
    param = nn.Parameter(torch.zeros(*shape))
    mark_tensor_parallel(param, partition_dim)
    mark_sequence_parallel(param, sequence_parallel)
    return param


def column_parallel_input(x: torch.Tensor, group, sequence_parallel: bool) -> torch.Tensor:
    """The input of a column-parallel product: all-gathered along seq under SP (backward
    reduce-scatters its gradient), else f (backward all-reduces it)."""
    if sequence_parallel:
        return gather_from_sequence_parallel_region(x, group)
    return copy_to_tensor_model_parallel_region(x, group)


def column_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                           group, sequence_parallel: bool, step: LinearStep,
                           fp8: Fp8Recipe | None = None) -> torch.Tensor:
    """X A^T + b for this rank's row block A: X all-gathered along seq under SP, else f;
    the GEMMs in FP8 with a recipe `fp8` (fp8.py); `step`: the model's LinearStep."""
    x = column_parallel_input(x, group, sequence_parallel)
    if fp8 is not None:
        return fp8_linear(x, weight, bias, fp8, group, step, row_parallel=False)
    return linear(x, weight, bias, step)


class ColumnParallelLinear(nn.Module):
    """Y = X A^T + b with A split by rows (the output dim): rank r holds rows block r.

    Input [s, b, in] replicated across the TP group, or [s / tp, b, in] under sequence
    parallelism; output [s, b, out / tp], or [s, b, out] with gather_output.

    Under sequence parallelism the weight gradient needs the all-gathered input. This layer
    keeps the gathered [s, b, in] input from the forward for the backward (memory: one
    gathered activation per layer); Megatron instead frees it and all-gathers it again in
    backward, which costs 2 more all-gathers per transformer layer per step.
    """

    def __init__(self, input_size: int, output_size: int, *, group, bias: bool = True,
                 gather_output: bool = False, sequence_parallel: bool = False,
                 fp8: Fp8Recipe | None = None):
        super().__init__()
        self.group, self.gather_output, self.fp8 = group, gather_output, fp8
        self.sequence_parallel = sequence_parallel
        self.input_size, self.output_size = input_size, output_size
        self.output_size_per_partition = _divide(
            output_size, group_size(group), "ColumnParallelLinear output size")
        self.weight = parameter(self.output_size_per_partition, input_size, partition_dim=0)
        self.bias = parameter(self.output_size_per_partition, partition_dim=0) if bias else None
        self.linear_step = LinearStep()  # until the step running the model installs its own

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = column_parallel_linear(x, self.weight, self.bias, self.group, self.sequence_parallel,
                                   self.linear_step, self.fp8)
        return gather_from_tensor_model_parallel_region(y, self.group) if self.gather_output else y

    def extra_repr(self) -> str:
        return (f"in={self.input_size}, out={self.output_size}, out_per_partition="
                f"{self.output_size_per_partition}, sequence_parallel={self.sequence_parallel}"
                + (f", fp8={self.fp8}" if self.fp8 else ""))


class RowParallelLinear(nn.Module):
    """Y = X A^T + b with A split by columns (the input dim): rank r holds columns block r.

    Input [s, b, in / tp] (input_is_parallel) or [s, b, in] replicated; the partial products
    are summed across the group (all-reduce, or reduce-scatter along seq under sequence
    parallelism: output [s / tp, b, out]); the full bias is added once, after the sum.
    """

    def __init__(self, input_size: int, output_size: int, *, group, bias: bool = True,
                 input_is_parallel: bool = True, sequence_parallel: bool = False,
                 fp8: Fp8Recipe | None = None):
        super().__init__()
        self.group, self.input_is_parallel, self.fp8 = group, input_is_parallel, fp8
        self.sequence_parallel = sequence_parallel
        self.input_size, self.output_size = input_size, output_size
        self.input_size_per_partition = _divide(
            input_size, group_size(group), "RowParallelLinear input size")
        self.weight = parameter(output_size, self.input_size_per_partition, partition_dim=1)
        # Added to this rank's sequence shard under SP: a partial grad (params.py).
        self.bias = (parameter(output_size, partition_dim=None,
                                sequence_parallel=sequence_parallel) if bias else None)
        self.linear_step = LinearStep()  # until the step running the model installs its own

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tensor_model_parallel_region(x, self.group)
        if self.fp8 is not None:
            y = fp8_linear(x, self.weight, None, self.fp8, self.group, self.linear_step,
                           row_parallel=True)
        else:
            y = linear(x, self.weight, None, self.linear_step)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(y, self.group)
        else:
            y = reduce_from_tensor_model_parallel_region(y, self.group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in={self.input_size}, out={self.output_size}, in_per_partition="
                f"{self.input_size_per_partition}, sequence_parallel={self.sequence_parallel}"
                + (f", fp8={self.fp8}" if self.fp8 else ""))


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by rows (the vocabulary): rank r holds ids
    [r * V / tp, (r + 1) * V / tp). Each rank looks up the ids it holds, writes zeros for
    the others, and the all-reduce assembles every row. The vocabulary must be divisible by
    tp (the model pads it). Ids outside [0, V) embed to zeros instead of raising: the data
    pipeline checks ids against the vocabulary before training.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, group):
        super().__init__()
        self.group = group
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        per_partition = _divide(num_embeddings, group_size(group),
                                "VocabParallelEmbedding vocabulary size (padded)")
        self.vocab_start_index = group_rank(group) * per_partition
        self.vocab_end_index = self.vocab_start_index + per_partition
        self.weight = parameter(per_partition, embedding_dim, partition_dim=0)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens of any shape [...] (global ids) -> [..., embedding_dim]."""
        if group_size(self.group) == 1:
            return F.embedding(tokens, self.weight)
        elsewhere = (tokens < self.vocab_start_index) | (tokens >= self.vocab_end_index)
        local = (tokens - self.vocab_start_index).masked_fill(elsewhere, 0)
        out = F.embedding(local, self.weight).masked_fill(elsewhere.unsqueeze(-1), 0.0)
        return reduce_from_tensor_model_parallel_region(out, self.group)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, "
                f"rows=[{self.vocab_start_index}, {self.vocab_end_index})")


def allreduce_sequence_parallel_grads(params, group):
    """Sum across the TP group the grads of replicated parameters tagged sequence parallel:
    one flat buffer and one all-reduce per dtype."""
    if group_size(group) == 1:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        grad = main_grad(p)  # may be an fp32 buffer view while p is bf16
        if is_sequence_parallel(p) and grad is not None:
            by_dtype.setdefault(grad.dtype, []).append(grad)
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        all_reduce_anywhere(flat, group)
        for g, summed in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(summed.view_as(g))
