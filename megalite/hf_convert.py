"""Conversion between megalite's single-process weights and HuggingFace `transformers` models:
`export_to_hf` writes a directory AutoModelForCausalLM loads, `import_from_hf` reads one back
(`pad_vocab` then pads its vocabulary rows), `hf_config_and_state_dict` converts in memory.

`state_dict` is the single-process `GPTModel(config, seed).state_dict()` (no TP or PP).
Two styles have a one-to-one HF counterpart; anything else is refused with a ConfigError
rather than exported as a model that computes something different:

- GPT-2 (GPT2LMHeadModel): LayerNorm, exact GeLU, learned_absolute positions, biases,
  tied embeddings, num_query_groups == num_attention_heads.
- Llama (LlamaForCausalLM): RMSNorm, SwiGLU, rope with rotary_percent 1.0, no biases,
  tied or untied embeddings, grouped-query attention as num_key_value_heads.
- Qwen3 (Qwen3ForCausalLM): Llama style with --qk-layernorm, whose per-head RMSNorms before
  RoPE are HF's q_norm and k_norm (weights of head_dim, shared by all heads, eps rms_norm_eps).
- Mixtral (MixtralForCausalLM), Qwen2-MoE (Qwen2MoeForCausalLM) and, with --qk-layernorm,
  Qwen3-MoE (Qwen3MoeForCausalLM): a Llama-style mixture of experts (--num-experts);
  hf_moe.py says which and maps its router and experts.
- DeepSeek-V3 (DeepseekV3ForCausalLM): --multi-latent-attention with its latent norms, dense
  or with sigmoid-routed experts (hf_deepseek.py maps it all).

Layouts (why this is more than a renaming table):

- megalite's fused QKV rows are per query group, [q heads of group 0, k_0, v_0, q heads
  of group 1, ...] (megalite/model/attention.py). HF GPT-2's c_attn is [Q; K; V], HF
  Llama has q/k/v_proj, each head-major; query head i reads K/V head i // (heads /
  groups) in both (HF `repeat_kv`), so regrouping the rows is all it takes.
- megalite's SwiGLU fc1 is HF Llama's gate_proj and up_proj stacked, [gate; up].
- HF GPT-2's `Conv1D` (transformers/pytorch_utils.py, y = x @ W + b) stores weights
  [in, out], the transpose of nn.Linear's [out, in] that megalite and HF Llama use.
- RoPE is the non-interleaved rotate-half form in both (megalite/model/rotary.py, HF
  `rotate_half`), so q/k rows need no permutation.
- Vocabulary: megalite has padded_vocab_size rows, the first vocab_size real and the rest
  masked out of the softmax. HF gets and gives the real rows; `pad_vocab` appends zero
  rows (megalite's initial padding).
- GeLU: megalite's is exact (HF "gelu"). The original GPT-2 checkpoints use "gelu_new",
  the tanh approximation, which differs by up to ~1e-3 per activation.

The tokenizer is not part of the weights: save it beside the export, and pass its
special-token ids as hf_config_kwargs (e.g. eos_token_id=50256); they default to None.
"""

import os
import warnings
from pathlib import Path

import torch

from megalite import hf_deepseek, hf_deepseek_mtp, hf_moe
from megalite.atomic_write import staged_directory
from megalite.errors import ConfigError
from megalite.config import GPTConfig
from megalite.tensor_parallel.params import VOCAB_PARAMS, pad_vocab_rows

STYLES = {
    "GPT-2": dict(normalization="LayerNorm", swiglu=False,
                  position_embedding_type="learned_absolute", add_bias_linear=True,
                  untie_embeddings_and_output_weights=False),
    "Llama": dict(normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
                  add_bias_linear=False),
}

# megalite module -> HF module(s), per layer. GPT-2's linear layers are Conv1D (transposed).
_GPT2_LAYER = {"input_layernorm": "ln_1", "self_attention.linear_qkv": "attn.c_attn",
               "self_attention.linear_proj": "attn.c_proj", "pre_mlp_layernorm": "ln_2",
               "mlp.linear_fc1": "mlp.c_fc", "mlp.linear_fc2": "mlp.c_proj"}
_LLAMA_LAYER = {"input_layernorm": "input_layernorm",
                "self_attention.linear_qkv": ("self_attn.q_proj", "self_attn.k_proj",
                                              "self_attn.v_proj"),
                "self_attention.linear_proj": "self_attn.o_proj",
                "pre_mlp_layernorm": "post_attention_layernorm",
                **hf_moe.mlp_modules("mlp.", "mlp.")}
_QK_NORMS = {"self_attention.q_layernorm": "self_attn.q_norm",
             "self_attention.k_layernorm": "self_attn.k_norm"}
_ARCHITECTURES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM",
                  "qwen3": "Qwen3ForCausalLM", **hf_moe.ARCHITECTURES,
                  hf_deepseek.MODEL_TYPE: hf_deepseek.ARCHITECTURE}
_EMBEDDING, _OUTPUT = VOCAB_PARAMS
# HF config attribute -> GPTConfig field, in both directions; STYLES fixes the rest.
_CONFIG_NAMES = {
    "GPT-2": dict(n_layer="num_layers", n_embd="hidden_size", n_head="num_attention_heads",
                  n_inner="ffn_hidden_size", n_positions="max_position_embeddings",
                  layer_norm_epsilon="norm_epsilon"),
    "Llama": dict(num_hidden_layers="num_layers", hidden_size="hidden_size",
                  intermediate_size="ffn_hidden_size", num_attention_heads="num_attention_heads",
                  num_key_value_heads="num_query_groups", head_dim="kv_channels",
                  max_position_embeddings="max_position_embeddings", rms_norm_eps="norm_epsilon"),
}


def _transformers():
    try:
        import transformers
    except ImportError as error:
        raise ImportError("HuggingFace conversion needs the transformers package: "
                          "pip install transformers (or pip install -e .[hf])") from error
    return transformers


def model_style(c: GPTConfig) -> str:
    """"GPT-2" or "Llama" (Qwen3 with --qk-layernorm); otherwise a ConfigError naming the
    fields of the closest style that differ."""
    if c.multi_latent_attention:
        raise ConfigError("multi_latent_attention=True: HuggingFace's model of it is "
                          "DeepseekV3ForCausalLM (hf_deepseek.py), not GPT-2 or Llama style")
    if c.mtp_num_layers:
        raise ConfigError(f"mtp_num_layers={c.mtp_num_layers}: no GPT-2, Llama or Qwen3 "
                          "HuggingFace model holds multi-token-prediction weights (DeepSeek-V3 "
                          "does: --multi-latent-attention)")
    misses = {style: hf_moe.differences(c, want) for style, want in STYLES.items()}
    style = min(misses, key=lambda s: len(misses[s]))
    if misses[style]:
        raise ConfigError(f"no HuggingFace model matches this model; closest is {style} "
                          f"style, which differs in {', '.join(misses[style])}")
    if style == "GPT-2" and (c.num_query_groups != c.num_attention_heads
                             or c.kv_channels * c.num_attention_heads != c.hidden_size):
        raise ConfigError(f"GPT-2 style needs num_query_groups={c.num_attention_heads} and "
                          f"kv_channels={c.hidden_size // c.num_attention_heads} (hidden / "
                          f"heads), got {c.num_query_groups} and {c.kv_channels}")
    if style == "Llama" and c.rotary_percent != 1.0:
        raise ConfigError(f"Llama style needs rotary_percent=1.0, got {c.rotary_percent}: "
                          "HF Llama rotates every channel of each head")
    if c.qk_layernorm and style == "GPT-2":
        raise ConfigError("qk_layernorm=True: no HuggingFace GPT-2 has QK-norm; Llama style "
                          "with it is Qwen3")
    return style


def _name_pairs(style: str, c: GPTConfig) -> list[tuple[str, tuple[str, ...], bool]]:
    """(megalite name, its HF names, transposed) for every megalite tensor. QKV has three
    HF tensors (Llama) or one in another row order (GPT-2); Llama's fused fc1 is
    [gate_proj; up_proj] (megalite/model/transformer.py's MLP); a MoE layer's MLP is
    hf_moe.layer_modules'."""
    gpt2 = style == "GPT-2"
    top = "transformer." if gpt2 else "model."
    pairs = [(_EMBEDDING, top + ("wte.weight" if gpt2 else "embed_tokens.weight"))]
    if c.untie_embeddings_and_output_weights:
        pairs.append((_OUTPUT, "lm_head.weight"))
    if gpt2:
        pairs.append(("embedding.position_embeddings.weight", "transformer.wpe.weight"))
    pairs = [(ours, (theirs,), False) for ours, theirs in pairs]
    modules = {"decoder.final_layernorm": (top + ("ln_f" if gpt2 else "norm"),)}
    moe = hf_moe.moe_style(c) if c.num_experts else None
    for i in range(c.num_layers):
        prefix = f"{top}{'h' if gpt2 else 'layers'}.{i}."
        layer = _GPT2_LAYER if gpt2 else {**_LLAMA_LAYER,
                                          **(_QK_NORMS if c.qk_layernorm else {})}
        experts = hf_moe.layer_modules(moe, c, i) if moe else {}
        if experts:
            layer = {**{k: v for k, v in layer.items() if not k.startswith("mlp.")}, **experts}
        for ours, theirs in layer.items():
            theirs = (theirs,) if isinstance(theirs, str) else theirs
            modules[f"decoder.layers.{i}.{ours}"] = tuple(prefix + t for t in theirs)
    for ours, theirs in modules.items():
        for kind in ("weight", "bias") if gpt2 else ("weight",):
            pairs.append((f"{ours}.{kind}", tuple(f"{t}.{kind}" for t in theirs),
                          gpt2 and kind == "weight" and "linear" in ours))
    return pairs


def _split_qkv(c: GPTConfig, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """megalite's per-group QKV rows (weight or bias) -> head-major Q, K, V rows."""
    g, d, rest = c.num_query_groups, c.kv_channels, t.shape[1:]
    t = t.reshape(g, -1, d, *rest)  # [groups, heads per group + 2 (k, v), d, ...]
    return tuple(part.reshape(-1, *rest) for part in t.split([t.shape[1] - 2, 1, 1], dim=1))


def _fuse_qkv(c: GPTConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The inverse of _split_qkv."""
    g, d, rest = c.num_query_groups, c.kv_channels, q.shape[1:]
    q, k, v = (t.reshape(g, -1, d, *rest) for t in (q, k, v))
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def _hf_config(style: str, c: GPTConfig, vocab: int, **kwargs):
    tf = _transformers()
    common = dict(vocab_size=vocab, initializer_range=c.init_method_std, bos_token_id=None,
                  eos_token_id=None)
    common.update({hf: getattr(c, field) for hf, field in _CONFIG_NAMES[style].items()})
    if style == "GPT-2":
        return tf.GPT2Config(**{**common, **dict(
            activation_function="gelu", resid_pdrop=c.hidden_dropout, embd_pdrop=c.hidden_dropout,
            attn_pdrop=c.attention_dropout, tie_word_embeddings=True), **kwargs})
    llama = {**common, **dict(
        hidden_act="silu", rope_theta=float(c.rotary_base), attention_bias=False, mlp_bias=False,
        attention_dropout=c.attention_dropout,
        tie_word_embeddings=not c.untie_embeddings_and_output_weights)}
    if c.qk_layernorm:
        del llama["mlp_bias"]  # Qwen3 has no such field (and no MLP bias)
    model_type = hf_moe.moe_style(c) if c.num_experts else "qwen3" if c.qk_layernorm else "llama"
    moe = hf_moe.config_kwargs(model_type, c) if c.num_experts else {}
    return tf.AutoConfig.for_model(model_type, **{**llama, **moe, **kwargs})


def hf_config_and_state_dict(model_config: GPTConfig, state_dict: dict[str, torch.Tensor],
                             **hf_config_kwargs):
    """The HF config (GPT2Config, LlamaConfig, Qwen3Config, a MoE's of hf_moe.ARCHITECTURES,
    DeepseekV3Config) and the state dict of its *ForCausalLM model (experts under the hub's
    per-expert names), lm_head included (the same tensor as the embedding when tied). Tensors
    may share memory with `state_dict`. hf_config_kwargs go to the config (token ids, say)."""
    c = model_config
    if c.multi_latent_attention:
        hf_deepseek.check_exportable(c)
        pairs = [(ours, theirs, False) for ours, theirs in hf_deepseek.name_pairs(c)]
    else:
        style = model_style(c)
        pairs = _name_pairs(style, c)
    expected = {ours for ours, _, _ in pairs}
    if set(state_dict) != expected:
        raise ConfigError(f"state dict does not match the config: missing "
                          f"{sorted(expected - set(state_dict))}, unexpected "
                          f"{sorted(set(state_dict) - expected)}")
    vocab = c.vocab_size or c.padded_vocab_size
    hf = {}
    for ours, theirs, transposed in pairs:
        t = state_dict[ours][:vocab] if ours in (_EMBEDDING, _OUTPUT) else state_dict[ours]
        # Several HF tensors: equal row blocks ([gate; up], or per expert of [E, rows, cols]).
        parts = (_split_qkv(c, t) if "linear_qkv" in ours else
                 t.reshape(len(theirs), -1, t.shape[-1]).unbind(0) if len(theirs) > 1 else (t,))
        if len(parts) > len(theirs):
            parts = (torch.cat(parts),)  # GPT-2's c_attn is [Q; K; V]
        for name, part in zip(theirs, parts):
            hf[name] = (part.t() if transposed else part).contiguous()
    if c.multi_latent_attention:
        hf_deepseek.add_hub_tensors(c, hf)
        return _transformers().DeepseekV3Config(**{**hf_deepseek.config_kwargs(c, vocab),
                                                   **hf_config_kwargs}), hf
    if c.num_experts:
        hf_moe.add_shared_expert_gate(hf_moe.moe_style(c), c, hf, "model.layers.")
    if not c.untie_embeddings_and_output_weights:
        hf["lm_head.weight"] = hf[pairs[0][1][0]]
    return _hf_config(style, c, vocab, **hf_config_kwargs), hf


def export_to_hf(model_config: GPTConfig, state_dict: dict[str, torch.Tensor],
                 output_dir: str | Path, dtype: torch.dtype | None = None,
                 overwrite: bool = False, **hf_config_kwargs) -> Path:
    """Write `output_dir` with the HF model's save_pretrained (config.json, safetensors).
    It is written to a sibling staging directory and renamed into place once complete,
    so an interrupted export never leaves a directory that looks loadable."""
    output_dir = Path(output_dir)
    if output_dir.exists() and not overwrite:
        raise ConfigError(f"{output_dir} already exists; pass overwrite=True to replace it")
    tf = _transformers()
    config, hf = hf_config_and_state_dict(model_config, state_dict, **hf_config_kwargs)
    if dtype is not None:  # DeepSeek's expert bias stays fp32, as megalite and HF keep it
        hf = {name: t if name.endswith(hf_deepseek.FP32_SUFFIX) else t.to(dtype)
              for name, t in hf.items()}
    if model_config.num_experts or model_config.multi_latent_attention:
        return _save_hub_files(config, hf, output_dir)
    cls = getattr(tf, _ARCHITECTURES[config.model_type])
    with torch.device("meta"):  # no random init of weights that are overwritten anyway
        model = cls(config)
    model.load_state_dict(hf, strict=True, assign=True)
    model.tie_weights()
    with staged_directory(output_dir) as staging:
        model.save_pretrained(staging, safe_serialization=True)
    return output_dir


def _save_hub_files(config, hf: dict[str, torch.Tensor], output_dir: Path) -> Path:
    """config.json and model.safetensors as the hub holds a MoE model (per-expert names):
    transformers >= 5 fuses the experts in memory and converts these names on load, so they,
    not one version's in-memory names, are what every version reads."""
    from safetensors.torch import save_file  # a dependency of transformers

    if config.tie_word_embeddings:  # HF ties lm_head to the embedding on load
        hf = {name: t for name, t in hf.items() if name != "lm_head.weight"}
    # What save_pretrained would record: the class (vLLM and others pick the model by it)
    # and the dtype (from_pretrained(dtype="auto")).
    config.architectures = [_ARCHITECTURES[config.model_type]]
    setattr(config, "dtype" if hasattr(config, "dtype") else "torch_dtype",
            next(iter(hf.values())).dtype)
    with staged_directory(output_dir) as staging:
        config.save_pretrained(staging)
        # Clones: safetensors refuses tensors that share memory (the pieces of one tensor).
        save_file({name: t.clone() for name, t in hf.items()}, staging / "model.safetensors",
                  metadata={"format": "pt"})
    return output_dir


def _gpt2_fields(hf, allow_gelu_approximation: bool) -> dict:
    """The fields no table holds, once what megalite would compute differently is refused."""
    act = hf.activation_function
    if act in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast") and allow_gelu_approximation:
        warnings.warn(f"HF config activation_function={act!r} is the tanh approximation of "
                      "GeLU; megalite computes exact GeLU, so logits will differ slightly")
    else:
        hf_moe.refuse("activation_function", act, "gelu")
    for name, want in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                       ("add_cross_attention", False), ("tie_word_embeddings", True)):
        hf_moe.refuse(name, getattr(hf, name, want), want)
    return dict(rotary_base=10000)


def _llama_fields(hf) -> dict:
    """As _gpt2_fields."""
    # transformers 5 keeps rope_theta in rope_parameters; 4.x in rope_theta / rope_scaling.
    rope = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {}
    hf_moe.refuse("rope_type", rope.get("rope_type", rope.get("type", "default")), "default")
    hf_moe.refuse("partial_rotary_factor", rope.get(
        "partial_rotary_factor", getattr(hf, "partial_rotary_factor", 1.0)), 1.0)
    for name, want in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        hf_moe.refuse(name, getattr(hf, name, want), want)
    theta = rope.get("rope_theta", getattr(hf, "rope_theta", 10000))
    return dict(untie_embeddings_and_output_weights=not hf.tie_word_embeddings,
                rotary_base=int(theta) if float(theta).is_integer() else theta)


def import_from_hf(hf_dir_or_model, allow_gelu_approximation: bool = False
                   ) -> tuple[dict, dict[str, torch.Tensor]]:
    """(GPTConfig fields, megalite single-process state dict) of a GPT2LMHeadModel,
    LlamaForCausalLM, Qwen3ForCausalLM or a MoE of hf_moe.ARCHITECTURES, given as a
    directory/hub name or a loaded model.

    The fields lack padded_vocab_size and the training-only ones; seq_length is set to
    max_position_embeddings (lower it freely). The vocabulary tensors have vocab_size rows:
    pad them with `pad_vocab`. HF configs whose model would compute something else than
    megalite (rope scaling, biases in Llama, approximate GeLU unless
    allow_gelu_approximation) are refused with a ConfigError naming the field.
    """
    tf = _transformers()
    if isinstance(hf_dir_or_model, (str, os.PathLike)):
        hf = tf.AutoConfig.from_pretrained(hf_dir_or_model)  # refuse before loading weights
    else:
        hf = hf_dir_or_model.config
    if hf.model_type == hf_deepseek.MODEL_TYPE:
        return _import_deepseek(hf, hf_dir_or_model)
    moe = hf.model_type in hf_moe.ARCHITECTURES
    if hf.model_type not in _ARCHITECTURES:
        raise ConfigError(f"HF config model_type={hf.model_type!r} is not supported "
                          "(megalite converts gpt2, llama, qwen3, mixtral, qwen2_moe, "
                          "qwen3_moe and deepseek_v3)")
    style = "GPT-2" if hf.model_type == "gpt2" else "Llama"
    fields = {f: getattr(hf, name, None) for name, f in _CONFIG_NAMES[style].items()}
    fields.update(STYLES[style], **(_gpt2_fields(hf, allow_gelu_approximation)
                                    if style == "GPT-2" else _llama_fields(hf)))
    if moe:
        fields.update(hf_moe.moe_fields(hf))
    if hf.model_type in ("qwen3", "qwen3_moe"):
        hf_moe.refuse("use_sliding_window", getattr(hf, "use_sliding_window", False), False)
        for kind in set(getattr(hf, "layer_types", None) or ()):
            hf_moe.refuse("layer_types", kind, "full_attention")
        fields.update(qk_layernorm=True)
    heads, hidden = fields["num_attention_heads"], fields["hidden_size"]
    fields.update(seq_length=fields["max_position_embeddings"], vocab_size=hf.vocab_size,
                  ffn_hidden_size=fields["ffn_hidden_size"] or 4 * hidden,  # GPT-2's n_inner
                  num_query_groups=fields.get("num_query_groups") or heads,
                  kv_channels=fields.get("kv_channels") or hidden // heads)
    sd = _state_dict(hf_dir_or_model)
    if moe:
        sd = hf_moe.hub_state_dict(sd, fields["num_experts"], *hf_moe.EXPERTS[hf.model_type])
        hf_moe.remove_shared_expert_gate(sd, fields.get("moe_shared_expert_intermediate_size"))
    c = GPTConfig(**fields, padded_vocab_size=fields["vocab_size"])
    ours = {}
    for name, theirs, transposed in _name_pairs(style, c):
        parts = [sd[t].t() if transposed else sd[t] for t in theirs]
        if "linear_qkv" in name:
            parts = [_fuse_qkv(c, *(parts if len(parts) == 3 else parts[0].chunk(3)))]
        ours[name] = (hf_moe.join_experts(c, parts) if ".experts." in name
                      else torch.cat(parts).contiguous())
    return fields, ours


def _state_dict(hf_dir_or_model) -> dict[str, torch.Tensor]:
    """The tensors of a loaded model, or of the one a directory or hub name holds."""
    if isinstance(hf_dir_or_model, (str, os.PathLike)):
        hf_dir_or_model = _transformers().AutoModelForCausalLM.from_pretrained(hf_dir_or_model)
    return {name: t.detach() for name, t in hf_dir_or_model.state_dict().items()}


def _import_deepseek(hf, hf_dir_or_model) -> tuple[dict, dict[str, torch.Tensor]]:
    """import_from_hf's DeepseekV3ForCausalLM (hf_deepseek.py): the config refused or
    accepted before any weight is loaded."""
    fields, mtp, depths = hf_deepseek.config_fields(hf), {}, 0
    if isinstance(hf_dir_or_model, (str, os.PathLike)):
        # DeepSeek's MTP layers: in the files, not in the model transformers loads.
        mtp, depths = hf_deepseek_mtp.read_mtp(hf_dir_or_model, hf)
    sd = {**hf_moe.hub_state_dict(_state_dict(hf_dir_or_model), fields.get("num_experts", 0)),
          **mtp}
    hf_deepseek_mtp.drop_shared_copies(sd, hf.num_hidden_layers, depths)
    fields.update(mtp_num_layers=depths or None)
    c = GPTConfig(**fields, padded_vocab_size=fields["vocab_size"])
    return fields, hf_deepseek.from_hf(c, sd, getattr(hf, "rope_interleave", True))


def pad_vocab(state_dict: dict[str, torch.Tensor],
              padded_vocab_size: int) -> dict[str, torch.Tensor]:
    """A copy of `state_dict` whose vocabulary tensors have padded_vocab_size rows, the new
    ones zero as in megalite's init (see megalite.validation.pad_vocab_size for the size)."""
    for name in [n for n in VOCAB_PARAMS if n in state_dict]:
        if state_dict[name].shape[0] > padded_vocab_size:
            raise ConfigError(f"{name} has {state_dict[name].shape[0]} rows, more than "
                              f"padded_vocab_size {padded_vocab_size}")
    return {n: pad_vocab_rows(t, padded_vocab_size) if n in VOCAB_PARAMS else t
            for n, t in state_dict.items()}
