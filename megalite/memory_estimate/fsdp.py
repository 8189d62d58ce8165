"""Parameters, gradients and optimizer state of one pipeline rank under FSDP2 (ZeRO-2/3,
megalite/distributed/fsdp.py) and under --optimizer-cpu-offload (docs/memory.md).

With N = DP and P this rank's (TP-shard) parameters, a rank keeps P/N of everything
(torch.chunk rows of each parameter): fp32 parameter shards, which are the main copy (4
bytes each), fp32 gradient shards (4) and Adam's two moments (8): (2+2+12)P/N bytes, the
ZeRO paper's P_os+g+p total, held as 4+4+8. On top, at the peak of the step:
- gathered compute parameters (the parameters' dtype): ZeRO-2 keeps every unit gathered
  from its forward to its backward, all P of them; ZeRO-3 per chunk its own (root) unit,
  gathered for the whole forward, and in backward the unit running and the one FSDP2
  prefetches: the root plus the two largest units;
- with more than one micro-batch per step, the gradients accumulated unsharded (in the
  reduction dtype) until the last micro-batch reduce-scatters them: P elements (none under
  --fsdp-grad-reduce-every-micro-batch, which reduce-scatters each into the shards);
- the reduction of one unit: FSDP2 copies the unit's unsharded gradients into one
  reduce-scatter input in the reduction dtype (each parameter's rows padded to a multiple
  of N) and frees the gradients only after that copy, so at that moment both exist, for
  the largest unit: u (parameters' dtype) + u_padded (reduction dtype). Accumulating
  unsharded, the copy reads the accumulated gradients (counted above) and a micro-batch's
  new gradients are added into them: the larger of u and u_padded alone.
Offload moves the shards (parameters, gradients, moments) to the host; the gathered
parameters, accumulated gradients and the reduction stay on the GPU.
"""

from megalite.config import Config
from megalite.distributed.fsdp import ZERO3, fsdp_units
from megalite.tensor_parallel.params import is_expert_parallel, partition_dim


def _numels(param, t: int, grid) -> tuple[int, int]:
    """(elements of one TP (and EP) rank's shard of `param` (a whole meta parameter), one DP
    rank's rows of that shard): over a shard group of DP x CP, an expert weight's EP block
    over one of expert-DP."""
    split = partition_dim(param)
    rows = param.shape[0] // t if split == 0 else param.shape[0]
    numel = param.numel() // t if split is not None else param.numel()
    dp = grid.shard_size
    if is_expert_parallel(param):
        ep = grid.expert_model_parallel_size
        rows, numel, dp = rows // ep, numel // ep, grid.expert_shard_size
    return numel, -(-rows // dp) * (numel // rows)


def fsdp_weights(config: Config, chunks) -> dict:
    """weights.weights_and_optimizer's dict for --use-torch-fsdp2 (`chunks`: the rank's
    model chunks, weights.meta_chunks), plus bytes "host" (not on the GPU), "gathered"
    (compute parameters) and "reducing" (one unit's reduction), the transient parts of
    parameters and gradients."""
    par, pbytes, rbytes = config.parallel, config.precision.params_bytes, config.grad_bytes
    # FSDP2 shards over DP x CP, or a shard group of it under HSDP (distributed/fsdp.py).
    t, grid = par.tensor_model_parallel_size, par.grid

    def numels(params, which: int) -> int:  # 0: one TP (and EP) rank's shard, 1: its DP rows
        return sum(_numels(q, t, grid)[which] for q in params)
    num, shard = numels(chunks.parameters(), 0), numels(chunks.parameters(), 1)
    units = [_unit_parameters(chunk) for chunk in chunks]  # per chunk: root first
    if par.data_parallel_sharding_strategy == ZERO3:
        gathered = sum(numels(root, 0) + sum(sorted(numels(u, 0) for u in rest)[-2:])
                       for root, *rest in units)
    else:
        gathered = num
    deferred = config.training.num_microbatches > 1 and \
        not par.fsdp_grad_reduce_every_micro_batch
    accumulated = rbytes * num if deferred else 0
    # The reduction of the largest unit (module docstring).
    sizes = [(pbytes * numels(u, 0), rbytes * grid.shard_size * numels(u, 1))
             for chunk_units in units for u in chunk_units]
    reducing = max(max(pair) if deferred else sum(pair) for pair in sizes)
    host = 16 * shard if par.optimizer_cpu_offload else 0
    on_gpu = 0 if par.optimizer_cpu_offload else 1
    return dict(num_parameters=num, parameters=pbytes * gathered + on_gpu * 4 * shard,
                gradients=accumulated + reducing + on_gpu * 4 * shard,
                optimizer_state=on_gpu * 8 * shard, main_grads=0, host=host, owned=shard,
                gathered=pbytes * gathered, reducing=reducing)


def _unit_parameters(chunk) -> list[list]:
    """The parameters of each FSDP unit of a chunk: the root's own first, then
    fsdp_units' in forward order."""
    units = [list(u.parameters()) for u in fsdp_units(chunk)]
    in_units = {id(q) for u in units for q in u}
    return [[q for q in chunk.parameters() if id(q) not in in_units], *units]
