"""Parameter statistics for the log line (Megatron's --log-params-norm); the zeros in
the gradients are counted by the optimizer, which knows which shard it stepped
(Optimizer.num_zeros_in_grad)."""

import torch
import torch.distributed as dist

from megalite.optimizer.optimizer import params_for_norm, squared_norm
from megalite.parallel_state import group_size


@torch.no_grad()
def params_norm(params: list[torch.Tensor], tp_group, model_parallel_group) -> float:
    """L2 norm of the model's parameters, each distinct parameter counted once across TP
    and PP (as the grad norm counts gradients), in fp32. The parameters are replicated
    over DP (gathered, under ZeRO-1), so DP needs no reduction."""
    squares = squared_norm([p.detach() for p in params_for_norm(params, tp_group)])
    if params:
        squares = squares.to(params[0].device)
    if group_size(model_parallel_group) > 1:
        dist.all_reduce(squares, group=model_parallel_group)
    return squares.sqrt().item()
