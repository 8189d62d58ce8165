"""Data-parallel gradient reduction: sum each gradient over the data-parallel group.

Each DP rank's loss is already divided by the loss-token count of the whole global batch
(summed over DP ranks), so the sum of the ranks' gradients is exactly the gradient of the
global batch's loss (DESIGN.md §3): no averaging by DP size is needed.

Gradients are packed into flat buckets of at most `bucket_size` elements per dtype, one
all-reduce per bucket, so a model of thousands of tensors costs a handful of collectives.
The reduction runs once per step, after the last micro-batch's backward.
"""

import torch
import torch.distributed as dist

from megalite.parallel_state import group_size

DEFAULT_BUCKET_SIZE = 40_000_000  # elements; Megatron's default when --ddp-bucket-size is unset


def buckets(tensors: list[torch.Tensor], bucket_size: int) -> list[list[torch.Tensor]]:
    """Consecutive runs of same-dtype tensors holding at most bucket_size elements each
    (a single larger tensor gets a bucket of its own)."""
    out, current, size = [], [], 0
    for t in tensors:
        if current and (t.dtype != current[0].dtype or size + t.numel() > bucket_size):
            out.append(current)
            current, size = [], 0
        current.append(t)
        size += t.numel()
    if current:
        out.append(current)
    return out


@torch.no_grad()
def allreduce_gradients(params: list[torch.Tensor], group, bucket_size: int = DEFAULT_BUCKET_SIZE):
    """Sum every parameter's .grad over `group`, in place."""
    if group_size(group) == 1:
        return
    grads = sorted((p.grad for p in params if p.grad is not None), key=lambda g: str(g.dtype))
    for bucket in buckets(grads, bucket_size):
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat, group=group)
        for g, reduced in zip(bucket, flat.split([g.numel() for g in bucket])):
            g.copy_(reduced.view_as(g))
