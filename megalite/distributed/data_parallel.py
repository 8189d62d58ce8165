"""How gradients are grouped for the data-parallel reduction.

Parameters are cut, in order, into buckets of at most --ddp-bucket-size elements of one
dtype, so a model of thousands of tensors costs a handful of collectives per step. Both
the plain data-parallel gradient buffer and ZeRO-1 (optimizer/mixed_precision.py)
lay their flat buffers out this way (grad_buffer.bucket_layout).
"""

DEFAULT_BUCKET_SIZE = 40_000_000  # elements; Megatron's default when --ddp-bucket-size is unset
