"""--check-weight-hash-across-dp-replicas-interval: every N iterations the data-parallel
replicas hash their parameters and compare (Megatron's
check_param_hashes_across_dp_replicas). Replicas that silently diverge (a flipped bit, a
non-deterministic kernel, a rank that skipped an update) otherwise train on unnoticed.

What is hashed is what must be equal across DP: the model's parameters, which under
ZeRO-1 are the all-gathered ones (the fp32 main shards differ by design). Each replica is
compared with DP rank 0's; a mismatch stops every rank with an error naming the
iteration, the parameter and the ranks that differ. Under expert parallelism the experts
are replicated only over the expert-data-parallel group, and compared there.
"""

import hashlib

import torch
import torch.distributed as dist

from megalite.errors import MegaliteError
from megalite.parallel_state import ParallelState, all_gather_first_dim
from megalite.tensor_parallel.params import is_expert_parallel


class ReplicaMismatchError(MegaliteError):
    """Data-parallel replicas hold different parameters."""


def parameter_digests(named_params: list[tuple[str, torch.Tensor]],
                      device: torch.device) -> torch.Tensor:
    """The first 8 bytes of each parameter's SHA-256 (its exact bits), as int64."""
    digests = []
    for _, p in named_params:
        data = p.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
        digests.append(int.from_bytes(hashlib.sha256(data).digest()[:8], "little", signed=True))
    return torch.tensor(digests, dtype=torch.int64, device=device)


def check_replicas(named_params: list[tuple[str, torch.Tensor]], dp_group,
                   iteration: int, device: torch.device):
    """Collective over every rank: raises ReplicaMismatchError on all of them if any DP
    group's replicas differ."""
    local = parameter_digests(named_params, device)
    ranks = dist.get_process_group_ranks(dp_group)
    table = all_gather_first_dim(local[None], dp_group).cpu()
    differs = (table != table[0]).any(dim=1)
    message = None
    if differs.any():
        bad = [ranks[i] for i in differs.nonzero().view(-1).tolist()]
        first = int((table != table[0]).any(dim=0).nonzero()[0])
        message = (f"iteration {iteration}: data-parallel replicas differ: rank(s) {bad} "
                   f"hold other values than rank {ranks[0]} (the first replica), first in "
                   f"parameter {named_params[first][0]}")
    # Every rank stops, also those whose own DP group agrees.
    flag = torch.tensor([message is not None], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item():
        raise ReplicaMismatchError(message or f"iteration {iteration}: data-parallel "
                                   "replicas differ in another data-parallel group")


def check_all_replicas(named_params: list[tuple[str, torch.Tensor]], state: ParallelState,
                       iteration: int, device: torch.device):
    """Collective over every rank: the dense parameters over DP, and with EP > 1 the expert
    parameters over expert-DP (every rank compares its list, empty on a pipeline stage
    without MoE layers, so the ranks' collectives stay paired)."""
    experts = [(n, p) for n, p in named_params if state.ep_size > 1 and is_expert_parallel(p)]
    dense = [(n, p) for n, p in named_params if not (state.ep_size > 1 and is_expert_parallel(p))]
    if state.dp_size > 1:
        check_replicas(dense, state.dp_group, iteration, device)
    if state.ep_size > 1 and state.expert_dp_size > 1:
        check_replicas(experts, state.expert_dp_group, iteration, device)
