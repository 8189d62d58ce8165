"""How gradients are grouped for the data-parallel reduction.

Parameters are cut, in order, into buckets of at most --ddp-bucket-size elements of one
dtype, so a model of thousands of tensors costs a handful of collectives per step. Both
the plain data-parallel gradient buffer (grad_buffer.py) and ZeRO-1
(optimizer/mixed_precision.py) lay their flat buffers out this way.
"""

import torch

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
