"""Writing megalite's single-process weights as a Megatron-LM checkpoint at a chosen TP/PP.

The output is what megatron.core's GPTModel (local spec) saves, so Megatron's --load reads
it (reader.py's module docstring describes both formats):
- torch: `iter_XXXXXXX/mp_rank_TT[_PPP]/model_optim_rng.pt`, each {"model": that rank's
  shards with per-stage layer numbers and `_extra_state` None per linear, "iteration",
  "checkpoint_version": 3.0, "args"}; a tied output layer's copy on the last stage of
  PP > 1, as Megatron keeps it there.
- torch_dist: global tensors with the layers stacked and the norms under their fused
  names, `_extra_state/shard_{layer}_{layers}` objects and `common_state/shard_0_1`
  ({"iteration", "checkpoint_version", "args"}), written by torch.distributed.checkpoint
  in one process, plus Megatron's metadata.json.
A mixture of experts is written as megatron.core's local spec saves it (moe.py: one module
per expert in the legacy format, [layers, E, ...] in torch_dist) at EP 1; torch_dist stacks
the layers, so there every layer must be a MoE layer. Vocabulary rows are padded to
Megatron's padded size for the target TP. The directory is written under a temporary name
and renamed when complete.
"""

import json
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from megalite.atomic_write import staged_directory
from megalite.checkpointing.storage import TRACKER_FILENAME, checkpoint_dir
from megalite.errors import CheckpointError, ConfigError
from megalite.megatron_checkpoint import layout, mla, moe
from megalite.megatron_checkpoint.reader import FORMATS, LEGACY_FILE, legacy_rank_dir
from megalite.config import GPTConfig
from megalite.tensor_parallel.params import VOCAB_PARAMS, pad_vocab_rows, tp_shard

CHECKPOINT_VERSION = 3.0
LINEARS = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1",
           "mlp.linear_fc2")
# A layer's modules in megatron.core's registration order (its state-dict order).
LAYER_MODULES = ("input_layernorm", "self_attention.linear_proj", "self_attention.linear_qkv",
                 "self_attention.q_layernorm", "self_attention.k_layernorm",
                 "pre_mlp_layernorm", "mlp.linear_fc1", "mlp.linear_fc2")
QK_NORMS = LAYER_MODULES[3:5]  # with qk_layernorm only
BACKEND_METADATA = {"sharded_backend": "torch_dist", "sharded_backend_version": 1}


def check_target_layout(config: GPTConfig, tp: int, pp: int) -> None:
    if tp < 1 or pp < 1:
        raise ConfigError(f"target TP and PP must be >= 1, got TP {tp}, PP {pp}")
    for what in ("num_query_groups", "num_attention_heads", "ffn_hidden_size",
                 "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size"):
        if (getattr(config, what) or 0) % tp:
            raise ConfigError(f"--target-tensor-parallel-size {tp} does not divide {what} "
                              f"{getattr(config, what)}")
    if config.num_layers % pp:
        raise ConfigError(f"--target-pipeline-parallel-size {pp} does not divide "
                          f"num_layers {config.num_layers}")


def write_checkpoint(out: str | Path, config: GPTConfig, state: dict[str, torch.Tensor],
                     iteration: int, ckpt_format: str, tp: int = 1, pp: int = 1,
                     divisible_by: int = 128, extra_args: dict | None = None,
                     overwrite: bool = False) -> Path:
    """`out` as a Megatron save directory holding `iteration` (tracker included)."""
    if ckpt_format not in FORMATS:
        raise ConfigError(f"--ckpt-format must be one of {FORMATS}, got {ckpt_format!r}")
    out = Path(out)
    if out.exists() and not overwrite:
        raise ConfigError(f"--export-megatron {out} already exists; pass --overwrite to "
                          f"replace it")
    check_target_layout(config, tp, pp)
    if ckpt_format == "torch_dist" and any(config.is_moe_layer(i) != config.is_moe_layer(0)
                                           for i in range(config.num_layers)):
        raise ConfigError("--ckpt-format torch_dist stacks the layers, which needs every layer "
                          "to be a MoE layer (--moe-layer-freq 1); write this model with "
                          "--ckpt-format torch")
    layout.check_state(state, config, "to export")
    args = layout.args_for(config, tp, pp, divisible_by, {**moe.megatron_args(config),
                                                          **mla.megatron_args(config),
                                                          **(extra_args or {})})
    state = {n: pad_vocab_rows(t, args.padded_vocab_size) if n.endswith(VOCAB_PARAMS) else t
             for n, t in state.items()}
    try:
        with staged_directory(out) as staging:
            directory = checkpoint_dir(staging, iteration)  # Megatron's iter_XXXXXXX too
            directory.mkdir(parents=True)
            common = {"iteration": iteration, "checkpoint_version": CHECKPOINT_VERSION,
                      "args": args}
            if ckpt_format == "torch":
                _write_legacy(directory, config, state, common, tp, pp)
            else:
                _write_torch_dist(directory, config, state, common)
            (staging / TRACKER_FILENAME).write_text(str(iteration))
    except OSError as error:
        raise CheckpointError(f"cannot write Megatron checkpoint {out}: {error}") from error
    return out


def _write_legacy(directory: Path, config: GPTConfig, state: dict, common: dict, tp: int,
                  pp: int) -> None:
    params = layout.meta_params(config)
    stages = layout.stage_layers(config.num_layers, pp, "export")
    for p, layers in enumerate(stages):
        for t in range(tp):
            model, stacked_shards = {}, {}
            for name in _stage_names(config, layers, p == 0, p == pp - 1):
                key = layout.legacy_name(layout.local_layer_name(name, layers.start))
                if name.endswith("._extra_state"):
                    model[key] = None
                    continue
                expert = moe.legacy_expert(name, "export")
                source = (expert[0] if expert else
                          layout.EMBEDDING if name not in state else name)
                if source not in stacked_shards:
                    # tp_shard's rule is megalite's TP split, which is Megatron's (layout.py);
                    # no name: the vocabulary rows are padded for the target TP already.
                    stacked_shards[source] = tp_shard(state[source], params[source], "", t, tp)
                shard = stacked_shards[source]
                model[key] = (shard[expert[1]] if expert else shard).clone()
            path = directory / legacy_rank_dir(t, p, pp) / LEGACY_FILE
            path.parent.mkdir()
            torch.save({"model": model, **common}, path)


def _stage_names(config: GPTConfig, layers: range, first: bool, last: bool) -> list[str]:
    """Megatron's state-dict keys of one pipeline stage (global layer numbers)."""
    names = []
    norm_kinds = ("weight", "bias") if config.normalization == "LayerNorm" else ("weight",)
    if first or (last and config.mtp_depths):  # the MTP embeds tokens on the last stage
        names.append(layout.EMBEDDING)
        if config.position_embedding_type == "learned_absolute":
            names.append("embedding.position_embeddings.weight")
    for i in layers:
        names += _layer_names(config, f"{layout.LAYER_PREFIX}{i}.", i)
    if last:
        names += [f"decoder.final_layernorm.{k}" for k in norm_kinds]
        names += [n for k in range(config.mtp_depths) for n in _mtp_names(config, k)]
        # Tied on one stage: the embedding is the output weight; on PP > 1 the last stage
        # keeps its own copy (Megatron syncs it at start).
        if config.untie_embeddings_and_output_weights or not first:
            names.append(layout.OUTPUT)
        names.append("output_layer._extra_state")
    return names


def _layer_names(config: GPTConfig, prefix: str, i: int) -> list[str]:
    """Megatron's keys of a transformer layer of layer i's kind under `prefix`."""
    kinds = ("weight", "bias") if config.add_bias_linear else ("weight",)
    norm_kinds = ("weight", "bias") if config.normalization == "LayerNorm" else ("weight",)
    names = []
    moe_mlp = moe.layer_mlp_names(config, i)
    for module in _layer_modules(config):
        if moe_mlp is not None and module.startswith("mlp."):
            if module == LAYER_MODULES[-1]:
                names += [prefix + n for n in moe_mlp]
            continue
        if module in LINEARS or mla.is_linear(module):
            names += [f"{prefix}{module}.{k}" for k in (*kinds, "_extra_state")]
        else:
            names += [f"{prefix}{module}.{k}" for k in norm_kinds]
    return names


def _mtp_names(config: GPTConfig, k: int) -> list[str]:
    """Megatron's keys of MTP layer k, in its registration order; its transformer layer is
    of the decoder's last layer's kind (model/mtp.py)."""
    prefix = f"{layout.MTP_PREFIX}{k}."
    norm_kinds = ("weight", "bias") if config.normalization == "LayerNorm" else ("weight",)
    norms = [f"{prefix}{norm}.{kind}" for norm in ("enorm", "hnorm") for kind in norm_kinds]
    return (norms + [f"{prefix}eh_proj.weight", f"{prefix}eh_proj._extra_state"]
            + _layer_names(config, prefix + layout.MTP_LAYER, config.num_layers - 1)
            + [f"{prefix}final_layernorm.{kind}" for kind in norm_kinds])


def _layer_modules(config: GPTConfig) -> tuple[str, ...]:
    """A layer's modules in Megatron's state-dict order (the QK norms only with
    --qk-layernorm), MLA's attention in place of QKV."""
    if not config.multi_latent_attention:
        return tuple(m for m in LAYER_MODULES if config.qk_layernorm or m not in QK_NORMS)
    return (LAYER_MODULES[0], *mla.attention_modules(config), *LAYER_MODULES[5:])


def _extra_states(config: GPTConfig, layer: int, stacked: bool = True) -> list[str]:
    """torch_dist's `_extra_state` keys of the linears of a layer of layer `layer`'s kind,
    without the layer in the module path: sharded by layer when `stacked`, else (an MTP
    layer's, which no layer offset shards) `shard_0_1`."""
    moe_extra = moe.torch_dist_extra_states(config, layer, stacked)
    shard = f"shard_{layer}_{config.num_layers}" if stacked else "shard_0_1"
    return [f"{linear}._extra_state/{shard}" for linear in _linears(config)
            if moe_extra is None or not linear.startswith("mlp.")] + (moe_extra or [])


def _linears(config: GPTConfig) -> tuple[str, ...]:
    return tuple(m for m in _layer_modules(config) if m in LINEARS or mla.is_linear(m))


def _write_torch_dist(directory: Path, config: GPTConfig, state: dict, common: dict) -> None:
    stacked: dict[str, dict[int, torch.Tensor]] = {}
    flat = {}
    for name, tensor in state.items():
        if name.startswith(layout.LAYER_PREFIX):
            index, rest = name[len(layout.LAYER_PREFIX):].split(".", 1)
            key = layout.LAYER_PREFIX + layout.fused_name(rest, config)
            stacked.setdefault(key, {})[int(index)] = tensor
        elif name.startswith(layout.MTP_PREFIX):  # unstacked, a decoder layer's names
            flat[layout.fused_name(name, config)] = tensor.contiguous()
        else:
            flat[name] = tensor.contiguous()
    layers = config.num_layers
    flat.update({n: torch.stack([per_layer[i] for i in range(layers)])
                 for n, per_layer in stacked.items()})
    extra = [layout.LAYER_PREFIX + key for i in range(layers) for key in _extra_states(config, i)]
    for k in range(config.mtp_depths):  # the MTP layers' unstacked: no layer offset
        prefix = f"{layout.MTP_PREFIX}{k}."
        extra += [f"{prefix}eh_proj._extra_state/shard_0_1"] + [
            prefix + layout.MTP_LAYER + key for key in _extra_states(config, layers - 1, False)]
    # torch.distributed.checkpoint torch.saves each object: [None] as Megatron does.
    flat.update({key: [None] for key in extra})
    flat["common_state/shard_0_1"] = [common]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process.*")
        dcp.save(flat, storage_writer=FileSystemWriter(str(directory)),
                 planner=DefaultSavePlanner(flatten_state_dict=False), no_dist=True)
    (directory / "metadata.json").write_text(json.dumps(BACKEND_METADATA))
