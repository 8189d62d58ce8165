"""What a parameter is, for the code that shards, reduces, counts and saves it.

The layers that create a parameter tag it once (`mark_*`); everything else reads the tags
through the predicates below, never with `getattr(p, "<tag>")` of its own:

- tensor parallel: split over the TP group along `partition_dim` (column- and row-parallel
  weights, vocabulary-parallel embeddings and output layer);
- sequence parallel: replicated over TP but fed one sequence shard per rank, so its gradient
  is a partial sum to all-reduce over TP (norms and row-parallel biases under SP);
- shared embedding: the word embedding and a tied output layer on a later pipeline stage,
  whose gradients are summed over the embedding group;
- embedding copy: that later stage's tied output layer, a copy of the word embedding: it is
  counted once (grad norm, optimizer, checkpoint) through the embedding itself.
- expert parallel: a routed expert weight of a MoE layer, [local experts, ...]; its dim 0
  is split over the EP group (EP rank r holds experts [r E/EP, (r+1) E/EP)) and its
  gradient is reduced over the expert-data-parallel group, not over DP x CP.

`tp_shard` cuts a full single-process tensor into this rank's block, the one rule that model
initialisation and checkpoint loading share; `tp_unshard` joins the blocks of all ranks.
"""

import sys

import torch
from torch import nn

from megalite.errors import CheckpointError

# Parameters whose first dimension is the vocabulary, padded per TP size (docs/design.md §4).
VOCAB_PARAMS = ("embedding.word_embeddings.weight", "output_layer.weight")


def mark_tensor_parallel(param: nn.Parameter, partition_dim: int | None):
    param.tensor_model_parallel = partition_dim is not None
    param.partition_dim = partition_dim


def mark_sequence_parallel(param: nn.Parameter, value: bool = True):
    param.sequence_parallel = value


def mark_shared_embedding(param: nn.Parameter, copy: bool):
    param.shared_embedding = True
    param.embedding_copy = copy


def mark_expert_parallel(param: nn.Parameter):
    param.expert_parallel = True


def is_expert_parallel(param: nn.Parameter) -> bool:
    return getattr(param, "expert_parallel", False)


def ep_shard(full: torch.Tensor, param: nn.Parameter, ep_rank: int, ep_size: int) -> torch.Tensor:
    """This EP rank's experts [r * E/EP, (r+1) * E/EP) (dim 0) of the full tensor of an
    expert parameter; any other tensor as it is."""
    if ep_size == 1 or not is_expert_parallel(param):
        return full
    return full.chunk(ep_size, dim=0)[ep_rank]


def is_tensor_parallel(param: nn.Parameter) -> bool:
    return getattr(param, "tensor_model_parallel", False)


def partition_dim(param: nn.Parameter) -> int | None:
    """The dimension split over TP, or None for a replicated parameter."""
    return getattr(param, "partition_dim", None) if is_tensor_parallel(param) else None


def is_sequence_parallel(param: nn.Parameter) -> bool:
    return getattr(param, "sequence_parallel", False)


def is_shared_embedding(param: nn.Parameter) -> bool:
    return getattr(param, "shared_embedding", False)


def is_embedding_copy(param: nn.Parameter) -> bool:
    return getattr(param, "embedding_copy", False)


def single_process_name(name: str, param: nn.Parameter) -> str:
    """`param`'s name in the single-process model, from `name`, its name in its model chunk:
    a tied output layer on a later pipeline stage is a copy of the word embeddings."""
    return VOCAB_PARAMS[0] if is_embedding_copy(param) else name


def copy_tags(tags: dict, param: nn.Parameter):
    """Set on `param` the tags (and any other attributes) in `tags`, another parameter
    object's `vars()`: FSDP2 replaces each parameter by a new DTensor one."""
    vars(param).update(tags)


def main_grad(param: nn.Parameter) -> torch.Tensor | None:
    """The gradient the optimizer and the model-parallel reductions read: the gradient
    buffer's view (distributed/grad_buffer.py) when the parameter has one, else .grad;
    of an FSDP2 (DTensor) gradient, this rank's DP shard, in place."""
    grad = getattr(param, "main_grad", param.grad)
    return grad.to_local() if is_dtensor(grad) else grad


def is_dtensor(tensor) -> bool:
    """Whether `tensor` is a DTensor (an FSDP2 shard). torch.distributed.tensor costs most
    of a second of every process's start, so only a run that shards imports it
    (distributed/fsdp.py); until then nothing can be a DTensor."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def pad_vocab_rows(full: torch.Tensor, rows: int) -> torch.Tensor:
    """`full` cut or zero-padded to `rows` along the vocabulary: padding rows are zero in
    weights and Adam moments alike, whatever padding the TP size needs."""
    if full.shape[0] >= rows:
        return full[:rows]
    return torch.cat([full, full.new_zeros(rows - full.shape[0], *full.shape[1:])])


def tp_shard(full: torch.Tensor, param: nn.Parameter, name: str, tp_rank: int,
             tp_size: int) -> torch.Tensor:
    """This TP rank's block of `full`, the single-process tensor of parameter `name`
    (vocabulary rows padded to this layout's padded vocabulary first; of a stacked
    parameter, its block of each part)."""
    if name.endswith(VOCAB_PARAMS):
        full = pad_vocab_rows(full, param.shape[0] * (tp_size if is_tensor_parallel(param) else 1))
    dim = partition_dim(param)
    if dim is None:
        return full
    blocks = [part.chunk(tp_size, dim=dim)[tp_rank]
              for part in full.chunk(partition_stride(param), dim=dim)]
    return blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=dim)


def local_shard(full: torch.Tensor, param: nn.Parameter, name: str, tp_rank: int,
                tp_size: int) -> torch.Tensor:
    """This TP rank's block of a checkpoint's full tensor (tp_shard), checked against the
    model's parameter."""
    full = tp_shard(full, param, name, tp_rank, tp_size)
    if full.shape != param.shape:
        raise CheckpointError(f"parameter {name}: the checkpoint gives shape {tuple(full.shape)} "
                              f"for this rank, the model has {tuple(param.shape)}")
    return full


# Stacked parameters (Megatron's `partition_stride`): the full tensor is `parts` blocks
# along the partition dim, each split over TP on its own, so TP rank r holds [block 0's
# shard r; block 1's shard r; ...]. SwiGLU's fused [gate; up] projection is one: each rank
# then splits its own output into gate and up, with no communication.

def mark_stacked(param: nn.Parameter, parts: int):
    param.partition_stride = parts


def partition_stride(param: nn.Parameter) -> int:
    return getattr(param, "partition_stride", 1)


def tp_unshard(shards: list[torch.Tensor], dim: int | None, stride: int = 1) -> torch.Tensor:
    """The full tensor from every TP rank's block, in rank order: tp_shard's inverse."""
    if dim is None or len(shards) == 1:
        return shards[0]
    blocks = [shard.chunk(stride, dim=dim) for shard in shards]
    return torch.cat([b[i] for i in range(stride) for b in blocks], dim=dim)
