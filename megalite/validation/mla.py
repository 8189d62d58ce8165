"""The multi-latent-attention flags (docs/design.md §32): the field derived from them
(`rope_type`), and the settings refused by name: inconsistent head sizes and the
combinations megalite's MLA does not run (Megatron's own checks first)."""

from megalite.config import ParallelConfig
from megalite.config.flags import flag_name
from megalite.errors import ConfigError
from megalite.validation.checks import check_positive

MLA_SIZES = ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")
# YaRN's flags with Megatron's defaults: another value needs --rope-type yarn.
YARN_DEFAULTS = dict(rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0,
                     yarn_original_max_position_embeddings=4096, yarn_beta_fast=32.0,
                     yarn_beta_slow=1.0)


def mla_model_fields(args, parallel: ParallelConfig) -> dict:
    """GPTConfig's rope_type (Megatron's default: yarn with MLA, rope without), after the
    checks of the MLA and YaRN flags."""
    mla = args.multi_latent_attention
    rope_type = args.rope_type or ("yarn" if mla else "rope")
    if mla:
        _check_heads(args)
        _check_combinations(args, parallel)
    elif rope_type != "rope":
        raise ConfigError(f"--rope-type {rope_type} applies to --multi-latent-attention "
                          "only (other attention takes rope)")
    if rope_type == "yarn":
        check_positive(args, "rotary_scaling_factor", "yarn_original_max_position_embeddings",
                       "yarn_beta_fast", "yarn_beta_slow")
    else:
        _check_yarn_flags_unset(args, "with --rope-type rope" if mla else
                                "without --multi-latent-attention")
    return dict(rope_type=rope_type)


def _check_yarn_flags_unset(args, where: str):
    given = [f"{flag_name(n)}={getattr(args, n)}" for n, default in YARN_DEFAULTS.items()
             if getattr(args, n) != default]
    if given:
        raise ConfigError(f"{', '.join(given)}: YaRN's flags need --multi-latent-attention "
                          f"with --rope-type yarn (its default there); got them {where}")


def _check_heads(args):
    """Head sizes and latent ranks that make one model."""
    check_positive(args, *MLA_SIZES, "q_lora_rank")
    if args.qk_pos_emb_head_dim % 2:
        raise ConfigError(f"RoPE rotates channel pairs: --qk-pos-emb-head-dim must be even, got "
                          f"{args.qk_pos_emb_head_dim}")
    for rank in ("q_lora_rank", "kv_lora_rank"):
        value = getattr(args, rank)
        if value is not None and value >= args.hidden_size:
            raise ConfigError(f"{flag_name(rank)}={value}: a latent of rank at least "
                              f"--hidden-size={args.hidden_size} compresses nothing; expected "
                              f"< {args.hidden_size}")


def _check_combinations(args, parallel: ParallelConfig):
    """What multi-latent attention does not run with, each by name."""
    if args.group_query_attention:  # Megatron's own check
        raise ConfigError("--multi-latent-attention and --group-query-attention are mutually "
                          "exclusive (Megatron's rule): MLA's keys and values come from one "
                          "latent per token, shared by all heads")
    if args.kv_channels is not None:
        raise ConfigError(f"--kv-channels={args.kv_channels} with --multi-latent-attention: "
                          "MLA's head sizes are --qk-head-dim, --qk-pos-emb-head-dim and "
                          "--v-head-dim; drop --kv-channels")
    if args.position_embedding_type == "learned_absolute":
        raise ConfigError("--position-embedding-type learned_absolute (the default) with "
                          "--multi-latent-attention: MLA's decoupled RoPE part carries the "
                          "positions; expected --position-embedding-type rope or none")
    if args.rotary_percent != 1.0:
        raise ConfigError(f"--rotary-percent={args.rotary_percent} with "
                          "--multi-latent-attention: RoPE rotates all of its "
                          "--qk-pos-emb-head-dim channels; expected 1.0")
    if args.fp8_format is not None:
        raise ConfigError(f"--fp8-format {args.fp8_format} with --multi-latent-attention: MLA's "
                          "projections have no FP8 GEMMs in megalite (not built)")
    backend = "flash" if args.use_flash_attn else args.attention_backend
    if backend == "flex":
        raise ConfigError("--attention-backend flex with --multi-latent-attention: "
                          "FlexAttention with MLA's separate K and V head sizes is not built; "
                          "use sdpa, unfused or flash")
    q_head = args.qk_head_dim + args.qk_pos_emb_head_dim
    if backend == "flash" and (args.v_head_dim > q_head or q_head > 256 or q_head % 8):
        raise ConfigError(f"--attention-backend flash with --multi-latent-attention pads V to "
                          f"the query/key head size (--qk-head-dim + --qk-pos-emb-head-dim = "
                          f"{q_head}), which must be <= 256, a multiple of 8 and at least "
                          f"--v-head-dim={args.v_head_dim}")
    tp = parallel.tensor_model_parallel_size
    if args.num_attention_heads % tp:
        raise ConfigError(f"--tensor-model-parallel-size={tp} must divide "
                          f"--num-attention-heads={args.num_attention_heads}")
