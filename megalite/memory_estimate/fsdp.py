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

import torch

from megalite.config import Config
from megalite.distributed.fsdp import ZERO3, fsdp_units
from megalite.model.gpt import build_model_chunks
from megalite.tensor_parallel.params import is_expert_parallel, partition_dim


def _shard_numel(param, t: int, grid) -> int:
    """One DP rank's rows of one TP rank's shard of `param` (a whole meta parameter): over a
    shard group of DP x CP, an expert weight's EP block over one of expert-DP."""
    rows = param.shape[0] // t if partition_dim(param) == 0 else param.shape[0]
    numel = param.numel() // t if partition_dim(param) is not None else param.numel()
    dp = grid.shard_size
    if is_expert_parallel(param):
        ep = grid.expert_model_parallel_size
        rows, numel, dp = rows // ep, numel // ep, grid.expert_shard_size
    return -(-rows // dp) * (numel // rows)


def fsdp_weights(config: Config, pp_rank: int, pbytes: int) -> dict:
    """weights.weights_and_optimizer's dict for --use-torch-fsdp2, plus bytes "host" (not
    on the GPU), "gathered" (compute parameters) and "reducing" (one unit's reduction),
    the transient parts of parameters and gradients."""
    par = config.parallel
    # FSDP2 shards over DP x CP, or a shard group of it under HSDP (distributed/fsdp.py).
    t, grid = par.tensor_model_parallel_size, par.grid
    with torch.device("meta"):
        chunks = build_model_chunks(config.model, 0, pp_rank, par.pipeline_model_parallel_size,
                                    par.virtual_pipeline_model_parallel_size or 1,
                                    layer_counts=par.pipeline_layer_counts)

    def local(params) -> int:  # elements of one TP (and EP) rank's shard
        return sum((q.numel() // t if partition_dim(q) is not None else q.numel())
                   // (grid.expert_model_parallel_size if is_expert_parallel(q) else 1)
                   for q in params)
    params = list(chunks.parameters())
    num = local(params)
    shard = sum(_shard_numel(q, t, grid) for q in params)
    units = [_unit_parameters(chunk) for chunk in chunks]  # per chunk: root first
    if par.data_parallel_sharding_strategy == ZERO3:
        gathered = sum(local(root) + sum(sorted(local(u) for u in rest)[-2:])
                       for root, *rest in units)
    else:
        gathered = num
    rbytes = config.grad_bytes
    deferred = config.training.num_microbatches > 1 and \
        not par.fsdp_grad_reduce_every_micro_batch
    accumulated = rbytes * num if deferred else 0
    # The reduction of the largest unit (module docstring).
    sizes = [(pbytes * local(u), rbytes * grid.shard_size * sum(_shard_numel(q, t, grid)
                                                                 for q in u))
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
