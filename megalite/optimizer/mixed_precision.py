"""fp32 main parameters for bf16/fp16 model parameters (Micikevicius et al. 2018; Megatron's
`Float16OptimizerWithFloat16Params`), their optimizer state optionally sharded over data
parallelism: ZeRO-1 (Rajbhandari et al. 2020, "P_os"), Megatron's `DistributedOptimizer`.

The layout is the gradient buffer's (distributed/grad_buffer.py): flat buckets padded to a
multiple of the DP size, each cut into DP equal shards (an expert bucket: into expert-DP
shards, over its own group). The model's parameters are made views into flat parameter
buffers laid out the same way. DP rank r owns shard r of every
bucket: it keeps fp32 main copies of (its pieces of) the parameters in that shard and
their Adam moments, and nothing for the rest, so optimizer memory is 12 bytes x
parameters / DP. One step:

  1. the gradient buffer reduce-scatters each bucket: rank r holds the sum of shard r;
  2-3. optimizer.py's step (unscale, overflow, clip, AdamW) on the owned shard in fp32;
  4. round the shard into the parameters' dtype in place in the parameter buffer and
     all-gather the buckets over DP, in place too. Under --overlap-param-gather the
     all-gathers are only launched here; the first forward that needs a bucket's
     parameters waits for it (a forward pre-hook), so the gather overlaps the data
     loading and the forward of earlier layers.

Gradients are summed, not averaged, over DP (the loss is already divided by the global
batch's loss-token count, train_step.py). Without sharding (shard=False) every rank owns
every bucket whole: how bf16/fp16 parameters train under plain data parallelism.
"""

import functools

import torch
from torch import nn

from megalite.config import OptimizerConfig
from megalite.distributed.grad_buffer import Bucket, GradBuffer
from megalite.timers import NO_TIMERS, Timers
from megalite.optimizer.optimizer import Optimizer, Segment
from megalite.parallel_state import all_gather_into


class MixedPrecisionOptimizer(Optimizer):
    """Sharded when the gradient buffer reduce-scatters (`grad_buffer.shard`,
    --use-distributed-optimizer)."""

    def __init__(self, model: nn.Module, config: OptimizerConfig, grad_scaler,
                 tp_group, model_parallel_group, grad_buffer: GradBuffer,
                 overlap_param_gather: bool = False, cpu_offload: bool = False,
                 timers: Timers = NO_TIMERS, expert_group=None):
        self.grad_buffer, self.dp_group = grad_buffer, grad_buffer.group
        self.sharded = grad_buffer.shard
        # --optimizer-cpu-offload: main parameters, moments and the step on the host.
        self.host = HostOffload(grad_buffer) if cpu_offload else None
        self.param_buffers = [_adopt_params(b) for b in grad_buffer.buckets]
        self._owned_params = [flat[slice(*self._owned_range(b))]
                              for b, flat in zip(grad_buffer.buckets, self.param_buffers)]
        super().__init__(model, config, grad_scaler, tp_group, model_parallel_group, timers,
                         expert_group)
        self._param_views = [self.param_buffers[s.bucket][s.flat] for s in self.segments]
        self._gathers: list = [None] * len(self.param_buffers)
        self.overlap_param_gather = overlap_param_gather
        if overlap_param_gather:
            _wait_before_forward(model, grad_buffer, self._wait_for_buckets_in_forward)

    def _reduce_groups(self) -> list:
        # DP shards are disjoint pieces; unsharded, every DP rank holds the same gradients.
        return [self.dp_group if self.sharded else None, self.model_parallel_group]

    def _expert_reduce_group(self):
        # Sharded, DP x CP already spans EP: the expert shards (over expert-DP) of all EP
        # ranks are disjoint pieces of all the experts.
        return None if self.sharded else self.expert_group

    def _owned_range(self, bucket: Bucket) -> tuple[int, int]:
        if not self.sharded:
            return 0, bucket.numel
        return bucket.dp_rank * bucket.shard_size, (bucket.dp_rank + 1) * bucket.shard_size

    def _owned_segments(self) -> list[Segment]:
        segments = []
        for index, (bucket, owned) in enumerate(zip(self.grad_buffer.buckets, self._owned_params)):
            lo, hi = self._owned_range(bucket)
            host = None if self.host is None else self.host.main_params(index, owned)
            for p, offset in zip(bucket.params, bucket.offsets):
                start, end = max(lo, offset), min(hi, offset + p.numel())
                if start < end:
                    piece = p.detach().reshape(-1)[start - offset:end - offset]
                    main = piece.float().clone() if host is None else host[start - lo:end - lo]
                    segments.append(Segment(p, start - offset, end - offset, main, index, start))
        return segments

    def _load_main_grads(self):
        """One fp32 conversion per bucket of the owned range (a view when the buffer is
        fp32: unscaling and clipping then act in place), each main's .grad a view of it."""
        owned = []
        for i, bucket in enumerate(self.grad_buffer.buckets):
            lo, hi = self._owned_range(bucket)
            grads = bucket.flat[lo:hi]
            owned.append((lo, grads.float() if self.host is None else self.host.grads(i, grads)))
        for s in self.segments:
            lo, grads = owned[s.bucket]
            s.main.grad = grads[s.flat_start - lo:s.flat_start - lo + s.end - s.start]

    def _copy_main_to_params(self):
        """Each rank's updated shard, rounded to the parameters' dtype, to every rank."""
        if self.host is not None:
            for i, owned in enumerate(self._owned_params):
                self.host.copy_main_params(i, owned)
        else:
            torch._foreach_copy_(self._param_views, [s.main for s in self.segments])
        if not self.sharded:
            return
        with self.timers("params-all-gather"):
            for i, (flat, owned) in enumerate(zip(self.param_buffers, self._owned_params)):
                bucket = self.grad_buffer.buckets[i]
                if bucket.dp > 1:  # over its own group: DP x CP, or expert-DP for experts
                    self._gathers[i] = all_gather_into(flat, owned, bucket.group, async_op=True)
            if not self.overlap_param_gather:
                self.finish_param_gather()

    @torch.compiler.disable  # a wait on collectives, never traced: it runs before the graph
    def _wait_for_buckets_in_forward(self, indices: list[int], _module, _args):
        for index in indices:
            if self._gathers[index] is not None:
                with self.timers("params-all-gather"):
                    self._gathers[index].wait()
                self._gathers[index] = None

    def finish_param_gather(self):
        """Wait for every parameter all-gather still in flight: before reading the
        parameters outside a forward (saving a checkpoint, comparing them in a test)."""
        for work in self._gathers:
            if work is not None:
                work.wait()
        self._gathers = [None] * len(self._gathers)

    @torch.no_grad()
    def reload_main_params(self):
        """Main parameters from the model's (after loading a checkpoint without optimizer
        state: bf16 values, widened)."""
        torch._foreach_copy_([s.main for s in self.segments],
                             [s.param.detach().reshape(-1)[s.start:s.end] for s in self.segments])


class HostOffload:
    """ZeRO-1 under --optimizer-cpu-offload: this rank's owned shard of the fp32 main
    parameters and Adam moments (made like them by AdamW) in host memory, so the step
    runs on the host. Per bucket, one host buffer holds the owned range of the main
    parameters (the mains are views of it) and one its reduced gradients, pinned when the
    model is on a GPU: each bucket's gradients come down, and its updated main parameters
    go back up into the parameter buffer, as one asynchronous DMA. On a CPU model the host
    is the model's own device: only the copies remain."""

    def __init__(self, grad_buffer: GradBuffer):
        self.pin = grad_buffer.buckets[0].flat.is_cuda if grad_buffer.buckets else False
        self._params, self._grads = {}, {}  # bucket index -> host buffer

    def _buffer(self, numel: int) -> torch.Tensor:
        return torch.empty(numel, dtype=torch.float32, device="cpu", pin_memory=self.pin)

    def main_params(self, bucket: int, owned: torch.Tensor) -> torch.Tensor:
        """fp32 host copy of a bucket's owned range of the parameter buffer."""
        self._params[bucket] = self._buffer(owned.numel()).copy_(owned)
        return self._params[bucket]

    def copy_main_params(self, bucket: int, owned: torch.Tensor):
        """The bucket's main parameters into its owned range of the parameter buffer,
        rounded to its dtype on the device (copy_ would round a cross-device copy on the
        host, into unpinned memory, and wait for it)."""
        owned.copy_(self._params[bucket].to(owned.device, non_blocking=self.pin))

    def grads(self, bucket: int, shard: torch.Tensor) -> torch.Tensor:
        """fp32 host copy of a bucket's owned gradient shard."""
        if bucket not in self._grads:
            self._grads[bucket] = self._buffer(shard.numel())
        host = self._grads[bucket].copy_(shard, non_blocking=self.pin)
        if self.pin:
            torch.cuda.current_stream(shard.device).synchronize()  # gpu_check: fsdp_offload
        return host


def _adopt_params(bucket: Bucket) -> torch.Tensor:
    """A flat parameter buffer laid out like `bucket`, holding the parameters' values,
    with each parameter's .data made a view into it, so the all-gather writes the
    parameters themselves."""
    flat = bucket.flat.new_zeros(bucket.numel, dtype=bucket.params[0].dtype)
    for i, p in enumerate(bucket.params):
        view = bucket.view(flat, i)
        view.copy_(p.detach())
        p.data = view
    return flat


def _wait_before_forward(model: nn.Module, grad_buffer: GradBuffer, wait):
    """Forward pre-hooks `wait(indices, module, args)`: a module waits for the all-gathers
    of its own parameters' buckets before it runs. A compiled module (a transformer layer
    under --compile-layers) waits once, for all of its parameters, before its compiled
    forward starts: dynamo would trace a hook on a module inside it, break the graph at
    Work.wait and guard on the hook's bucket indices, compiling the layers' shared forward
    once per layer until its recompile limit leaves the rest eager."""
    bucket_of = {id(p): i for i, b in enumerate(grad_buffer.buckets) for p in b.params}
    modules = [model]
    while modules:
        module = modules.pop()
        whole = module._compiled_call_impl is not None  # nn.Module.compile()'s
        indices = sorted({bucket_of[id(p)] for p in module.parameters(recurse=whole)
                          if id(p) in bucket_of})
        if indices:
            module.register_forward_pre_hook(functools.partial(wait, indices))
        if not whole:
            modules.extend(module.children())
