"""PowerSGD's memory on one rank (distributed/powersgd.py), from the model's own parameter
list and PowerSGD's own choice of the matrices it compresses (`plan_bucket`): the fp32
error-feedback buffer of each compressed matrix (with error feedback), its last Q (with
warm start), and the flat P and Q buffers of the largest bucket, live while it is reduced.
"""

from torch import nn

from megalite.config import Config
from megalite.distributed.grad_buffer import bucket_layout
from megalite.distributed.powersgd import plan_bucket
from megalite.tensor_parallel.params import is_shared_embedding, partition_dim


def powersgd_bytes(config: Config, params: list[nn.Parameter], numels: list[int]) -> int:
    """Bytes PowerSGD adds on one TP rank holding `params` (whole, as weights.py builds
    them; the decision is taken on whole matrices, as PowerSGD takes it at any TP), of
    which it holds `numels` elements each (the buckets are laid out from those)."""
    c = config.grad_compression
    if not c.enabled:
        return 0
    tp = config.parallel.tensor_model_parallel_size
    names = {id(p): str(i) for i, p in enumerate(params)}  # only identity matters here
    layout = bucket_layout(numels, [p.dtype for p in params],
                           [is_shared_embedding(p) for p in params],
                           config.parallel.ddp_bucket_size)
    persistent, largest_factors = 0, 0
    for bucket in layout:
        matrices, _ = plan_bucket([params[i] for i in bucket], names, c, 1)
        factors = 0
        for a in matrices:
            split = partition_dim(a.param) if tp > 1 else None
            n = a.n // tp if split == 0 else a.n
            m = a.m // tp if split == 1 else a.m
            persistent += 4 * (n * m * c.error_feedback + m * a.rank * c.warm_start)
            factors += 4 * (n + m) * a.rank
        largest_factors = max(largest_factors, factors)
    return persistent + largest_factors

