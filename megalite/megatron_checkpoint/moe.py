"""Megatron-LM mixture-of-experts checkpoints in megalite's terms (layout.py's MoE half).

megatron.core's MoE layer (`MoELayer`: `router`, `experts`, `shared_experts`) keeps megalite's
names except for the routed experts, which Megatron holds one module per expert and megalite
as one stacked tensor per layer, [E, 2F, h] for fc1 ([gate; up] per expert, as Megatron's
SwiGLU fc1) and [E, h, F] for fc2:
- legacy torch, SequentialMLP (local spec): `mlp.experts.local_experts.{e}.linear_fc1.weight`;
  TEGroupedMLP (Transformer Engine spec, --moe-grouped-gemm): `mlp.experts.linear_fc1.weight{e}`.
  Each file holds its EP rank's experts numbered from 0 (`mp_rank_TT[_PPP]_EEE` with EP > 1),
  each expert TP-sharded like the dense MLP, so stacking one TP rank's experts gives the TP
  shard of megalite's stacked tensor (fc1 split on dim 1 with stride 2, fc2 on dim 2).
- torch_dist: `decoder.layers.mlp.experts.experts.linear_fc1.weight` [layers, E, 2F, h], the
  same for SequentialMLP and TEGroupedMLP (Megatron keeps the two interchangeable).
Megatron's legacy GroupedMLP (--moe-use-legacy-grouped-gemm: `weight1` [h, E*2F], a raw
view per expert) is refused by name: save it with --ckpt-format torch_dist.

The MoE fields come from the checkpoint's args with Megatron's defaults (those of GPTConfig,
which are Megatron's); what megalite's MoE layer does not compute is refused by name, and so
is, in torch_dist, a mix of dense and MoE layers (each stacked tensor then holds only some
layers' rows). The router's `expert_bias` (an fp32 buffer, --moe-router-enable-expert-bias)
has the same name in both. Megatron's --moe-router-dtype is not refused: megalite's router
always runs in fp32.
"""

import argparse
import dataclasses
import re

from megalite.config import GPTConfig
from megalite.errors import CheckpointError, ConfigError
from megalite.validation.moe import check_groups, layer_pattern

# Megatron args megalite copies as they are (GPTConfig fields of the same name).
_COPIED = ("moe_router_topk", "moe_shared_expert_intermediate_size",
           "moe_router_load_balancing_type", "moe_aux_loss_coeff", "moe_z_loss_coeff",
           "moe_router_enable_expert_bias", "moe_router_bias_update_rate",
           "moe_router_score_function", "moe_router_pre_softmax", "moe_expert_capacity_factor",
           "moe_token_drop_policy", "moe_pad_expert_input_to_capacity", "moe_grouped_gemm",
           "moe_router_num_groups", "moe_router_group_topk", "moe_router_topk_scaling_factor")
# Megatron MoE args that change what the model computes and megalite does not build (set in
# args: refused).
_UNBUILT = ("moe_input_jitter_eps", "moe_shared_expert_gate", "moe_apply_probs_on_input",
            "moe_use_legacy_grouped_gemm")
_LOAD_BALANCING = ("aux_loss", "seq_aux_loss", "none")

EXPERTS = "mlp.experts."
_LOCAL_EXPERT = re.compile(r"(.*\.mlp\.experts\.)local_experts\.(\d+)\.(linear_fc[12]\.weight)")
_TE_GROUPED = re.compile(r"(.*\.mlp\.experts\.)(linear_fc[12]\.weight)(\d+)")
_LEGACY_GROUPED = re.compile(r".*\.mlp\.experts\.weight[12]")
TORCH_DIST_EXPERTS = "mlp.experts.experts."


def moe_fields(args: argparse.Namespace, where: str) -> dict:
    """GPTConfig's MoE fields from a Megatron run's args ({} for a dense model)."""
    if not getattr(args, "num_experts", None):
        return {}
    unbuilt = [f"{n}={getattr(args, n)!r}" for n in _UNBUILT if getattr(args, n, None)]
    balancing = getattr(args, "moe_router_load_balancing_type", "aux_loss")
    if balancing not in _LOAD_BALANCING:
        unbuilt.append(f"moe_router_load_balancing_type={balancing!r}")
    if unbuilt:
        raise CheckpointError(f"Megatron checkpoint {where} uses MoE features megalite does "
                              f"not have: {', '.join(unbuilt)}")
    defaults = {f.name: f.default for f in dataclasses.fields(GPTConfig)}
    fields = {n: getattr(args, n) if getattr(args, n, None) is not None else defaults[n]
              for n in _COPIED}
    try:  # as Megatron's TransformerConfig checks them
        check_groups(argparse.Namespace(**fields, num_experts=args.num_experts))
    except ConfigError as error:
        raise CheckpointError(f"Megatron checkpoint {where}: {error}") from None
    try:
        pattern = layer_pattern(getattr(args, "moe_layer_freq", None) or 1, args.num_layers)
    except ConfigError as error:
        raise CheckpointError(f"Megatron checkpoint {where}: moe_layer_freq: {error}") from None
    # How tokens travel does not change what is computed: Megatron's flex (DeepEP) moves
    # them as alltoall does.
    dispatcher = getattr(args, "moe_token_dispatcher_type", None) or defaults[
        "moe_token_dispatcher_type"]
    return dict(fields, num_experts=args.num_experts, moe_layer_pattern=pattern,
                moe_ffn_hidden_size=getattr(args, "moe_ffn_hidden_size", None)
                or getattr(args, "ffn_hidden_size", None) or 4 * args.hidden_size,
                moe_token_dispatcher_type="alltoall" if dispatcher == "flex" else dispatcher)


def legacy_expert(name: str, where: str) -> tuple[str, int] | None:
    """(megalite's stacked name, local expert index) of a legacy per-expert key; None for any
    other key."""
    found = _LOCAL_EXPERT.fullmatch(name)
    if found:
        return found[1] + found[3], int(found[2])
    found = _TE_GROUPED.fullmatch(name)
    if found:
        return found[1] + found[2], int(found[3])
    if _LEGACY_GROUPED.fullmatch(name):
        raise CheckpointError(f"Megatron checkpoint {where} holds {name}, the legacy "
                              f"GroupedMLP's layout (--moe-use-legacy-grouped-gemm): megalite "
                              f"reads its experts from a --ckpt-format torch_dist save")
    return None


def megatron_args(config: GPTConfig) -> dict:
    """The MoE args a Megatron run of `config` records (moe_fields inverted; EP 1)."""
    if not config.num_experts:
        return {}
    return dict({n: getattr(config, n) for n in _COPIED}, num_experts=config.num_experts,
                moe_ffn_hidden_size=config.moe_ffn_hidden_size,
                moe_layer_freq=[int(config.is_moe_layer(i)) for i in range(config.num_layers)],
                moe_token_dispatcher_type=config.moe_token_dispatcher_type,
                expert_model_parallel_size=1)


def layer_mlp_names(config: GPTConfig, layer: int) -> list[str] | None:
    """Megatron's legacy keys of MoE layer `layer`'s MLP in its state-dict order (router,
    experts, shared experts), `_extra_state` included; None for a dense layer."""
    if not config.is_moe_layer(layer):
        return None
    names = ["mlp.router.weight"] + ["mlp.router.expert_bias"] * \
        config.moe_router_enable_expert_bias
    linears = [f"{EXPERTS}local_experts.{e}.linear_fc{k}" for e in range(config.num_experts)
               for k in (1, 2)]
    if config.moe_shared_expert_intermediate_size:
        linears += ["mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2"]
    for linear in linears:
        names += [f"{linear}.weight", f"{linear}._extra_state"]
    return names


def torch_dist_extra_states(config: GPTConfig, layer: int,
                            stacked: bool = True) -> list[str] | None:
    """torch_dist's `_extra_state` keys of MoE layer `layer`'s MLP (layers stacked, so
    without the layer number in the module path); None for a dense layer. `stacked` False:
    an MTP layer's, which no layer offset shards (`shard_{e}_{E}`, `shard_0_1`)."""
    if not config.is_moe_layer(layer):
        return None
    layers, experts = config.num_layers, config.num_experts
    at, of = (f"{layer}.", f"{layers}.") if stacked else ("", "")
    keys = [f"{TORCH_DIST_EXPERTS}linear_fc{k}._extra_state/shard_{at}{e}_{of}{experts}"
            for e in range(experts) for k in (1, 2)]
    if config.moe_shared_expert_intermediate_size:
        shard = f"shard_{layer}_{layers}" if stacked else "shard_0_1"
        keys += [f"mlp.shared_experts.linear_fc{k}._extra_state/{shard}" for k in (1, 2)]
    return keys
