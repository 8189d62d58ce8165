"""AdamW on FSDP2's sharded parameters (ZeRO-2/3, megalite/distributed/fsdp.py).

Each DP rank steps only its rows of every parameter: the fp32 local shard of the DTensor,
at once the model's parameter (FSDP gathers it for the forward) and the main copy, so AdamW
updates it in place; its gradient is the local shard of the reduce-scattered gradient. The
grad norm and fp16 overflow are agreed over DP (the shards are disjoint) and the
model-parallel group, as under ZeRO-1. Working on the plain local tensors keeps every
kernel one of optimizer.py's (foreach or fused) and every collective explicit. Under
--optimizer-cpu-offload the shards, their Adam state and gradients live on the host
(CPUOffloadPolicy), where the step runs torch's fused CPU AdamW.

Each shard is a Segment [start, end) of the flattened TP-shard parameter, exactly what a
ZeRO-1 rank owns of it, so checkpoints hold the same per-DP-rank optimizer files.
"""

from torch import nn

from megalite.distributed.fsdp import local_shard_range, shard_group
from megalite.timers import NO_TIMERS, Timers
from megalite.optimizer.optimizer import Optimizer, Segment


class FullyShardedOptimizer(Optimizer):
    sharded = True

    def __init__(self, model: nn.Module, config, grad_scaler, tp_group, model_parallel_group,
                 timers: Timers = NO_TIMERS):
        # The group the shards are disjoint over is the one apply_fsdp sharded over (DP, or
        # DP x CP under context parallelism): read from the parameters, not passed again.
        self.dp_group = shard_group(model.parameters())
        super().__init__(model, config, grad_scaler, tp_group, model_parallel_group, timers)

    def _owned_segments(self) -> list[Segment]:
        # A detached alias of FSDP's sharded storage: updating it updates the model.
        return [Segment(p, *local_shard_range(p), p.to_local().detach()) for p in self.params]

    def _reduce_groups(self) -> list:
        return [self.dp_group, self.model_parallel_group]

    def _load_main_grads(self):
        for s in self.segments:
            grad = s.param.grad
            s.main.grad = None if grad is None else grad.to_local()
