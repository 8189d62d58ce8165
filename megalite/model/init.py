"""Initial values: every parameter drawn from (run seed, its single-process name) alone,
in full and then sharded, so every layout starts from the same weights (docs/design.md
§3). Megatron's init, with Megatron's names."""

import hashlib
import math

import torch
from torch import nn

from megalite.config import GPTConfig
from megalite.tensor_parallel.params import (VOCAB_PARAMS, is_expert_parallel, pad_vocab_rows,
                                             partition_dim, partition_stride,
                                             single_process_name, tp_shard)


def parameter_seed(seed: int, name: str) -> int:
    """A generator seed per (run seed, parameter name in the single-process model), so a
    parameter's initial value does not depend on construction order or layout."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def initial_value(name: str, shape: torch.Size, config: GPTConfig, seed: int,
                  device: torch.device | str = "cpu") -> torch.Tensor:
    """The full (unsharded) initial tensor of parameter `name`, in fp32 on `device`, drawn
    by a generator of that device (CPU and CUDA generators differ: the weights are the same
    at every layout on one kind of device, docs/design.md §3).

    Megatron's init: biases 0, norm weights 1, everything else normal(0, std), except the
    projections that write into the residual stream (attention output, MLP down), whose
    std is divided by sqrt(2 x num_layers) (GPT-2 §2.3) so the residual variance does
    not grow with depth. Vocabulary rows are drawn for the real vocabulary only and the
    padding rows are zero, so the values do not depend on how much padding TP needs.
    """
    fp32 = dict(dtype=torch.float32, device=device)
    if name.endswith(".bias"):
        return torch.zeros(shape, **fp32)
    if "layernorm" in name or name.endswith((".enorm.weight", ".hnorm.weight")):
        return torch.ones(shape, **fp32)
    std = config.init_method_std
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        std /= math.sqrt(2.0 * config.num_layers)
    rows = shape[0]
    if name.endswith(VOCAB_PARAMS) and config.vocab_size:
        rows = config.vocab_size
    generator = torch.Generator(device=device).manual_seed(parameter_seed(seed, name))
    values = torch.empty((rows, *shape[1:]), **fp32).normal_(0.0, std, generator=generator)
    return pad_vocab_rows(values, shape[0])


def full_initial_value(name: str, param: nn.Parameter, config: GPTConfig, seed: int,
                       tp_size: int, device: torch.device | None = None,
                       ep_rank: int = 0) -> torch.Tensor:
    """The full tensor of `param` (of a routed expert weight, the full tensor of this EP
    rank's experts), drawn on `device` (default the parameter's). SwiGLU's fused [gate; up]
    fc1 draws its two blocks as the separate gate and up projections did
    (`linear_fc1_gate.*`, `linear_fc1.*`), so the initial weights did not change when the
    two were fused."""
    shape, dim = list(param.shape), partition_dim(param)
    device = device or param.device
    if dim is not None:
        shape[dim] *= tp_size
    stride = partition_stride(param)
    if is_expert_parallel(param):
        # Routed experts [E_local, ...]: expert e's block from its own name
        # (`...mlp.experts.{e}.linear_fc1.weight`), so an EP rank draws only its experts
        # and every EP size starts from the same weights.
        first = ep_rank * shape[0]
        return torch.stack([
            _full_block(name.replace(".experts.", f".experts.{e}."), shape[1:], dim - 1,
                        stride, config, seed, device)
            for e in range(first, first + shape[0])])
    return _full_block(name, shape, dim, stride, config, seed, device)


def _full_block(name: str, shape: list[int], dim: int | None, stride: int, config: GPTConfig,
                seed: int, device) -> torch.Tensor:
    if stride == 1:
        return initial_value(name, torch.Size(shape), config, seed, device)
    shape = list(shape)
    shape[dim] //= 2
    return torch.cat([initial_value(name.replace("linear_fc1", "linear_fc1_gate"),
                                    torch.Size(shape), config, seed, device),
                      initial_value(name, torch.Size(shape), config, seed, device)],
                     dim=dim)


@torch.no_grad()
def initialize_parameters(model: nn.Module, config: GPTConfig, seed: int, tp_rank: int = 0,
                          tp_size: int = 1, device: torch.device | None = None,
                          assign=torch.Tensor.copy_, ep_rank: int = 0):
    """Every parameter from its full single-process value, drawn on `device` (default the
    parameter's): a tensor-parallel shard takes its block of the full tensor, so any TP
    size starts from the same weights. `assign(param, block)` stores it (FSDP2 keeps its
    rows of the block: distributed/fsdp.py). Parameters on `meta` (a model built only to
    be measured, or to be sharded first) are left."""
    for name, param in model.named_parameters():
        if param.is_meta:
            continue
        name = single_process_name(name, param)  # a tied output layer starts equal
        full = full_initial_value(name, param, config, seed, tp_size, device, ep_rank)
        assign(param, tp_shard(full, param, name, tp_rank, tp_size))


def initialize_buffers(model: nn.Module, device: torch.device):
    """Every buffer from its initial value, on `device` (the compute device): a model built
    on `meta` and given storage by to_empty has none, and under FSDP2's CPU offload that
    storage is on the host. Each module that owns buffers says how (`reset_buffers`)."""
    for module in model.modules():
        if hasattr(module, "reset_buffers"):
            module.reset_buffers(device)
