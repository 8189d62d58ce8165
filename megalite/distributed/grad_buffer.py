"""Contiguous gradient buffers, bucketed, reduced over data parallelism once per step.

Each parameter's .grad is a view into a flat bucket buffer (one dtype per bucket, buckets
of at most --ddp-bucket-size elements). Autograd accumulates every micro-batch's gradient
into that view in place, so no communication happens until the step's backward passes
are done; then each bucket is summed over the DP group with one all-reduce of its buffer,
without copies. Under --overlap-grad-reduce a bucket's all-reduce is launched
asynchronously as soon as its last gradient of the step has been accumulated, while the
backward of earlier layers is still running (Li et al. 2020, PyTorch DDP §3.2.3).
"""

import torch
import torch.distributed as dist
from torch import nn

from megalite.distributed.data_parallel import buckets
from megalite.parallel_state import group_size


class _Bucket:
    def __init__(self, params: list[nn.Parameter]):
        self.params = params
        self.offsets, offset = [], 0
        for p in params:
            self.offsets.append(offset)
            offset += p.numel()
        self.flat = torch.zeros(offset, dtype=params[0].dtype, device=params[0].device)
        self.work = None

    def view(self, i: int) -> torch.Tensor:
        p = self.params[i]
        return self.flat[self.offsets[i]:self.offsets[i] + p.numel()].view_as(p)


class GradBuffer:
    def __init__(self, params: list[nn.Parameter], group, bucket_size: int,
                 num_microbatches: int, overlap: bool = False):
        self.group = group
        self.num_microbatches = num_microbatches
        self.launched_during_backward = 0
        self.buckets = [_Bucket(b) for b in buckets(params, bucket_size)]
        self._where = {id(p): (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        self._ready: dict[int, int] = {}
        if overlap:
            for p in params:
                p.register_post_accumulate_grad_hook(self._on_grad_accumulated)

    def start_step(self):
        """Zero the buffers and point every .grad at its view (an optimizer may have set
        .grad to None, e.g. after skipping an fp16 overflow step)."""
        for bucket in self.buckets:
            bucket.flat.zero_()
            bucket.work = None
            for i, p in enumerate(bucket.params):
                p.grad = bucket.view(i)
        self._ready = {id(b): 0 for b in self.buckets}
        self._counts = {id(p): 0 for b in self.buckets for p in b.params}
        self.launched_during_backward = 0

    def _on_grad_accumulated(self, param: nn.Parameter):
        bucket, i = self._where[id(param)]
        self._keep_in_buffer(bucket, i)
        self._counts[id(param)] += 1
        # One accumulation per micro-batch: the last one makes this gradient final.
        if self._counts[id(param)] == self.num_microbatches:
            self._ready[id(bucket)] += 1
            if self._ready[id(bucket)] == len(bucket.params):
                self._launch(bucket)
                self.launched_during_backward += 1

    def _keep_in_buffer(self, bucket: _Bucket, i: int):
        """Autograd accumulates in place into .grad; should it ever have replaced the
        tensor instead, copy the values back into the buffer."""
        p = bucket.params[i]
        view = bucket.view(i)
        if p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad)
            p.grad = view

    def _launch(self, bucket: _Bucket):
        if group_size(self.group) > 1:
            bucket.work = dist.all_reduce(bucket.flat, group=self.group, async_op=True)

    def finish(self):
        """Every bucket summed over DP: launch what the hooks did not, wait for all."""
        for bucket in self.buckets:
            for i in range(len(bucket.params)):
                if bucket.params[i].grad is not None:
                    self._keep_in_buffer(bucket, i)
            if bucket.work is None:
                self._launch(bucket)
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
                bucket.work = None
