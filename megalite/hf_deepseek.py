"""The DeepSeek-V3 half of hf_convert.py: a megalite model with --multi-latent-attention is
HuggingFace's DeepseekV3ForCausalLM (transformers' modeling_deepseek_v3.py), and back.

What maps (megalite -> HF), docs/design.md §34:

- MLA: linear_q_proj / linear_q_down_proj, q_layernorm, linear_q_up_proj -> q_proj / q_a_proj,
  q_a_layernorm, q_b_proj; linear_kv_down_proj, kv_layernorm, linear_kv_up_proj, linear_proj ->
  kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj. The row layouts are the same (per
  head [no-RoPE, RoPE] for q; [latent, shared k_pe] for the KV down projection; per head [K, V]
  for the up projection), and HF's rope_interleave=True is megalite's interleaved RoPE part, so
  it is a renaming (an import of rope_interleave=False reorders the RoPE rows: from_hf).
  YaRN: rope_parameters {"rope_type": "yarn", factor, mscale, mscale_all_dim,
  original_max_position_embeddings, beta_fast, beta_slow}, with megalite's cos/sin factor
  written as attention_factor (HF infers another one when mscale or mscale_all_dim is 0).
- MoE: sigmoid routing with the expert bias (mlp.gate.e_score_correction_bias, always there in
  HF: zeros for a model without --moe-router-enable-expert-bias; the import sets the flag),
  norm_topk_prob (top k > 1: megalite's sigmoid renormalises exactly then),
  routed_scaling_factor (--moe-router-topk-scaling-factor), n_group / topk_group
  (--moe-router-num-groups / --moe-router-group-topk; HF scores a group by its top 2, Megatron by
  its top k / group_topk: they must agree), first_k_dense_replace (--moe-layer-freq: k dense
  layers, then MoE), n_shared_experts x moe_intermediate_size
  (--moe-shared-expert-intermediate-size). Experts under the hub's per-expert names, as
  hf_moe.py writes Qwen2-MoE's (transformers >= 5 fuses them on load into gate_up_proj
  [E, 2F, h] and down_proj [E, h, F], megalite's own layout).

MTP (--mtp-num-layers): depth k as DeepSeek's checkpoints keep it, layer num_layers + k
(enorm, hnorm, eh_proj, shared_head.norm = the depth's final_layernorm, a transformer layer of
the last layer's kind, and copies of the embedding and output layer: MTP_COPIES);
hf_deepseek_mtp.py reads it back from the files, which transformers' model does not load.

The latent-norm trap: transformers builds q_a_layernorm and kv_a_layernorm with eps 1e-6
whatever rms_norm_eps says, while megalite (as Megatron) uses --norm-epsilon for them. Both
directions warn when that epsilon is not 1e-6 (shared/testdata/megatron_mla_checkpoint:
1e-5 against 1e-6 moves its logits by 3e-5); the weights convert as they are.

Refused by name (ConfigError): what DeepseekV3ForCausalLM cannot compute (no latent norms,
softmax routing, pre-softmax, a capacity factor, MoE layers other than "k dense then all MoE",
a shared expert not a multiple of the expert width, LayerNorm, biases) and, on import, what
megalite does not build (other RoPE scalings, attention_bias,
num_key_value_heads != heads, norm_topk_prob against top k).
"""

import warnings

import torch

from megalite import hf_moe
from megalite.config import GPTConfig
from megalite.errors import ConfigError
from megalite.model.rotary import yarn_mscale
from megalite.tensor_parallel.params import VOCAB_PARAMS

MODEL_TYPE = "deepseek_v3"
ARCHITECTURE = "DeepseekV3ForCausalLM"
LATENT_NORM_EPS = 1e-6
"""The eps transformers' DeepseekV3Attention gives q_a_layernorm and kv_a_layernorm."""
# The expert bias: fp32 in megalite's router and in HF's (_keep_in_fp32_modules_strict); a
# bf16 copy would move the choice of experts.
FP32_SUFFIX = ".e_score_correction_bias"
# HF's group score: the sum of each group's top 2 (DeepseekV3TopkRouter).
_HF_GROUP_SCORE_TOP = 2

_ATTENTION = {"input_layernorm": "input_layernorm",
              "pre_mlp_layernorm": "post_attention_layernorm",
              "self_attention.linear_q_proj": "self_attn.q_proj",
              "self_attention.linear_q_down_proj": "self_attn.q_a_proj",
              "self_attention.q_layernorm": "self_attn.q_a_layernorm",
              "self_attention.linear_q_up_proj": "self_attn.q_b_proj",
              "self_attention.linear_kv_down_proj": "self_attn.kv_a_proj_with_mqa",
              "self_attention.kv_layernorm": "self_attn.kv_a_layernorm",
              "self_attention.linear_kv_up_proj": "self_attn.kv_b_proj",
              "self_attention.linear_proj": "self_attn.o_proj"}
_ROUTER = {"mlp.router.weight": ("mlp.gate.weight",),
           "mlp.router.expert_bias": ("mlp.gate.e_score_correction_bias",)}
# An MTP depth k's own tensors, in DeepSeek's layer num_layers + k; the rest of that layer is a
# transformer layer's (layer_prefixes), and it holds copies of the embedding and output layer.
_MTP = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight",
        "eh_proj.weight": "eh_proj.weight", "final_layernorm.weight": "shared_head.norm.weight"}
MTP_COPIES = {"embed_tokens.weight": "model.embed_tokens.weight",
              "shared_head.head.weight": "lm_head.weight"}
# DeepseekV3Config field -> GPTConfig field, in both directions.
_CONFIG_NAMES = dict(
    num_hidden_layers="num_layers", hidden_size="hidden_size", intermediate_size="ffn_hidden_size",
    num_attention_heads="num_attention_heads", max_position_embeddings="max_position_embeddings",
    rms_norm_eps="norm_epsilon", initializer_range="init_method_std", q_lora_rank="q_lora_rank",
    kv_lora_rank="kv_lora_rank", qk_nope_head_dim="qk_head_dim",
    qk_rope_head_dim="qk_pos_emb_head_dim", v_head_dim="v_head_dim")


def check_exportable(c: GPTConfig) -> None:
    """A ConfigError naming each field DeepseekV3ForCausalLM would compute differently."""
    misses = hf_moe.differences(c, dict(normalization="RMSNorm", swiglu=True,
                                        add_bias_linear=False,
                                        qk_layernorm=True))  # HF always has the latent norms
    if c.num_experts:
        dense = first_dense_layers(c)
        misses += hf_moe.differences(c, dict(
            moe_router_score_function="sigmoid", moe_router_pre_softmax=False,
            moe_expert_capacity_factor=None,
            moe_layer_pattern=(False,) * dense + (True,) * (c.num_layers - dense)))
        shared = c.moe_shared_expert_intermediate_size or 0
        if shared % c.moe_ffn_hidden_size:
            misses.append(f"moe_shared_expert_intermediate_size={shared} (needs a multiple of "
                          f"moe_ffn_hidden_size={c.moe_ffn_hidden_size}: HF's n_shared_experts)")
        if c.moe_router_num_groups and (c.moe_router_topk // c.moe_router_group_topk
                                        != _HF_GROUP_SCORE_TOP):
            misses.append(f"moe_router_topk // moe_router_group_topk = {c.moe_router_topk} // "
                          f"{c.moe_router_group_topk} (needs 2: HF scores a group by its top 2)")
    if c.mtp_depths and not c.num_experts:  # DeepSeek's MTP layer is past first_k_dense_replace
        misses.append(f"mtp_num_layers={c.mtp_num_layers} with a dense model (DeepSeek's MTP "
                      "layers are MoE layers)")
    if misses:
        raise ConfigError("no HuggingFace DeepseekV3ForCausalLM computes this multi-latent "
                          f"attention model: {', '.join(misses)}")
    warn_latent_norm_eps(c.norm_epsilon, "norm_epsilon")


def warn_latent_norm_eps(eps: float, name: str) -> None:
    if eps != LATENT_NORM_EPS:
        warnings.warn(f"{name}={eps}: transformers' DeepseekV3 builds its latent norms "
                      f"(q_a_layernorm, kv_a_layernorm) with eps {LATENT_NORM_EPS} whatever "
                      f"rms_norm_eps says, megalite with {name} as every norm: the two models' "
                      f"logits differ slightly (about 3e-5 for 1e-5 against 1e-6)")


def first_dense_layers(c: GPTConfig) -> int:
    """HF's first_k_dense_replace: the layers before the first MoE layer."""
    pattern = c.moe_layer_pattern or (False,) * c.num_layers
    return pattern.index(True) if True in pattern else c.num_layers


def name_pairs(c: GPTConfig) -> list[tuple[str, tuple[str, ...]]]:
    """(megalite name, its HF names) for every megalite tensor; the routed experts under
    the hub's per-expert names."""
    pairs = [(VOCAB_PARAMS[0], ("model.embed_tokens.weight",)),
             ("decoder.final_layernorm.weight", ("model.norm.weight",))]
    if c.untie_embeddings_and_output_weights:
        pairs.append((VOCAB_PARAMS[1], ("lm_head.weight",)))
    for ours, theirs, moe in layer_prefixes(c):
        pairs += [(ours + k, tuple(theirs + t for t in v))
                  for k, v in _layer_pairs(c, moe).items()]
    for k in range(c.mtp_depths):  # DeepSeek's layout (module docstring)
        pairs += [(f"mtp.layers.{k}.{ours}", (f"model.layers.{c.num_layers + k}.{theirs}",))
                  for ours, theirs in _MTP.items()]
    return pairs


def layer_prefixes(c: GPTConfig) -> list[tuple[str, str, bool]]:
    """(megalite prefix, HF prefix, MoE) of every transformer layer, the MTP depths' after
    the decoder's (their layer of the last layer's kind, model/mtp.py)."""
    layers = [(f"decoder.layers.{i}.", f"model.layers.{i}.", c.is_moe_layer(i))
              for i in range(c.num_layers)]
    return layers + [(f"mtp.layers.{k}.transformer_layer.", f"model.layers.{c.num_layers + k}.",
                      c.is_moe_layer(c.num_layers - 1)) for k in range(c.mtp_depths)]


def _layer_pairs(c: GPTConfig, moe: bool) -> dict[str, tuple[str, ...]]:
    latent_q = ("linear_q_down_proj", "q_layernorm", "linear_q_up_proj")
    unused = ("linear_q_proj",) if c.q_lora_rank is not None else latent_q
    modules = {k: (v,) for k, v in _ATTENTION.items() if k.split(".")[-1] not in unused}
    if not moe:
        return _weights({**modules, **hf_moe.mlp_modules("mlp.", "mlp.")})
    layer = {**_weights(modules), **_ROUTER, **_weights(hf_moe.expert_modules(c.num_experts))}
    if c.moe_shared_expert_intermediate_size:
        layer.update(_weights(hf_moe.mlp_modules("mlp.shared_experts.", "mlp.shared_experts.")))
    return layer


def _weights(modules: dict[str, tuple[str, ...]]) -> dict[str, tuple[str, ...]]:
    """megalite module -> HF modules, as the names of their weights."""
    return {f"{k}.weight": tuple(f"{t}.weight" for t in v) for k, v in modules.items()}


def add_hub_tensors(c: GPTConfig, hf: dict[str, torch.Tensor]) -> None:
    """What DeepSeek's hub files hold besides the tensors of name_pairs: a 0-wide shared expert
    in a MoE layer without one, lm_head when tied, each MTP depth's copies of the two."""
    for _, prefix, moe in layer_prefixes(c):
        if moe and not c.moe_shared_expert_intermediate_size:
            hf_moe.add_zero_width_expert(hf, f"{prefix}mlp.shared_experts.", c.hidden_size,
                                         hf["model.norm.weight"])
    if not c.untie_embeddings_and_output_weights:
        hf["lm_head.weight"] = hf["model.embed_tokens.weight"]
    for k in range(c.mtp_depths):  # DeepSeek's checkpoints hold copies of the shared two
        hf.update({f"model.layers.{c.num_layers + k}.{copy}": hf[main]
                   for copy, main in MTP_COPIES.items()})


def from_hf(c: GPTConfig, sd: dict[str, torch.Tensor],
            rope_interleave: bool = True) -> dict[str, torch.Tensor]:
    """megalite's state dict from a DeepseekV3ForCausalLM's (hf_moe.hub_state_dict's names)."""
    pairs = name_pairs(c)
    missing = [t for _, theirs in pairs for t in theirs if t not in sd]
    if missing:
        raise ConfigError(f"HF state dict lacks {missing[:8]} ({len(missing)} tensors) that "
                          "a DeepseekV3ForCausalLM of its config holds")
    ours = {}
    for name, theirs in pairs:
        parts = [sd[t] for t in theirs]
        ours[name] = (hf_moe.join_experts(c, parts) if ".experts." in name
                      else torch.cat(parts).contiguous())
    if not rope_interleave:
        _interleave_rope_rows(c, ours)
    return ours


def _interleave_rope_rows(c: GPTConfig, ours: dict[str, torch.Tensor]) -> None:
    """HF's rope_interleave=False rotates channel i with i + r/2 (rotate-half), megalite the
    pair (2i, 2i + 1): the RoPE rows of the query and of the shared k_pe are reordered so that
    row 2i is HF's i and row 2i + 1 HF's i + r/2 (rotary.deinterleave then gives HF's order
    back: exact)."""
    r, nope = c.qk_pos_emb_head_dim, c.qk_head_dim
    order = torch.arange(r).view(2, r // 2).t().reshape(-1)
    for layer, _, _ in layer_prefixes(c):
        prefix = layer + "self_attention."
        q = prefix + ("linear_q_proj" if c.q_lora_rank is None else "linear_q_up_proj")
        w = ours[q + ".weight"].view(c.num_attention_heads, nope + r, -1)
        ours[q + ".weight"] = torch.cat([w[:, :nope], w[:, nope:][:, order]], dim=1).reshape(
            -1, w.shape[-1])
        kv = ours[prefix + "linear_kv_down_proj.weight"]
        ours[prefix + "linear_kv_down_proj.weight"] = torch.cat(
            [kv[:c.kv_lora_rank], kv[c.kv_lora_rank:][order]])


def rope_parameters(c: GPTConfig) -> dict:
    """HF's rope_parameters for MLA's RoPE part (the module docstring)."""
    if c.rope_type == "rope":
        return dict(rope_type="default", rope_theta=float(c.rotary_base))
    return dict(rope_type="yarn", rope_theta=float(c.rotary_base),
                factor=c.rotary_scaling_factor, mscale=c.mscale, mscale_all_dim=c.mscale_all_dim,
                original_max_position_embeddings=c.yarn_original_max_position_embeddings,
                beta_fast=c.yarn_beta_fast, beta_slow=c.yarn_beta_slow,
                attention_factor=yarn_mscale(c.rotary_scaling_factor, c.mscale)
                / yarn_mscale(c.rotary_scaling_factor, c.mscale_all_dim))


def config_kwargs(c: GPTConfig, vocab: int) -> dict:
    """DeepseekV3Config's fields for `c` (exportable: check_exportable)."""
    moe = dict(n_routed_experts=1, num_experts_per_tok=1, n_shared_experts=0,
               moe_intermediate_size=c.ffn_hidden_size, norm_topk_prob=False)  # all dense
    if c.num_experts:
        moe = dict(n_routed_experts=c.num_experts, num_experts_per_tok=c.moe_router_topk,
                   moe_intermediate_size=c.moe_ffn_hidden_size,
                   n_shared_experts=(c.moe_shared_expert_intermediate_size or 0)
                   // c.moe_ffn_hidden_size,
                   norm_topk_prob=c.moe_router_topk > 1)
    return dict(
        moe, **{hf: getattr(c, field) for hf, field in _CONFIG_NAMES.items()}, vocab_size=vocab,
        num_key_value_heads=c.num_attention_heads,
        routed_scaling_factor=c.moe_router_topk_scaling_factor or 1.0,
        n_group=c.moe_router_num_groups or 1, topk_group=c.moe_router_group_topk or 1,
        first_k_dense_replace=first_dense_layers(c), hidden_act="silu",
        tie_word_embeddings=not c.untie_embeddings_and_output_weights,
        rope_parameters=rope_parameters(c), rope_interleave=True, attention_bias=False,
        attention_dropout=c.attention_dropout, num_mtp_layers=c.mtp_depths,
        num_nextn_predict_layers=c.mtp_depths, bos_token_id=None, eos_token_id=None)


def _rope_fields(hf) -> dict:
    rope = dict(getattr(hf, "rope_parameters", None) or {})
    kind = rope.get("rope_type", "default")
    if kind not in ("default", "yarn"):
        raise ConfigError(f"HF config rope_parameters rope_type={kind!r} is not supported "
                          "(megalite's MLA has default and yarn)")
    hf_moe.refuse("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0), 1.0)
    theta = rope.get("rope_theta", 10000.0)
    fields = dict(rotary_base=int(theta) if float(theta).is_integer() else theta,
                  rope_type="rope" if kind == "default" else "yarn")
    if kind == "default":
        return fields
    hf_moe.refuse("rope_parameters truncate", rope.get("truncate", True), True)
    factor = rope.get("factor") or hf.max_position_embeddings / rope[
        "original_max_position_embeddings"]
    mscale, all_dim = rope.get("mscale") or 0.0, rope.get("mscale_all_dim") or 0.0
    if not (mscale and all_dim):  # HF then takes mscale 1 over nothing (_compute_yarn_parameters)
        hf_moe.refuse("rope_parameters mscale_all_dim (without mscale)", all_dim, 0.0)
        mscale = 1.0
    ours = yarn_mscale(factor, mscale) / yarn_mscale(factor, all_dim)
    given = rope.get("attention_factor")
    if given is not None and abs(given - ours) > 1e-12 * ours:
        raise ConfigError(f"HF config rope_parameters attention_factor={given} is not "
                          f"supported: megalite's YaRN takes mscale / mscale_all_dim's ({ours})")
    return dict(fields, rotary_scaling_factor=float(factor), mscale=float(mscale),
                mscale_all_dim=float(all_dim),
                yarn_original_max_position_embeddings=rope["original_max_position_embeddings"],
                yarn_beta_fast=float(rope.get("beta_fast") or 32),
                yarn_beta_slow=float(rope.get("beta_slow") or 1))


def config_fields(hf) -> dict:
    """GPTConfig's fields of a DeepseekV3Config, once what megalite would compute
    differently is refused; warns of the latent-norm eps (module docstring)."""
    for name, want in (("attention_bias", False),
                       ("hidden_act", "silu"), ("num_key_value_heads", hf.num_attention_heads),
                       ("pretraining_tp", 1)):
        hf_moe.refuse(name, getattr(hf, name, want), want)
    layers, dense = hf.num_hidden_layers, min(hf.first_k_dense_replace, hf.num_hidden_layers)
    fields = dict(
        {field: getattr(hf, name) for name, field in _CONFIG_NAMES.items()},
        num_query_groups=hf.num_attention_heads, seq_length=hf.max_position_embeddings,
        vocab_size=hf.vocab_size, normalization="RMSNorm", swiglu=True, add_bias_linear=False,
        position_embedding_type="rope", untie_embeddings_and_output_weights=not
        hf.tie_word_embeddings, multi_latent_attention=True, qk_layernorm=True, **_rope_fields(hf),
        kv_channels=hf.qk_nope_head_dim + hf.qk_rope_head_dim)  # as validation/model.py sets it
    if dense < layers:
        fields.update(_moe_fields(hf, dense))
    warn_latent_norm_eps(hf.rms_norm_eps, "HF config rms_norm_eps")
    return fields


def _moe_fields(hf, dense: int) -> dict:
    k, groups = hf.num_experts_per_tok, hf.n_group or 1
    # megalite's sigmoid router renormalises exactly when k > 1 (Megatron's).
    hf_moe.refuse("norm_topk_prob", hf.norm_topk_prob, k > 1)
    if groups > 1:
        hf_moe.refuse("num_experts_per_tok // topk_group (HF's top-2 group score, "
                      "Megatron's top k // group_topk)", k // hf.topk_group, _HF_GROUP_SCORE_TOP)
    shared = hf.n_shared_experts * hf.moe_intermediate_size
    return dict(num_experts=hf.n_routed_experts, moe_router_topk=k,
                moe_ffn_hidden_size=hf.moe_intermediate_size,
                moe_layer_pattern=(False,) * dense + (True,) * (hf.num_hidden_layers - dense),
                moe_shared_expert_intermediate_size=shared or None,
                moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                moe_router_topk_scaling_factor=(None if hf.routed_scaling_factor == 1.0
                                                else float(hf.routed_scaling_factor)),
                moe_router_num_groups=groups if groups > 1 else None,
                moe_router_group_topk=hf.topk_group if groups > 1 else None)
