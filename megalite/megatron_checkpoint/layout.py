"""What a Megatron-LM GPT checkpoint means in megalite's terms: its args, names and shards.

megalite's parameter names are megatron.core GPTModel's (local layer spec), so the names
map one to one, except:
- Megatron's `_extra_state` entries (None in the local spec) carry no weights;
- torch_dist and the Transformer Engine spec fuse each pre-norm into the linear that
  follows it: `self_attention.linear_qkv.layer_norm_{weight,bias}` is the input norm and
  `mlp.linear_fc1.layer_norm_{weight,bias}` the pre-MLP norm (FUSED_NORMS).
Shards follow the same rules in both codebases (megalite/tensor_parallel/params.py, read
off a model built on the meta device so the rule has one place): QKV and fc1 are
column-parallel, QKV grouped per query group and SwiGLU's fc1 stacked [gate; up] per TP
rank; linear_proj and fc2 row-parallel; the embedding and output layer split the padded
vocabulary; norms, row-parallel biases and learned positions are replicated. A mixture of
experts' names and args: moe.py; multi-latent attention's: mla.py.
Multi-token prediction's modules (`mtp.layers.{k}.enorm / hnorm / eh_proj /
transformer_layer / final_layernorm`, megalite/model/mtp.py) carry Megatron's names too, the
transformer layer's keys as a decoder layer's (fused norms, experts); eh_proj is
column-parallel. They live on the last pipeline stage, which with MTP holds a copy of the word
embeddings (and learned positions) as well: written there, read from the first stage.
"""

import argparse
import dataclasses

import torch
from torch import nn

from megalite.config import GPTConfig
from megalite.errors import CheckpointError
from megalite.megatron_checkpoint import mla, moe
from megalite.model.gpt import GPTModel
from megalite.pipeline_parallel.stages import Stage
from megalite.tensor_parallel.params import VOCAB_PARAMS
from megalite.validation import pad_vocab_size

FUSED_NORMS = {"self_attention.linear_qkv.layer_norm_": "input_layernorm.",
               "mlp.linear_fc1.layer_norm_": "pre_mlp_layernorm."}
READ_FUSED_NORMS = {**FUSED_NORMS, **mla.FUSED_NORMS}  # read: the TE spec's too
EMBEDDING, OUTPUT = VOCAB_PARAMS
LAYER_PREFIX = "decoder.layers."
MTP_PREFIX = "mtp.layers."
# An MTP layer's transformer layer: megalite's and torch_dist's `transformer_layer`; Megatron's
# module is `mtp_model_layer` (it also builds hybrid MTP layers), the name its legacy files
# hold, while its sharded_state_dict maps it back. Older Megatron's legacy files say
# `transformer_layer`: both are read.
MTP_LAYER, MTP_LAYER_MODULE = "transformer_layer.", "mtp_model_layer."

# Megatron args -> GPTConfig fields megalite reads (and args_for writes), with Megatron's defaults.
_ARG_DEFAULTS = dict(position_embedding_type="learned_absolute", rotary_base=10000,
                     rotary_percent=1.0, normalization="LayerNorm", norm_epsilon=1e-5,
                     swiglu=False, qk_layernorm=False, add_bias_linear=True,
                     untie_embeddings_and_output_weights=False, init_method_std=0.02,
                     mtp_num_layers=None, mtp_loss_scaling_factor=0.1)
# Megatron features megalite's model does not have (set in args: refused).
_UNSUPPORTED = ("rotary_interleaved", "squared_relu",
                "openai_gelu", "apply_residual_connection_post_layernorm",
                "use_rope_scaling",
                "rotary_seq_len_interpolation_factor", "decoder_first_pipeline_num_layers",
                "decoder_last_pipeline_num_layers", "num_layers_per_virtual_pipeline_stage")


def config_from_args(args: argparse.Namespace, where: str) -> GPTConfig:
    """The model a Megatron run's `args` describes (dropout 0: the run's flags set it)."""
    missing = [n for n in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                           "padded_vocab_size") if getattr(args, n, None) is None]
    if missing:
        raise CheckpointError(f"Megatron checkpoint {where}: its args lack {missing}")
    differing = [f"{n}={getattr(args, n)!r}" for n in _UNSUPPORTED if getattr(args, n, None)]
    if getattr(args, "add_qkv_bias", False) and not getattr(args, "add_bias_linear", True):
        differing.append("add_qkv_bias=True with add_bias_linear=False")
    if differing:
        raise CheckpointError(f"Megatron checkpoint {where} uses features megalite's GPT "
                              f"does not have: {', '.join(differing)}")
    heads, hidden = args.num_attention_heads, args.hidden_size
    groups = (getattr(args, "num_query_groups", None) or heads
              if getattr(args, "group_query_attention", False) else heads)
    ffn = getattr(args, "ffn_hidden_size", None) or 4 * hidden
    fields = {n: (getattr(args, n, None) if getattr(args, n, None) is not None else d)
              for n, d in _ARG_DEFAULTS.items()}
    if getattr(args, "norm_epsilon", None) is None:  # Megatron's name before norm_epsilon
        fields["norm_epsilon"] = getattr(args, "layernorm_epsilon", None) or 1e-5
    fields.update(mla.mla_fields(args, where))
    kv_channels = getattr(args, "kv_channels", None) or hidden // heads
    if fields.get("multi_latent_attention"):  # as validation/model.py: MLA's query/key head
        kv_channels = fields["qk_head_dim"] + fields["qk_pos_emb_head_dim"]
    return GPTConfig(num_layers=args.num_layers, hidden_size=hidden, ffn_hidden_size=ffn,
                     num_attention_heads=heads, num_query_groups=groups,
                     kv_channels=kv_channels,
                     seq_length=args.seq_length,
                     max_position_embeddings=getattr(args, "max_position_embeddings", None)
                     or args.seq_length, padded_vocab_size=args.padded_vocab_size,
                     vocab_size=getattr(args, "vocab_size", None), attention_dropout=0.0,
                     hidden_dropout=0.0, **fields, **moe.moe_fields(args, where))


def args_for(config: GPTConfig, tp: int, pp: int, divisible_by: int,
             extra: dict | None = None) -> argparse.Namespace:
    """The args Namespace a Megatron run of `config` at TP `tp`, PP `pp` records."""
    c = config
    return argparse.Namespace(
        num_layers=c.num_layers, hidden_size=c.hidden_size, ffn_hidden_size=c.ffn_hidden_size,
        num_attention_heads=c.num_attention_heads,
        group_query_attention=c.num_query_groups != c.num_attention_heads,
        num_query_groups=c.num_query_groups, kv_channels=c.kv_channels,
        seq_length=c.seq_length, max_position_embeddings=c.max_position_embeddings,
        **{n: getattr(c, n) for n in _ARG_DEFAULTS}, vocab_size=c.vocab_size,
        make_vocab_size_divisible_by=divisible_by,
        padded_vocab_size=pad_vocab_size(c.vocab_size or c.padded_vocab_size, divisible_by, tp),
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        params_dtype=torch.float32, **(extra or {}))


def meta_params(config: GPTConfig) -> dict[str, nn.Parameter]:
    """The single-process model's parameters on the meta device: names, full shapes and
    TP tags (params.partition_dim / partition_stride), without allocating a weight; and its
    persistent buffers (a MoE router's expert bias), which checkpoints hold too."""
    with torch.device("meta"):
        model = GPTModel(dataclasses.replace(config, compile_layers=False), seed=0)
    return model.state_dict(keep_vars=True)


def megalite_name(name: str) -> str | None:
    """megalite's name for a Megatron state-dict key; None for `_extra_state`. Legacy
    per-expert keys keep their names (moe.legacy_expert stacks them)."""
    if "._extra_state" in name:  # torch_dist's expert ones end in /shard_{layer}.{expert}_...
        return None
    name = name.replace(moe.TORCH_DIST_EXPERTS, moe.EXPERTS)
    if name.startswith(MTP_PREFIX):
        name = name.replace(MTP_LAYER_MODULE, MTP_LAYER, 1)
    for fused, plain in READ_FUSED_NORMS.items():
        if fused in name:
            return name.replace(fused, plain)
    return name


def legacy_name(name: str) -> str:
    """The legacy file's key of a megalite name (global layer numbers kept)."""
    if name.startswith(MTP_PREFIX):
        return name.replace(MTP_LAYER, MTP_LAYER_MODULE, 1)
    return name


def fused_name(name: str, config: GPTConfig) -> str:
    """torch_dist's name for a megalite tensor: a norm's (FUSED_NORMS inverted; none with
    multi-latent attention, whose local layer spec keeps them apart), the experts'
    (moe.TORCH_DIST_EXPERTS)."""
    name = name.replace(moe.EXPERTS, moe.TORCH_DIST_EXPERTS)
    if config.multi_latent_attention:
        return name
    for fused, plain in FUSED_NORMS.items():
        if plain in name:
            return name.replace(plain, fused)
    return name


def check_state(state: dict[str, torch.Tensor], config: GPTConfig, where: str,
                names: set[str] | None = None) -> None:
    """The names (those of `names`, if given) and full shapes of megalite's single-process
    model, or a CheckpointError naming the tensors that differ (before anything is
    written)."""
    params = meta_params(config)
    expected = set(params) - ({OUTPUT} if not config.untie_embeddings_and_output_weights
                              else set())
    if names is not None:
        expected &= names
    if set(state) != expected:
        raise CheckpointError(f"Megatron checkpoint {where} does not hold the model its args "
                              f"describe: missing {sorted(expected - set(state))}, unexpected "
                              f"{sorted(set(state) - expected)}")
    wrong = [f"{n}: {tuple(t.shape)}, expected {tuple(params[n].shape)}"
             for n, t in state.items() if t.shape != params[n].shape]
    if wrong:
        raise CheckpointError(f"Megatron checkpoint {where} holds tensors of the wrong shape "
                              f"for its args: {'; '.join(wrong)}")


def stage_layers(num_layers: int, pp: int, where: str) -> list[range]:
    """Megatron's even split of the layers over `pp` pipeline stages (one chunk each)."""
    if num_layers % pp:
        raise CheckpointError(f"{where}: {num_layers} layers do not split evenly over "
                              f"pipeline size {pp}")
    return [Stage(0, r, pp, 1).layers(num_layers) for r in range(pp)]


def local_layer_name(name: str, offset: int) -> str:
    """Legacy files number each stage's layers from 0: global index -> local (offset > 0)
    or local -> global (offset < 0)."""
    if not name.startswith(LAYER_PREFIX):
        return name
    index, rest = name[len(LAYER_PREFIX):].split(".", 1)
    return f"{LAYER_PREFIX}{int(index) - offset}.{rest}"
