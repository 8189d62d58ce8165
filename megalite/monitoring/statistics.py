"""Parameter statistics for the log line (Megatron's --log-params-norm); the zeros in
the gradients are counted by the optimizer, which knows which shard it stepped
(Optimizer.num_zeros_in_grad)."""

import torch

from megalite.distributed.fsdp import shard_group
from megalite.optimizer.optimizer import params_for_norm, squared_norm_over_experts
from megalite.parallel_state import all_reduce_over
from megalite.tensor_parallel.params import is_dtensor, is_expert_parallel


@torch.no_grad()
def params_norm(params: list[torch.Tensor], tp_group, model_parallel_group,
                expert_group=None) -> float:
    """L2 norm of the model's parameters, each distinct parameter counted once across TP
    and PP (as the grad norm counts gradients), in fp32. The parameters are replicated
    over DP (gathered, under ZeRO-1), except under FSDP2: there each DP rank squares its
    own rows, where they live (on the host under --optimizer-cpu-offload), and the sums
    are added over the group they are sharded over. The experts' part is summed over the EP
    group `expert_group` (each EP rank holds other experts)."""
    counted = params_for_norm(params, tp_group)
    local = [p.to_local() if is_dtensor(p) else p.detach() for p in counted]
    squares = squared_norm_over_experts(local, [is_expert_parallel(p) for p in counted],
                                        expert_group)
    groups = [model_parallel_group]
    if params and is_dtensor(params[0]):
        groups.append(shard_group(params))
    all_reduce_over(squares, groups)
    return squares.sqrt().item()
