"""The MoE layers' report for the log line and TensorBoard: Megatron's auxiliary losses
(each divided by its coefficient, as Megatron logs them: "load_balancing_loss",
"seq_load_balancing_loss", "z_loss") averaged over the micro-batches of the interval's
steps and over the MoE layers, and the expert load, the tokens each expert received.

Each MoE layer sums its losses and loads over the training forwards since the last report
(model/moe.py `MoELayer.metrics`); here they are summed over every rank (the micro-batches of
the other DP ranks, the partial sums of CP ranks, the layers of other pipeline stages) and
divided by the TP size, whose ranks all computed the same values."""

import torch
import torch.distributed as dist

from megalite.config import Config
from megalite.model.moe import MoELayer
from megalite.parallel_state import num_microbatches


def loss_coefficients(config: Config) -> dict[str, float]:
    """Megatron's names of the auxiliary losses this run computes, with their coefficients."""
    c, coefficients = config.model, {}
    if c.moe_router_load_balancing_type != "none" and c.moe_aux_loss_coeff > 0:
        coefficients["load_balancing_loss" if c.moe_router_load_balancing_type == "aux_loss"
                     else "seq_load_balancing_loss"] = c.moe_aux_loss_coeff
    if c.moe_z_loss_coeff:
        coefficients["z_loss"] = c.moe_z_loss_coeff
    return coefficients


def moe_report(chunks, config: Config, tp_size: int, iterations: int,
               device: torch.device) -> tuple[dict, dict]:
    """(log_line's moe_losses and expert_load, TensorBoard scalars) of the interval's
    `iterations` steps, and the layers' sums restart. Collective over every rank."""
    c = config.model
    if c.num_experts is None:
        return {}, {}
    coefficients = loss_coefficients(config)
    names = list(coefficients)
    table = torch.zeros(c.num_layers, len(names) + c.num_experts, device=device)
    for chunk in chunks:
        for index, layer in chunk.decoder.layers.items():
            if isinstance(layer.mlp, MoELayer):
                metrics, layer.mlp.metrics = layer.mlp.metrics, {}
                for j, name in enumerate(names):
                    table[int(index), j] = metrics.get(name, 0.0)
                if "tokens_per_expert" in metrics:
                    table[int(index), len(names):] = metrics["tokens_per_expert"]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(table)
    table /= tp_size
    moe = torch.tensor(c.moe_layer_pattern, device=device)
    microbatches = iterations * num_microbatches(config.training.global_batch_size,
                                                 config.training.micro_batch_size)
    losses = {name: (table[moe, j].mean() / microbatches / coefficients[name]).item()
              for j, name in enumerate(names)}
    load = table[moe, len(names):]
    per_layer = (load.max(dim=1).values / load.mean(dim=1).clamp(min=1e-9)).tolist()
    scalars = dict(losses)
    layers = [i for i, is_moe in enumerate(c.moe_layer_pattern) if is_moe]
    scalars.update({f"expert load max/mean layer {i}": v for i, v in zip(layers, per_layer)})
    return {"moe_losses": losses or None, "expert_load": max(per_layer)}, scalars
