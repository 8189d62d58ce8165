"""Parameters, gradient buffer and optimizer state of one pipeline rank (docs/memory.md).

Nothing here restates the model or the buffer: the parameter list is the model's own
(`build_model_chunks` on the meta device: shapes and tags, no memory), the buckets are
`GradBuffer`'s rule (`bucket_layout`, `padded_size`) applied to those sizes.
"""

from torch import nn

from megalite.config import Config, OptimizerKind
from megalite.distributed.grad_buffer import bucket_layout, padded_size
from megalite.memory_estimate.fsdp import fsdp_weights
from megalite.memory_estimate.grad_compression import powersgd_bytes
from megalite.model.gpt import build_model_chunks
from megalite.tensor_parallel.params import (is_embedding_copy, is_expert_parallel,
                                             is_shared_embedding, is_tensor_parallel)


def meta_chunks(config: Config, pp_rank: int) -> nn.ModuleList:
    """This pipeline rank's model chunks, built by the model's own code on the meta device.
    Built without a TP group, so whole: `shard_numel` gives one TP rank's part of each
    parameter."""
    par = config.parallel
    return build_model_chunks(config.model, 0, pp_rank, par.pipeline_model_parallel_size,
                              par.virtual_pipeline_model_parallel_size or 1, device="meta",
                              layer_counts=par.pipeline_layer_counts)


def rank_parameters(config: Config, pp_rank: int) -> list[nn.Parameter]:
    """This pipeline rank's parameters in `model.parameters()` order (meta_chunks')."""
    return list(meta_chunks(config, pp_rank).parameters())


def shard_numel(config: Config, param: nn.Parameter) -> int:
    """Elements of one rank's shard of `param` (a whole parameter): a tensor-parallel layer
    splits one dimension evenly over TP, the routed experts' weights are also split over EP
    (their dim 0), the rest (norms, row-parallel biases, learned positions) is whole on
    every TP rank."""
    tp = config.parallel.tensor_model_parallel_size
    numel = param.numel() // tp if is_tensor_parallel(param) else param.numel()
    return numel // config.parallel.expert_model_parallel_size if is_expert_parallel(param) \
        else numel


def num_model_parameters(config: Config) -> int:
    """Distinct parameters of the whole model (a tied output layer counted once)."""
    return sum(param.numel() for pp_rank in range(config.parallel.pipeline_model_parallel_size)
               for param in rank_parameters(config, pp_rank) if not is_embedding_copy(param))


def _buckets(config: Config, params: list[nn.Parameter]) -> list[tuple[int, int, int]]:
    """(real elements, padded elements, size of the group it is reduced over) of each of
    this rank's gradient buckets: the dense ones over DP x CP, the experts' over expert-DP,
    each a shard group of it under hybrid sharding (GradBuffer's rule)."""
    numels = [shard_numel(config, param) for param in params]
    expert = [is_expert_parallel(param) for param in params]
    layout = bucket_layout(numels, [param.dtype for param in params],
                           [is_shared_embedding(param) for param in params],
                           config.parallel.ddp_bucket_size, expert)
    grid = config.parallel.grid
    out = []
    for bucket in layout:
        group = grid.expert_shard_size if expert[bucket[0]] else grid.shard_size
        real = sum(numels[i] for i in bucket)
        out.append((real, padded_size(real, group), group))
    return out


def grad_buckets(config: Config, params: list[nn.Parameter]) -> list[tuple[int, int]]:
    """(real elements, padded elements) of each of this rank's gradient buckets."""
    return [(real, padded) for real, padded, _ in _buckets(config, params)]


def weights_and_optimizer(config: Config, pp_rank: int) -> dict:
    """Bytes of parameters, gradients, optimizer state and fp32 main grads on DP rank 0,
    and "owned": the elements whose fp32 main copy and moments this rank's optimizer holds."""
    kind = config.optimizer_kind
    if kind is OptimizerKind.FULLY_SHARDED:
        return fsdp_weights(config, meta_chunks(config, pp_rank))
    params = rank_parameters(config, pp_rank)
    numels = [shard_numel(config, param) for param in params]
    layout = _buckets(config, params)
    num, padded = sum(numels), sum(n for _, n, _ in layout)
    pbytes, gbytes = config.precision.params_bytes, config.grad_bytes
    if kind.has_main_params:
        # DP rank 0 owns the first 1/shards of every bucket (shards: the bucket's group under
        # ZeRO-1), all of it real parameters; the parameters live in the padded buckets.
        owned = sum(min(real, padded_numel // (group if kind.sharded else 1))
                    for real, padded_numel, group in layout)
        state = dict(parameters=pbytes * padded, optimizer_state=12 * owned)
    else:  # plain AdamW: the parameters are the main copy, two fp32 moments
        owned = num
        state = dict(parameters=pbytes * num, optimizer_state=8 * num)
    state.update(num_parameters=num, gradients=gbytes * padded, owned=owned,
                 main_grads=0 if gbytes == 4 else 4 * owned,
                 grad_compression=powersgd_bytes(config, params, numels))
    if config.parallel.optimizer_cpu_offload:
        # The owned main parameters, moments and the fp32 gradient copies on the host
        # (mixed_precision.HostOffload).
        state["host"] = 12 * owned + 4 * owned
        state["optimizer_state"] = state["main_grads"] = 0
    return state
