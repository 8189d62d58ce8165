"""Fully sharded data parallelism with torch's FSDP2 (`fully_shard`): ZeRO-2 and ZeRO-3
(Rajbhandari et al. 2020, "P_os+g" and "P_os+g+p"), --use-torch-fsdp2.

Each transformer layer, the embedding, the output layer and then the model chunk itself
become one FSDP unit over a 1-D DeviceMesh of megalite's own data x context-parallel group
(DP x CP ranks hold the same parameters; "DP" below means DP x CP, as for ZeRO-1). A unit's
parameters are DTensors sharded along dim 0 over DP; what is sharded is this rank's tensor-
parallel shard (TP layers keep their plain TP tensors, FSDP knows nothing of TP), so DP rank
r holds rows [r*c, (r+1)*c) of its TP shard, c = ceil(rows / DP) (torch.chunk's rule).
A unit all-gathers its parameters before its forward and again before its backward, and
reduce-scatters their gradients after it:

- ZeRO-3 (--data-parallel-sharding-strategy optim_grads_params, the default): parameters
  are freed after the forward (reshard_after_forward=True): per rank (2+2+12)Psi/N bytes,
  one more all-gather per step than ZeRO-2, 1.5x plain DP's traffic;
- ZeRO-2 (optim_grads): parameters kept gathered from the forward to the backward
  (reshard_after_forward=False), gradients and optimizer state sharded.

The sharded fp32 parameters are the optimizer's main copy (optimizer/fsdp_optimizer.py);
FSDP's MixedPrecisionPolicy gathers them in the compute dtype and reduces gradients in fp32
under --accumulate-allreduce-grads-in-fp32. Gradients are summed over DP, not averaged (the
loss is already divided by the global batch's token count, see train_step.py). With m
micro-batches per step they are accumulated unsharded and reduce-scattered once, after the
last micro-batch (`set_requires_gradient_sync`): P gradient elements per rank, one
reduce-scatter per step. With --fsdp-grad-reduce-every-micro-batch each unit reduce-scatters
after every micro-batch's backward and FSDP2 adds the result into the sharded gradients
(Megatron-FSDP's way): a rank holds unsharded only the gradients of the unit whose backward
runs, for m reduce-scatters per step. A tied embedding used on the same stage as the output
layer stays in the chunk's own unit (gathered for the whole forward of the chunk): as its own
unit it would be resharded after the embedding lookup, before the output layer reads it.
"""

import contextlib
import math
import sys
import warnings

import torch
from torch import nn

from megalite.distributed.hybrid_bytes import cross_replica_bytes, fsdp_padded_numel
from megalite.parallel_state import to_collective_device
from megalite.tensor_parallel.params import copy_tags, is_dtensor, is_expert_parallel

ZERO2, ZERO3 = "optim_grads", "optim_grads_params"
"""--data-parallel-sharding-strategy values (Megatron-FSDP's names)."""


def apply_fsdp(chunks: nn.ModuleList, dp_group, device: torch.device, *, strategy: str = ZERO3,
               param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None,
               cpu_offload: bool = False, expert_mesh=None) -> nn.ModuleList:
    """Shard every model chunk (GPTModel) over `dp_group` (a process group, or a DeviceMesh:
    `data_parallel_mesh`'s) in place; returns `chunks`. The chunks' parameters must be fp32
    (the main copy); `param_dtype` is the dtype of the gathered compute parameters,
    `reduce_dtype` that of the gradient reduction. `expert_mesh` (None: the experts with
    their layer) shards each MoE layer's routed experts, a unit of their own."""
    # The last stage returns its per-token losses transposed, a view: FSDP2 warns that an
    # in-place op on it would skip its backward hook; the executor never modifies it.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view")
    # Imported here, not at the top: it loads DTensor (see params.is_dtensor).
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import (CPUOffloadPolicy, MixedPrecisionPolicy,
                                        OffloadPolicy, fully_shard)
    mesh = dp_group if isinstance(dp_group, DeviceMesh) else DeviceMesh.from_group(dp_group,
                                                                                 device.type)
    kwargs = dict(mesh=mesh, reshard_after_forward=strategy == ZERO3,
                  # Inputs stay as they are: activations already have the compute
                  # dtype, and the fp32 RoPE table must not be rounded (see gpt.py).
                  mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype,
                                                 reduce_dtype=reduce_dtype,
                                                 cast_forward_inputs=False),
                  # gpu_check: fsdp_offload
                  offload_policy=CPUOffloadPolicy(pin_memory=device.type == "cuda")
                  if cpu_offload else OffloadPolicy())
    for chunk in chunks:
        with keeping_tags(chunk):
            for module in fsdp_units(chunk):
                for experts in expert_units(module) if expert_mesh is not None else []:
                    fully_shard(experts, **{**kwargs, "mesh": expert_mesh})
                fully_shard(module, **kwargs)
            fully_shard(chunk, **kwargs)
        for module in chunk.modules():
            if is_fsdp_module(module):
                # Sum over DP (FSDP2 averages by default), with a plain SUM collective
                # (a factor of 1 would otherwise be NCCL's PreMulSum, which gloo lacks).
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)
    return chunks


@contextlib.contextmanager
def keeping_tags(module: nn.Module):
    """megalite's parameter tags (tensor_parallel/params.py) across an operation that
    replaces the parameter objects or their attributes (fully_shard, to_empty)."""
    tags = {name: dict(vars(p)) for name, p in module.named_parameters()}
    yield
    for name, p in module.named_parameters():
        copy_tags(tags[name], p)


def fsdp_units(chunk: nn.Module) -> list[nn.Module]:
    """The submodules of a chunk that become their own FSDP unit, in forward order. A
    module used again later in the chunk's forward stays in the root unit, gathered for
    the whole forward and backward: a tied embedding as the output layer, and with MTP the
    embedding and the output layer, which every depth uses again."""
    mtp = chunk.mtp
    reused = chunk.post_process and (chunk.output_layer is None or mtp is not None)
    embedding = [chunk.embedding] if chunk.embedding is not None and not reused else []
    output = [chunk.output_layer] if chunk.output_layer is not None and mtp is None else []
    depths = list(mtp.layers) if mtp is not None else []
    return embedding + list(chunk.decoder.layers.values()) + depths + output


def expert_units(module: nn.Module) -> list[nn.Module]:
    """The outermost submodules of `module` holding only expert-parallel parameters (a MoE
    layer's routed experts): sharded over expert-DP, not DP x CP (torchtitan's way)."""
    out = []
    for sub in module.modules():
        params = list(sub.parameters())
        if params and all(is_expert_parallel(p) for p in params) and \
                not any(sub in inner.modules() for inner in out):
            out.append(sub)
    return out


def data_parallel_mesh(state, device_type: str, expert: bool = False):
    """The DeviceMesh FSDP2 shards over: 1-D over the DP x CP group (the expert-DP group
    for `expert`) with one replica; with N replicas 2-D (replicate, shard), N x S ranks,
    row i replica i's shard group: HSDP, FSDP2 reducing within a shard group, then across
    replicas (torchtitan's data_parallel_replicate x shard)."""
    from torch.distributed.device_mesh import DeviceMesh
    shard = state.expert_shard_group if expert else state.shard_group
    if state.num_replicas == 1:
        return DeviceMesh.from_group(shard, device_type)
    replica = state.expert_replica_group if expert else state.replica_group
    return DeviceMesh.from_group([replica, shard], device_type,
                                 mesh=state.grid.replica_mesh(state.rank, expert),
                                 mesh_dim_names=("replicate", "shard"))


def is_fsdp_module(module: nn.Module) -> bool:
    """Whether fully_shard made `module` an FSDP unit (never, before torch.distributed.fsdp
    is imported: apply_fsdp imports it)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(module, fsdp.FSDPModule)


def is_fully_sharded(chunks: nn.ModuleList) -> bool:
    return any(is_fsdp_module(chunk) for chunk in chunks)


def set_gradient_sync(chunk: nn.Module, sync: bool):
    """Whether the next backward of `chunk` reduce-scatters its gradients (the last
    micro-batch) or accumulates them unsharded with no communication (the others)."""
    if is_fsdp_module(chunk):
        chunk.set_requires_gradient_sync(sync)


def local_shard_range(param: nn.Parameter) -> tuple[int, int]:
    """[start, end) of this rank's FSDP shard within the flattened (TP-shard) parameter:
    whole rows, as torch.chunk splits dim 0; the whole tensor when not a DTensor."""
    if not is_dtensor(param):
        return 0, param.numel()
    local = param.to_local()
    dim = _shard_dim(param)
    rows, dp = param.shape[0], param.device_mesh.size(dim)
    rank = param.device_mesh.get_local_rank(dim)
    per_rank = -(-rows // dp)
    first = min(rank * per_rank, rows)
    if local.shape[0] != min(per_rank, rows - first):
        raise RuntimeError(f"FSDP shard of {tuple(param.shape)} on DP rank {rank}: "
                           f"{local.shape[0]} rows, expected {min(per_rank, rows - first)}")
    row = math.prod(param.shape[1:])  # (not param[0]: indexing a DTensor all-gathers it)
    return first * row, first * row + local.numel()


def _shard_dim(param) -> int:
    """The mesh dimension an FSDP2 parameter is sharded over (HSDP's 2-D mesh replicates
    over the other)."""
    return next(i for i, placement in enumerate(param.placements) if placement.is_shard())


def shard_group(params):
    """The process group the dense FSDP2 parameters among `params` are sharded over
    (apply_fsdp's; under HSDP one replica's shard group): their shards are disjoint there."""
    param = next(p for p in params if is_dtensor(p) and not is_expert_parallel(p))
    return param.device_mesh.get_group(_shard_dim(param))


def fsdp_cross_replica_bytes(params, grad_bytes: int) -> float:
    """Bytes this rank sends across replicas per gradient reduction under HSDP
    (hybrid_bytes' closed form): each parameter's padded shard all-reduced over the
    replicate dimension of its 2-D mesh; 0 with one replica."""
    total = 0.0
    for p in params:
        if is_dtensor(p) and p.device_mesh.ndim == 2:
            s = p.device_mesh.size(_shard_dim(p))
            total += cross_replica_bytes(fsdp_padded_numel(tuple(p.shape), s) // s,
                                         p.device_mesh.size(1 - _shard_dim(p)), grad_bytes)
    return total


def full_tensor(param: torch.Tensor) -> torch.Tensor:
    """The whole (TP-shard) value: all-gathered over DP for an FSDP parameter (every DP
    rank must call it), the tensor itself otherwise. An offloaded shard lives on the host:
    it is gathered on the device the mesh's collectives need (as torch's own state-dict
    helpers do), so the result may be there."""
    if not is_dtensor(param):
        return param
    return to_collective_device(param, shard_group([param])).full_tensor()


@torch.no_grad()
def copy_into(param: torch.Tensor, value: torch.Tensor):
    """Set a parameter from its whole (TP-shard) value: an FSDP parameter keeps its rows."""
    if is_dtensor(param):
        start, end = local_shard_range(param)
        local = param.to_local()
        local.copy_(value.reshape(-1)[start:end].view_as(local))
    else:
        param.copy_(value)


def fully_shard_model(chunks: nn.ModuleList, config, state, device: torch.device) -> nn.ModuleList:
    """--use-torch-fsdp2 on the chunks build_model made on `meta` (shapes and tags, no
    storage), then storage for this rank's shards only, left for the caller to initialise
    (torchtitan's build -> shard -> initialise): no rank ever holds its whole model."""
    p, par = config.precision, config.parallel
    # Over DP x CP (module docstring, as ZeRO-1 and Megatron-FSDP), which sums grads over
    # both; the experts over expert-DP; each over a 2-D mesh under HSDP.
    apply_fsdp(chunks, data_parallel_mesh(state, device.type), device,
               strategy=par.data_parallel_sharding_strategy,
               param_dtype=p.params_dtype, reduce_dtype=config.grad_dtype,
               cpu_offload=par.optimizer_cpu_offload,
               expert_mesh=data_parallel_mesh(state, device.type, expert=True)
               if state.ep_size > 1 else None)
    # Offloaded shards live on the host (CPUOffloadPolicy); FSDP moves them for compute.
    with keeping_tags(chunks):
        chunks.to_empty(device="cpu" if par.optimizer_cpu_offload else device)
    return chunks
