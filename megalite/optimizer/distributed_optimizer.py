"""ZeRO-1 (Rajbhandari et al. 2020, "P_os"): optimizer state sharded over data parallelism,
with fp32 main parameters for bf16/fp16 model parameters (Micikevicius et al. 2018).

The parameters are laid out, in order, in flat buckets of at most `bucket_size` elements,
each padded to a multiple of the DP size and cut into DP equal shards. DP rank r owns
shard r of every bucket: it keeps fp32 main copies of (its pieces of) the parameters in
that shard and their Adam moments, and nothing for the rest, so optimizer memory is
12 bytes x parameters / DP. One step:

  1. reduce-scatter each bucket's gradients over DP: rank r receives the sum of shard r
     (the same bytes on the wire as the all-reduce of plain DP: 2(N-1)/N split in two);
  2. unscale (fp16), agree on overflow across every rank, clip by the global norm;
  3. AdamW on the owned shard in fp32;
  4. all-gather the updated shards over DP back into every rank's parameters.

Gradients are summed, not averaged, over DP: every rank's loss is already divided by the
loss-token count of the whole global batch (see megalite/train_step.py).
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from megalite.config import OptimizerConfig
from megalite.distributed.data_parallel import DEFAULT_BUCKET_SIZE, buckets
from megalite.optimizer.optimizer import (Optimizer, clip_grads, found_nonfinite,
                                          global_grad_norm, no_weight_decay,
                                          params_for_norm)
from megalite.parallel_state import all_gather_into, group_rank, group_size, reduce_scatter_into


@dataclass
class Segment:
    """The part [start, end) of `param` (flattened) that lies in this rank's shard, at
    `shard_offset` within the shard; `main` is its fp32 master copy."""
    param: nn.Parameter
    start: int
    end: int
    shard_offset: int
    main: torch.Tensor


@dataclass
class Bucket:
    params: list[nn.Parameter]
    numel: int
    """Padded to a multiple of the DP size."""
    shard_size: int
    segments: list[Segment]


class DistributedOptimizer(Optimizer):
    """ZeRO-1 over `dp_group`. With dp_group None it shards nothing: the same fp32 main
    parameters and moments for the whole model, which is how bf16/fp16 model parameters
    are trained under plain data parallelism (gradients then arrive already summed)."""

    def __init__(self, model: nn.Module, config: OptimizerConfig, grad_scaler=None,
                 tp_group=None, model_parallel_group=None, dp_group=None,
                 bucket_size: int = DEFAULT_BUCKET_SIZE):
        self.config = config
        self.grad_scaler = grad_scaler
        self.model_parallel_group = model_parallel_group
        self.dp_group = dp_group
        self.handles_data_parallel = dp_group is not None
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.norm_params = {id(p) for p in params_for_norm(self.params, tp_group)}
        dp, rank = group_size(dp_group), group_rank(dp_group)
        self.buckets = [_layout(b, dp, rank) for b in buckets(self.params, bucket_size)]
        no_decay = {id(p) for n, p in model.named_parameters() if no_weight_decay(n, p)}
        segments = [s for b in self.buckets for s in b.segments]
        self.adam = torch.optim.AdamW(
            [{"params": [s.main for s in segments if id(s.param) not in no_decay],
              "weight_decay": config.weight_decay},
             {"params": [s.main for s in segments if id(s.param) in no_decay],
              "weight_decay": 0.0}],
            lr=config.lr, betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps)

    def optimizer_state_bytes(self) -> int:
        """Bytes of fp32 main parameters and Adam moments held by this rank."""
        total = 0
        for s in (s for b in self.buckets for s in b.segments):
            total += s.main.numel() * s.main.element_size()
            for value in self.adam.state.get(s.main, {}).values():
                if torch.is_tensor(value) and value.dim() > 0:
                    total += value.numel() * value.element_size()
        return total

    @torch.no_grad()
    def step(self) -> tuple[bool, float | None]:
        for bucket in self.buckets:
            self._reduce_scatter_grads(bucket)
        segments = [s for b in self.buckets for s in b.segments]
        if self.grad_scaler is not None:
            inv_scale = 1.0 / self.grad_scaler.scale
            for s in segments:
                s.main.grad.mul_(inv_scale)
            # Agreed by all ranks: the DP shards and the model-parallel pieces differ.
            found_inf = found_nonfinite([s.main.grad for s in segments], dist.group.WORLD)
            self.grad_scaler.update(found_inf)
            if found_inf:
                self.zero_grad()
                return False, None
        # DP shards are disjoint; TP/PP duplicates are left out as in the plain optimizer.
        grad_norm = global_grad_norm(
            [s.main.grad for s in segments if id(s.param) in self.norm_params],
            [self.dp_group, self.model_parallel_group])
        if self.config.clip_grad > 0:
            clip_grads([s.main for s in segments], self.config.clip_grad, grad_norm)
        self.adam.step()
        for bucket in self.buckets:
            self._all_gather_params(bucket)
        return True, grad_norm.item()

    def _reduce_scatter_grads(self, bucket: Bucket):
        # In the gradients' own dtype, as Megatron does: bf16 gradients move half the bytes.
        flat = torch.zeros(bucket.numel, dtype=bucket.params[0].dtype,
                           device=bucket.params[0].device)
        offset = 0
        for p in bucket.params:
            if p.grad is not None:
                flat[offset:offset + p.numel()] = p.grad.reshape(-1)
            offset += p.numel()
        shard = torch.empty(bucket.shard_size, dtype=flat.dtype, device=flat.device)
        if group_size(self.dp_group) > 1:
            reduce_scatter_into(shard, flat, self.dp_group)
        else:
            shard.copy_(flat)
        for s in bucket.segments:
            s.main.grad = shard[s.shard_offset:s.shard_offset + s.end - s.start].float()

    def _all_gather_params(self, bucket: Bucket):
        """Every rank's updated shard, rounded to the parameters' dtype, to every rank."""
        device, dtype = bucket.params[0].device, bucket.params[0].dtype
        shard = torch.zeros(bucket.shard_size, dtype=dtype, device=device)
        for s in bucket.segments:
            shard[s.shard_offset:s.shard_offset + s.end - s.start] = s.main
        flat = torch.empty(bucket.numel, dtype=dtype, device=device)
        if group_size(self.dp_group) > 1:
            all_gather_into(flat, shard, self.dp_group)
        else:
            flat.copy_(shard)
        offset = 0
        for p in bucket.params:
            p.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()

    def state_dict(self) -> dict:
        state = {"adam": self.adam.state_dict(),
                 "main_params": [s.main for b in self.buckets for s in b.segments]}
        if self.grad_scaler is not None:
            state["grad_scaler"] = self.grad_scaler.state_dict()
        return state


def _layout(params: list[nn.Parameter], dp: int, rank: int) -> Bucket:
    """Place `params` back to back, pad to a multiple of dp, and find which pieces of
    which parameters fall in shard `rank`."""
    numel = sum(p.numel() for p in params)
    padded = -(-numel // dp) * dp
    shard_size = padded // dp
    lo, hi = rank * shard_size, (rank + 1) * shard_size
    segments, offset = [], 0
    for p in params:
        start, end = max(lo, offset), min(hi, offset + p.numel())
        if start < end:
            main = p.detach().reshape(-1)[start - offset:end - offset].float().clone()
            segments.append(Segment(p, start - offset, end - offset, start - lo, main))
        offset += p.numel()
    return Bucket(params, padded, shard_size, segments)
