"""Multi-latent attention in Megatron-LM checkpoints: its args and its layer's names.

megalite's MLA parameters carry Megatron's names (model/mla.py), so they map one to one.
Megatron's local spec keeps every norm under its own name (no fused
`linear_qkv.layer_norm_` in torch_dist, unlike its dense layer), which is what the export
writes; its Transformer Engine spec fuses the latent norms into the up-projections
(`linear_q_up_proj.layer_norm_weight`, `linear_kv_up_proj.layer_norm_weight`), which the
import reads as q_layernorm / kv_layernorm (FUSED_NORMS). The down-projections are whole on
every TP rank in megalite, as the TE spec's duplicated linears, and so exported; the local
spec splits them as column-parallel, which legacy files at TP > 1 show by their rows
(`shard_dim`).
"""

import argparse

from megalite.config import GPTConfig
from megalite.errors import CheckpointError

FUSED_NORMS = {"self_attention.linear_q_up_proj.layer_norm_": "self_attention.q_layernorm.",
               "self_attention.linear_kv_up_proj.layer_norm_": "self_attention.kv_layernorm."}
# GPTConfig field -> (Megatron's args name, Megatron's MLATransformerConfig default). The three
# YaRN fields Megatron's command line has no MLA flag for are read under MLATransformerConfig's
# names (a config saved as args has them) and megalite's (Megatron's --yarn-* flags).
_FIELDS = dict(q_lora_rank=("q_lora_rank", None), kv_lora_rank=("kv_lora_rank", 32),
               qk_head_dim=("qk_head_dim", 128), qk_pos_emb_head_dim=("qk_pos_emb_head_dim", 64),
               v_head_dim=("v_head_dim", 128), rope_type=("rope_type", "yarn"),
               rotary_scaling_factor=("rotary_scaling_factor", 1.0), mscale=("mscale", 1.0),
               mscale_all_dim=("mscale_all_dim", 0.0),
               yarn_original_max_position_embeddings=("original_max_position_embeddings", 4096),
               yarn_beta_fast=("beta_fast", 32.0), yarn_beta_slow=("beta_slow", 1.0))


# Megatron's MLA variants megalite does not build (set in args: refused).
_UNBUILT = ("mla_down_proj_fusion", "experimental_attention_variant", "cache_mla_latents")


def mla_fields(args: argparse.Namespace, where: str) -> dict:
    """GPTConfig's MLA fields from a Megatron run's args ({} without MLA)."""
    if not getattr(args, "multi_latent_attention", False):
        return {}
    unbuilt = [f"{n}={getattr(args, n)!r}" for n in _UNBUILT if getattr(args, n, None)]
    if unbuilt:
        raise CheckpointError(f"Megatron checkpoint {where} uses MLA features megalite does "
                              f"not have: {', '.join(unbuilt)}")
    fields = {}
    for field, (name, default) in _FIELDS.items():
        value = getattr(args, name, None)
        if value is None:
            value = getattr(args, field, None)
        fields[field] = default if value is None else value
    if fields["rope_type"] not in ("rope", "yarn"):
        raise CheckpointError(f"Megatron checkpoint {where}: rope_type="
                              f"{fields['rope_type']!r}, expected rope or yarn")
    # MLA rotates its own RoPE part whatever this says: rope and none mean the same there.
    kind = getattr(args, "position_embedding_type", None) or "learned_absolute"
    if kind not in ("rope", "none"):
        raise CheckpointError(f"Megatron checkpoint {where}: position_embedding_type={kind!r} "
                              f"with multi_latent_attention; megalite's MLA takes rope or none")
    return dict(fields, multi_latent_attention=True, position_embedding_type=kind)


def megatron_args(config: GPTConfig) -> dict:
    """The MLA args a Megatron run of `config` records (under both names for the three
    YaRN fields, see _FIELDS)."""
    if not config.multi_latent_attention:
        return {}
    args = {name: getattr(config, field) for field, (name, _) in _FIELDS.items()}
    args.update({field: getattr(config, field) for field in _FIELDS if field.startswith("yarn_")})
    return dict(args, multi_latent_attention=True)


def attention_modules(config: GPTConfig) -> tuple[str, ...]:
    """The attention modules of one MLA layer in megatron.core's registration order (its
    state-dict order)."""
    query = (("linear_q_proj",) if config.q_lora_rank is None
             else ("linear_q_down_proj", "linear_q_up_proj"))
    norms = ()
    if config.qk_layernorm:
        norms = ("kv_layernorm",) if config.q_lora_rank is None else ("q_layernorm",
                                                                       "kv_layernorm")
    modules = ("linear_proj", *query, "linear_kv_down_proj", "linear_kv_up_proj", *norms)
    return tuple(f"self_attention.{m}" for m in modules)


DOWN_PROJECTIONS = ("self_attention.linear_q_down_proj.weight",
                    "self_attention.linear_kv_down_proj.weight")


def shard_dim(name: str, pieces: list, full_rows: int, dim: int | None) -> int | None:
    """The dim along which a legacy checkpoint's TP `pieces` of `name` split it: megalite's
    `dim`, except for a down-projection Megatron's local spec saved as column-parallel (each
    piece 1/TP of its rows), where it is 0."""
    split = len(pieces) > 1 and pieces[0].shape[0] * len(pieces) == full_rows
    return 0 if dim is None and name.endswith(DOWN_PROJECTIONS) and split else dim


def is_linear(module: str) -> bool:
    """Whether an attention module of attention_modules is a linear (with an
    `_extra_state` entry in Megatron's checkpoints)."""
    return module.rsplit(".", 1)[-1].startswith("linear_")
