"""The model a checkpoint holds: the config fields it records (metadata "model") and
the check that refuses a checkpoint of another model before any weight is loaded."""

from pathlib import Path

from megalite.errors import CheckpointError

MOE_MODEL_FIELDS = ("num_experts", "moe_ffn_hidden_size", "moe_layer_pattern",
                    "moe_shared_expert_intermediate_size")
MLA_MODEL_FIELDS = ("multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim",
                    "qk_pos_emb_head_dim", "v_head_dim", "rope_type", "rotary_scaling_factor",
                    "mscale", "mscale_all_dim", "yarn_original_max_position_embeddings",
                    "yarn_beta_fast", "yarn_beta_slow")
MODEL_FIELDS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
    "kv_channels", "vocab_size", "max_position_embeddings", "position_embedding_type",
    "rotary_base", "rotary_percent", "normalization", "swiglu", "add_bias_linear",
    "untie_embeddings_and_output_weights", "qk_layernorm", "mtp_num_layers"
) + MOE_MODEL_FIELDS + MLA_MODEL_FIELDS
"""What makes weights mean the same model. Not padded_vocab_size: it depends on TP and is
resharded on load. Not norm_epsilon: it shapes no weight, and checkpoints converted from other
codebases legitimately run with another epsilon (1e-5 vs 1e-6). A dense model records no
MoE field, a model without --multi-latent-attention no MLA field, and a model without
--qk-layernorm, --mtp-num-layers or DeepSeek's routing flags (group-limited routing, the top-k
scaling factor) not those (saving.model_fields), so checkpoints from before them compare, and
are written, as they were."""
RECORDED_WHEN_SET = ("qk_layernorm", "mtp_num_layers", "moe_router_topk_scaling_factor",
                     "moe_router_num_groups", "moe_router_group_topk")
MOE_FIELDS = MOE_MODEL_FIELDS + ("moe_router_topk", "moe_router_score_function",
                                 "moe_router_pre_softmax", "moe_router_enable_expert_bias",
                                 "moe_router_topk_scaling_factor", "moe_router_num_groups",
                                 "moe_router_group_topk")
RECORDED_FIELDS = MODEL_FIELDS + ("seq_length", "norm_epsilon", "init_method_std") + MOE_FIELDS
"""The model config a checkpoint records (metadata "model"): the compared fields and the
rest of what rebuilds the model (tools/convert_checkpoint.py), not how it is run (backend,
dropout, recompute, sequence parallelism), which is free to differ on load."""


def check_model_compatible(saved: dict, current: dict, fields: tuple[str, ...] = MODEL_FIELDS,
                           *, checkpoint: str | Path | None = None) -> None:
    """Refuses a checkpoint of another model before any weight is loaded.

    `saved` comes from the checkpoint's metadata, `current` from this run's model config. A
    field absent from both is skipped; absent from one side counts as a difference.
    """
    absent = "<not recorded>"
    differing = [(f, saved.get(f, absent), current.get(f, absent)) for f in fields
                 if saved.get(f, absent) != current.get(f, absent)]
    if differing:
        name = f"checkpoint {checkpoint}" if checkpoint is not None else "the checkpoint"
        lines = "".join(f"\n  {f}: checkpoint: {a!r}, this run: {b!r}" for f, a, b in differing)
        raise CheckpointError(f"{name} holds a different model; differing fields:{lines}")
