"""ZeRO-1 (Rajbhandari et al. 2020, "P_os"): optimizer state sharded over data parallelism,
with fp32 main parameters for bf16/fp16 model parameters (Micikevicius et al. 2018).

The layout is the gradient buffer's (distributed/grad_buffer.py): flat buckets padded to a
multiple of the DP size, each cut into DP equal shards. The model's parameters are made
views into flat parameter buffers laid out the same way. DP rank r owns shard r of every
bucket: it keeps fp32 main copies of (its pieces of) the parameters in that shard and
their Adam moments, and nothing for the rest, so optimizer memory is 12 bytes x
parameters / DP. One step:

  1. the gradient buffer reduce-scatters each bucket over DP (during backward under
     --overlap-grad-reduce): rank r holds the sum of shard r, in the buffer itself;
  2. unscale (fp16), agree on overflow across every rank, clip by the global norm;
  3. AdamW on the owned shard in fp32;
  4. round the shard into the parameters' dtype in place in the parameter buffer and
     all-gather the buckets over DP, in place too. Under --overlap-param-gather the
     all-gathers are only launched here; the first forward that needs a bucket's
     parameters waits for it (a forward pre-hook), so the gather overlaps the data
     loading and the forward of earlier layers.

Gradients are summed, not averaged, over DP: every rank's loss is already divided by the
loss-token count of the whole global batch (see megalite/train_step.py).

Without sharding (a gradient buffer with shard=False) every rank owns the whole of every
bucket: the same fp32 main parameters and moments for the whole model. That is how
bf16/fp16 parameters are trained under plain data parallelism.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from megalite.config import OptimizerConfig
from megalite.distributed.grad_buffer import Bucket, GradBuffer
from megalite.optimizer.optimizer import (Optimizer, clip_grads, found_nonfinite,
                                          global_grad_norm, no_weight_decay,
                                          params_for_norm)
from megalite.parallel_state import all_gather_into


@dataclass
class Segment:
    """The part [start, end) of `param` (flattened) that this rank owns: elements
    [flat_start, flat_start + end - start) of its bucket's flat buffers. `main` is the
    fp32 master copy."""
    param: nn.Parameter
    bucket: int
    start: int
    end: int
    flat_start: int
    main: torch.Tensor

    @property
    def flat(self) -> slice:
        return slice(self.flat_start, self.flat_start + self.end - self.start)


class DistributedOptimizer(Optimizer):
    """AdamW on fp32 main parameters, sharded over DP when `grad_buffer.shard`."""

    def __init__(self, model: nn.Module, config: OptimizerConfig, grad_scaler,
                 tp_group, model_parallel_group, grad_buffer: GradBuffer,
                 overlap_param_gather: bool = False):
        self.config = config
        self.grad_scaler = grad_scaler
        self.model_parallel_group = model_parallel_group
        self.grad_buffer = grad_buffer
        self.dp_group = grad_buffer.group if grad_buffer.shard else None
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.norm_params = {id(p) for p in params_for_norm(self.params, tp_group)}
        self.param_buffers = [_adopt_params(b) for b in grad_buffer.buckets]
        self.segments = [s for i, b in enumerate(grad_buffer.buckets)
                         for s in self._owned_segments(i, b)]
        no_decay = {id(p) for n, p in model.named_parameters() if no_weight_decay(n, p)}
        self.adam = torch.optim.AdamW(
            [{"params": [s.main for s in self.segments if id(s.param) not in no_decay],
              "weight_decay": config.weight_decay},
             {"params": [s.main for s in self.segments if id(s.param) in no_decay],
              "weight_decay": 0.0}],
            lr=config.lr, betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps)
        self._gathers: list = [None] * len(self.param_buffers)
        self.overlap_param_gather = overlap_param_gather
        if overlap_param_gather:
            _wait_before_forward(model, grad_buffer, self._wait_for_bucket)

    def _owned_range(self, bucket: Bucket) -> tuple[int, int]:
        if not self.grad_buffer.shard:
            return 0, bucket.numel
        rank = self.grad_buffer.dp_rank
        return rank * bucket.shard_size, (rank + 1) * bucket.shard_size

    def _owned_segments(self, index: int, bucket: Bucket) -> list[Segment]:
        lo, hi = self._owned_range(bucket)
        segments = []
        for p, offset in zip(bucket.params, bucket.offsets):
            start, end = max(lo, offset), min(hi, offset + p.numel())
            if start < end:
                main = p.detach().reshape(-1)[start - offset:end - offset].float().clone()
                segments.append(Segment(p, index, start - offset, end - offset, start, main))
        return segments

    def optimizer_state_bytes(self) -> int:
        """Bytes of fp32 main parameters and Adam moments held by this rank."""
        total = 0
        for s in self.segments:
            total += s.main.numel() * s.main.element_size()
            for value in self.adam.state.get(s.main, {}).values():
                if torch.is_tensor(value) and value.dim() > 0:
                    total += value.numel() * value.element_size()
        return total

    @torch.no_grad()
    def step(self) -> tuple[bool, float | None]:
        buckets = self.grad_buffer.buckets
        for s in self.segments:
            # A view when the buffer is fp32: unscaling and clipping then act in place.
            s.main.grad = buckets[s.bucket].flat[s.flat].float()
        grads = [s.main.grad for s in self.segments]
        if self.grad_scaler is not None:
            inv_scale = 1.0 / self.grad_scaler.scale
            for g in grads:
                g.mul_(inv_scale)
            # Agreed by all ranks: the DP shards and the model-parallel pieces differ.
            found_inf = found_nonfinite(grads, dist.group.WORLD)
            self.grad_scaler.update(found_inf)
            if found_inf:
                self.zero_grad()
                return False, None
        # DP shards are disjoint; TP/PP duplicates are left out as in the plain optimizer.
        grad_norm = global_grad_norm(
            [s.main.grad for s in self.segments if id(s.param) in self.norm_params],
            [self.dp_group, self.model_parallel_group])
        if self.config.clip_grad > 0:
            clip_grads([s.main for s in self.segments], self.config.clip_grad, grad_norm)
        self.adam.step()
        self._update_params()
        return True, grad_norm.item()

    def zero_grad(self):
        super().zero_grad()
        for s in self.segments:
            s.main.grad = None

    def _update_params(self):
        """Each rank's updated shard, rounded to the parameters' dtype, to every rank."""
        for s in self.segments:
            self.param_buffers[s.bucket][s.flat].copy_(s.main)
        if self.dp_group is None or self.grad_buffer.dp == 1:
            return
        for i, (bucket, flat) in enumerate(zip(self.grad_buffer.buckets, self.param_buffers)):
            lo, _ = self._owned_range(bucket)
            self._gathers[i] = all_gather_into(flat, flat[lo:lo + bucket.shard_size],
                                               self.dp_group, async_op=True)
        if not self.overlap_param_gather:
            self.finish_param_gather()

    def _wait_for_bucket(self, index: int):
        if self._gathers[index] is not None:
            self._gathers[index].wait()
            self._gathers[index] = None

    def finish_param_gather(self):
        """Wait for every parameter all-gather still in flight: before reading the
        parameters outside a forward (saving a checkpoint, comparing them in a test)."""
        for i in range(len(self._gathers)):
            self._wait_for_bucket(i)

    def checkpoint_segments(self) -> list[tuple]:
        """(param, start, end, main, state key) for each owned piece of a parameter."""
        return [(s.param, s.start, s.end, s.main, s.main) for s in self.segments]

    @torch.no_grad()
    def reload_main_params(self):
        """Main parameters from the model's (after loading a checkpoint without optimizer
        state: bf16 values, widened)."""
        for s in self.segments:
            s.main.copy_(s.param.detach().reshape(-1)[s.start:s.end])

    def state_dict(self) -> dict:
        state = {"adam": self.adam.state_dict(), "main_params": [s.main for s in self.segments]}
        if self.grad_scaler is not None:
            state["grad_scaler"] = self.grad_scaler.state_dict()
        return state


def _adopt_params(bucket: Bucket) -> torch.Tensor:
    """A flat parameter buffer laid out like `bucket`, holding the parameters' values,
    with each parameter's .data made a view into it, so the all-gather writes the
    parameters themselves."""
    p0 = bucket.params[0]
    flat = torch.zeros(bucket.numel, dtype=p0.dtype, device=p0.device)
    for i, p in enumerate(bucket.params):
        view = bucket.view(flat, i)
        view.copy_(p.detach())
        p.data = view
    return flat


def _wait_before_forward(model: nn.Module, grad_buffer: GradBuffer, wait):
    """Forward pre-hooks: a module waits for the all-gathers of its own parameters'
    buckets before it runs."""
    bucket_of = {id(p): i for i, b in enumerate(grad_buffer.buckets) for p in b.params}
    for module in model.modules():
        indices = sorted({bucket_of[id(p)] for p in module.parameters(recurse=False)
                          if id(p) in bucket_of})
        if indices:
            module.register_forward_pre_hook(_waiter(indices, wait))


def _waiter(indices: list[int], wait):
    def hook(_module, _args):
        for i in indices:
            wait(i)
    return hook
