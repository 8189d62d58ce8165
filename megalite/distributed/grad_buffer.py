"""Contiguous gradient buffers, bucketed, reduced over data parallelism once per step.

Every parameter's gradient lives in `param.main_grad`, a view into a flat bucket buffer
(buckets of at most --ddp-bucket-size elements of one dtype, each padded to a multiple of
the DP size). Across micro-batches the gradients accumulate there and nothing is
communicated; after the step's last backward each bucket is reduced over the DP group
with one collective on the buffer itself, no copies:

- plain data parallelism: an all-reduce, so every rank holds the summed gradient;
- ZeRO-1 (`shard=True`): a reduce-scatter, after which DP rank r holds the sum of shard r
  of every bucket, the part its optimizer owns (optimizer/mixed_precision.py).

When the buffer has the parameters' dtype, `param.grad` is the same view and autograd
accumulates into it in place. With --accumulate-allreduce-grads-in-fp32 and bf16/fp16
parameters it cannot be (a .grad must have its parameter's dtype), so a hook adds each
micro-batch's gradient into the fp32 buffer and drops it, as Megatron's main_grad does.

Under --overlap-grad-reduce a bucket's collective is launched asynchronously as soon as
its last gradient of the step has been accumulated, while the backward of earlier layers
is still running (Li et al. 2020, PyTorch DDP §3.2.3); a weight gradient deferred to a
zero-bubble W pass is counted there (`linear_step`: the model's weight_grad.LinearStep says
which gradients the B pass running now deferred).

Expert parameters (`is_expert_parallel`: a MoE layer's experts, split over the expert-parallel
group) get buckets of their own, reduced over the expert-data-parallel group, the
(DP x CP) / EP ranks that hold the same experts; every other bucket over DP x CP. Each bucket
carries its group, and is padded to a multiple of that group's size.

A tied embedding used on two pipeline stages gets a bucket of its own: its copies on the
first and last stage then sit at the same offsets of identically laid-out buckets, so the
embedding group can sum the reduced shards element for element.

Hybrid sharding (--num-distributed-optimizer-instances N, docs/design.md "Hybrid sharding"):
`group` is then a shard group of DP x CP / N consecutive ranks (and `expert_group` one of
expert-DP / N), and a sharded bucket is reduced in two steps: a reduce-scatter within the
shard group, then an all-reduce of this rank's shard over its replica group, the ranks
holding the same shard in the other replicas. Only the second crosses replicas (nodes).

With --grad-compression powersgd a `compressor` (distributed/powersgd.py) takes over the
reduction once it is active: every bucket is reduced, compressed, in `finish`, on whole
gradients over all of DP x CP (under ZeRO-1 too: each rank then steps its shard of the
decompressed sum; with hybrid sharding its shard of its shard group, and nothing more is
reduced across replicas, which the compressed sum already spans).
`bytes_sent` counts the payload this rank put into the step's DP collectives.
"""

import itertools

import torch
import torch.distributed as dist
from torch import nn

from megalite.distributed.hybrid_bytes import cross_replica_bytes
from megalite.parallel_state import group_rank, group_size, reduce_scatter_into
from megalite.tensor_parallel.params import is_expert_parallel, is_shared_embedding
from megalite.tensor_parallel.weight_grad import LinearStep


class Bucket:
    """Consecutive parameters and their gradients, flat, padded to a multiple of the size
    `dp` of `group`, the ranks it is reduced (and sharded) over; `replica_group` (None: no
    other replicas) sums the shards across replicas."""

    def __init__(self, params: list[nn.Parameter], dtype: torch.dtype, group,
                 replica_group=None):
        self.params, self.group, self.replica_group = params, group, replica_group
        self.dp, self.dp_rank = group_size(group), group_rank(group)
        *self.offsets, end = itertools.accumulate([0, *(p.numel() for p in params)])
        self.numel = padded_size(end, self.dp)
        self.shard_size = self.numel // self.dp
        self.flat = torch.zeros(self.numel, dtype=dtype, device=params[0].device)
        self.work = None

    def view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter i's slice of a flat buffer laid out like this bucket."""
        p = self.params[i]
        return flat[self.offsets[i]:self.offsets[i] + p.numel()].view_as(p)

    def shard(self, flat: torch.Tensor, rank: int) -> torch.Tensor:
        return flat[rank * self.shard_size:(rank + 1) * self.shard_size]


def bucket_layout(numels: list[int], dtypes: list[torch.dtype], shared: list[bool],
                  bucket_size: int, expert: list[bool] | None = None) -> list[list[int]]:
    """The parameters (indices) of each bucket (module docstring; a larger parameter alone),
    from sizes alone, so the memory planner lays buckets out as this buffer does: the
    dense parameters, then the expert ones, then each shared embedding alone."""
    expert = expert or [False] * len(numels)
    out = []
    for experts in (False, True):
        size, start = 0, len(out)
        for i in range(len(numels)):
            if shared[i] or expert[i] != experts:
                continue
            if (len(out) == start or dtypes[i] != dtypes[out[-1][0]]
                    or size + numels[i] > bucket_size):
                out.append([])
                size = 0
            out[-1].append(i)
            size += numels[i]
    return out + [[i] for i in range(len(numels)) if shared[i]]


def padded_size(numel: int, dp: int) -> int:
    """A bucket's length: its elements rounded up to a multiple of the DP size."""
    return -(-numel // dp) * dp


class GradBuffer:
    """`group` reduces the dense parameters' buckets (DP x CP, or a shard group of it),
    `expert_group` the expert ones (expert-DP or a shard group of it; None: `group`);
    `replica_group` and `expert_replica_group` sum their shards across replicas (hybrid
    sharding, `shard` only; None: one replica)."""

    def __init__(self, params: list[nn.Parameter], group, bucket_size: int, *, shard: bool = False,
                 overlap: bool = False, grad_dtype: torch.dtype | None = None,
                 expert_group=None, replica_group=None, expert_replica_group=None):
        self.group, self.shard = group, shard
        self.overlap = overlap
        expert = [is_expert_parallel(p) for p in params]
        layout = bucket_layout([p.numel() for p in params], [p.dtype for p in params],
                               [is_shared_embedding(p) for p in params], bucket_size, expert)
        if expert_group is None:
            expert_group, expert_replica_group = group, replica_group
        self.buckets = [Bucket([params[i] for i in b], grad_dtype or params[b[0]].dtype,
                               *((expert_group, expert_replica_group) if expert[b[0]]
                                 else (group, replica_group))) for b in layout]
        self.compressor = None
        """A PowerSGD (distributed/powersgd.py) when the reduction is compressed."""
        self.linear_step: LinearStep | None = None
        """The model's LinearStep (weight_grad.py), set by the step that owns it
        (train_step.StepRunner): a gradient its B pass deferred is counted in the W pass."""
        self.check_finite = False
        """Note whether this rank's own gradients are finite before a reduction mixes them
        with the other ranks' (`local_nonfinite`): the NaN check then names the rank where
        a NaN starts, as Megatron's does (set by the StepRunner that checks)."""
        self.local_nonfinite: torch.Tensor | None = None
        self._where = {}
        for bucket in self.buckets:
            for i, p in enumerate(bucket.params):
                p.main_grad = bucket.view(bucket.flat, i)
                self._where[id(p)] = (bucket, i)
        self._in_place = all(b.flat.dtype == b.params[0].dtype for b in self.buckets)
        if overlap or not self._in_place:
            for p in params:
                p.register_post_accumulate_grad_hook(self._on_grad_accumulated)
        self.start_step(1)

    def start_step(self, num_microbatches: int):
        """Zero the buffers and point every .grad at its view (an optimizer may have set
        .grad to None, e.g. after skipping an fp16 overflow step)."""
        self.num_microbatches = num_microbatches
        for bucket in self.buckets:
            bucket.flat.zero_()
            bucket.work = None
            for p in bucket.params:
                p.grad = p.main_grad if self._in_place else None
        self.local_nonfinite = None
        self._ready = {id(b): 0 for b in self.buckets}
        self._counts = {id(p): 0 for b in self.buckets for p in b.params}
        self.launched_during_backward = 0
        self.bytes_sent = 0

    @property
    def compressing(self) -> bool:
        """Whether this step's reduction is compressed (nothing is launched in backward)."""
        return self.compressor is not None and self.compressor.active

    @property
    def compression_ratio(self) -> float | None:
        """The step's DP bytes uncompressed (every bucket whole) / the bytes sent."""
        whole = sum(b.flat.numel() * b.flat.element_size() for b in self.buckets)
        return whole / self.bytes_sent if self.bytes_sent else None

    @property
    def cross_replica_bytes(self) -> float:
        """Bytes this rank sends per step across replicas (hybrid_bytes' closed form): each
        sharded bucket's shard all-reduced over its replica group."""
        if not self.shard:
            return 0.0
        return sum(cross_replica_bytes(b.shard_size, group_size(b.replica_group),
                                       b.flat.element_size()) for b in self.buckets)

    def _count(self, tensor: torch.Tensor):
        self.bytes_sent += tensor.numel() * tensor.element_size()

    def _on_grad_accumulated(self, param: nn.Parameter):
        if self.linear_step is not None and self.linear_step.deferred(param):
            # a split backward's B: the gradient comes in W
            return
        bucket, _ = self._where[id(param)]
        self._move_into_buffer(param)
        if not self.overlap or self.compressing:
            return
        self._counts[id(param)] += 1
        # One accumulation per micro-batch: the last one makes this gradient final.
        if self._counts[id(param)] == self.num_microbatches:
            self._ready[id(bucket)] += 1
            if self._ready[id(bucket)] == len(bucket.params):
                self._launch(bucket)
                self.launched_during_backward += 1

    def _move_into_buffer(self, param: nn.Parameter):
        """Autograd accumulates in place into a .grad of the buffer's dtype; should it have
        replaced the tensor, or if the buffer has another dtype, add the values in."""
        if param.grad is None or param.grad.data_ptr() == param.main_grad.data_ptr():
            return
        if self._in_place:
            param.main_grad.copy_(param.grad)
            param.grad = param.main_grad
        else:
            param.main_grad.add_(param.grad)
            param.grad = None

    def _note_nonfinite(self, bucket: Bucket):
        if self.check_finite and bucket.dp > 1:
            bad = ~torch.isfinite(bucket.flat).all()  # stays on the device: no sync
            self.local_nonfinite = bad if self.local_nonfinite is None \
                else self.local_nonfinite | bad

    def _launch(self, bucket: Bucket):
        if bucket.dp == 1:
            return
        self._note_nonfinite(bucket)
        self._count(bucket.flat)
        if self.shard:
            bucket.work = reduce_scatter_into(bucket.shard(bucket.flat, bucket.dp_rank),
                                              bucket.flat, bucket.group, async_op=True)
        else:
            bucket.work = dist.all_reduce(bucket.flat, group=bucket.group, async_op=True)

    def _reduce_across_replicas(self, bucket: Bucket):
        """Hybrid sharding's second step: this rank's reduced shard summed over the same
        shard of the other replicas (asynchronously; the work handle)."""
        if not self.shard or group_size(bucket.replica_group) == 1:
            return None
        shard = bucket.shard(bucket.flat, bucket.dp_rank)
        self._count(shard)
        return dist.all_reduce(shard, group=bucket.replica_group, async_op=True)

    def finish(self):
        """Every bucket summed over DP: launch what the hooks did not, wait for all."""
        compressing = self.compressing
        for bucket in self.buckets:
            for p in bucket.params:
                self._move_into_buffer(p)
            if not compressing and bucket.work is None:
                self._launch(bucket)
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
            if not compressing:  # PowerSGD's reduction spans the replicas itself
                bucket.work = self._reduce_across_replicas(bucket)
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
                bucket.work = None
        if compressing:
            for bucket in self.buckets:
                self._note_nonfinite(bucket)
            self.compressor.reduce(self.buckets, self._count)
        if self.compressor is not None:
            self.compressor.steps += 1
