r"""Convert between megalite checkpoints and HuggingFace transformers models.

    # A megalite checkpoint, saved at any (TP, PP, DP) layout -> a directory that
    # transformers.AutoModelForCausalLM.from_pretrained loads (GPT-2 or Llama style, Qwen3
    # with --qk-layernorm; a mixture of experts as Mixtral, Qwen2-MoE or Qwen3-MoE;
    # --multi-latent-attention as DeepSeek-V3):
    python tools/convert_checkpoint.py --load ckpt [--iteration N] --export-hf hf_out \
        [--dtype bf16|fp16|fp32]

    # A HF GPT-2 / Llama / Qwen3 / Mixtral / Qwen2-MoE / Qwen3-MoE / DeepSeek-V3 model -> a megalite
    # checkpoint at iteration 0 that pretrain_gpt.py loads at any layout; the import prints
    # the model flags to load it with:
    python tools/convert_checkpoint.py --import-hf hf_dir --save ckpt
    python pretrain_gpt.py --load ckpt --finetune <printed model flags> ...

    # A Megatron-LM save directory (torch_dist or legacy torch, any TP/PP) -> a megalite
    # checkpoint at the same iteration (model flags given here are checked against its args;
    # pretrain_gpt.py --load also reads a Megatron directory directly):
    python tools/convert_checkpoint.py --import-megatron megatron_ckpt --save ckpt \
        [--ckpt-format torch|torch_dist] [--vocab-size N] [model flags to check]
    # ... and back, at a chosen Megatron TP/PP:
    python tools/convert_checkpoint.py --load ckpt --export-megatron megatron_out \
        --ckpt-format torch_dist --target-tensor-parallel-size 2 --target-pipeline-parallel-size 1

Export reassembles every parameter's full single-process tensor from the saved shards
(megalite/checkpointing/loading.py), so the layout it was trained at does not matter.
Import writes the files a one-process run (TP 1, PP 1, DP 1) writes, without RNG states
(and without optimizer state, except Adam's from a legacy Megatron checkpoint of the
non-distributed optimizer), which a load at any layout reshards. The Megatron side is
megalite/megatron_checkpoint/. The weight mapping and the styles HF has
a counterpart for are megalite/hf_convert.py's. Outputs appear complete or not at all:
the export is staged and renamed by export_to_hf, the checkpoint by storage.commit.
"""

import argparse
import dataclasses
import shlex
import sys
from pathlib import Path

import torch
from torch import nn

import megalite
from megalite.checkpointing import remote, saving
from megalite.checkpointing.loading import SavedCheckpoint
from megalite.checkpointing.state import saved_params
from megalite.checkpointing.storage import (TRACKER_FILENAME, checkpoint_dir,
                                            commit, find_checkpoint_to_load, prepare_staging,
                                            read_metadata, save_tensor_file)
from megalite.config import GPTConfig
from megalite.config.flags import flag_name
from megalite.errors import CheckpointError, ConfigError, MegaliteError
from megalite.hf_convert import export_to_hf, import_from_hf, pad_vocab
from megalite.megatron_checkpoint import convert as megatron_convert
from megalite.megatron_checkpoint.writer import write_checkpoint as write_megatron
from megalite.model.gpt import GPTModel
from megalite.object_storage.paths import check_storage_path
from megalite.validation import pad_vocab_size

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
EMBEDDING = "embedding.word_embeddings.weight"
# The flags each direction takes (args attributes); each defaults to None or False.
DIRECTION_FLAGS = {
    "export_hf": ("load", "iteration", "dtype", "overwrite"),
    "import_hf": ("save", "make_vocab_size_divisible_by"),
    "export_megatron": ("load", "iteration", "overwrite", "ckpt_format",
                        "target_tensor_parallel_size", "target_pipeline_parallel_size",
                        "make_vocab_size_divisible_by"),
    "import_megatron": ("save", "ckpt_format", "vocab_size")}


# --- export: megalite -> HF ----------------------------------------------------------------

def find_checkpoint(load: str, iteration: int | None) -> tuple[int, Path, dict]:
    """(iteration, directory, metadata) of the checkpoint the tracker names, or of
    --iteration. From a bucket, that checkpoint is first downloaded into the node's cache."""
    if remote.is_remote(load):
        local = remote.fetch(load, None, iteration)
        if local is None:
            raise CheckpointError(f"--load {load}: no checkpoint there (no {TRACKER_FILENAME} "
                                  f"and no iter_* objects)")
        load = str(local)
    if iteration is not None:
        directory = checkpoint_dir(load, iteration)
        meta = read_metadata(directory)
        if meta["iteration"] != iteration:
            raise CheckpointError(f"checkpoint {directory} records iteration "
                                  f"{meta['iteration']}, not --iteration {iteration}")
        return iteration, directory, meta
    if not Path(load).exists():
        raise CheckpointError(f"--load {load} does not exist")
    found = find_checkpoint_to_load(load)
    if found is None:
        raise CheckpointError(f"--load {load}: no checkpoint there (no {TRACKER_FILENAME} "
                              f"and no iter_* directory)")
    iteration, directory = found
    return iteration, directory, read_metadata(directory)


def full_state_dict(directory: Path, meta: dict) -> tuple[GPTConfig, dict[str, torch.Tensor]]:
    """The single-process model's config and state dict, rebuilt from the shards. The
    vocabulary tensors keep the padded rows of the saved TP size; the config's
    padded_vocab_size follows them. A tied model has no output_layer.weight, as in the
    single-process model."""
    saved = SavedCheckpoint(directory, meta)
    state = {name: saved.param(name) for name in saved.names}
    if EMBEDDING not in state:
        raise CheckpointError(f"checkpoint {directory} has no {EMBEDDING}")
    try:
        # Dropouts: an exported model is for inference; HF copies them into its config.
        config = GPTConfig(**meta["model"], padded_vocab_size=state[EMBEDDING].shape[0],
                           attention_dropout=0.0, hidden_dropout=0.0)
    except TypeError as error:
        raise CheckpointError(f"checkpoint {directory}: its metadata's model fields do not "
                              f"match this megalite's GPTConfig ({error})") from error
    return config, state


def export(args) -> Path:
    out = Path(args.export_hf)
    if out.exists() and not args.overwrite:
        raise ConfigError(f"--export-hf {out} already exists; pass --overwrite to replace it")
    iteration, directory, meta = find_checkpoint(args.load, args.iteration)
    config, state = full_state_dict(directory, meta)
    export_to_hf(config, state, out, dtype=DTYPES[args.dtype] if args.dtype else None,
                 overwrite=args.overwrite)
    print(f"exported iteration {iteration} of {args.load} ({directory}, saved at layout "
          f"{_layout_text(meta['layout'])}) to {out}")
    return out


def _layout_text(layout: dict) -> str:
    return (f"TP {layout['tensor_model_parallel_size']} PP "
            f"{layout['pipeline_model_parallel_size']} DP {layout['data_parallel_size']}")


# --- import: HF -> megalite ----------------------------------------------------------------

def saved_shard_layout(config: GPTConfig) -> tuple[list[str], dict]:
    """Every saved parameter's name, and saving.shard_layout of the single-process model
    (which parameters split over TP, along which dim, stacked how). That depends on the
    modules and not on their widths, so the model is built 2 wide: a full-size one would
    allocate and initialise every weight just to be asked this."""
    narrow = dataclasses.replace(config, hidden_size=2, ffn_hidden_size=2, kv_channels=2,
                                 padded_vocab_size=2, vocab_size=None, seq_length=2,
                                 max_position_embeddings=2, rotary_percent=1.0,
                                 **{f: 2 for f in ("moe_ffn_hidden_size",
                                                   "moe_shared_expert_intermediate_size")
                                    if getattr(config, f, None)})
    params = saved_params(nn.ModuleList([GPTModel(narrow, seed=0)]))
    return list(params), saving.shard_layout(params)


def save_single_process_checkpoint(save: str, config: GPTConfig,
                                   state: dict[str, torch.Tensor], source: str) -> Path:
    """Iteration 0 of a one-process run, model only: the files and metadata
    saving.save_checkpoint writes, which loading.load_checkpoint reshards to any layout."""
    names, shard_layout = saved_shard_layout(config)
    names = set(names)
    if set(state) != names:
        raise ConfigError(f"the imported weights do not match the megalite model: missing "
                          f"{sorted(names - set(state))}, unexpected "
                          f"{sorted(set(state) - names)}")
    staging = prepare_staging(save, 0)
    save_tensor_file({"params": state, **shard_layout},
                     staging / saving.model_file(0, 0))
    layout = saving.SINGLE_PROCESS_LAYOUT
    metadata = {"format_version": saving.FORMAT_VERSION,
                "megalite_version": megalite.__version__, "torch_version": torch.__version__,
                "layout": layout, "model": saving.model_fields(config),
                "has_optimizer": False, "has_rng": False, "consumed_train_samples": 0,
                "consumed_valid_samples": 0, "scheduler": {"num_steps": 0},
                "grad_scaler": None,
                "config": {"converted_from_hf": source}, "run_file": None}
    return commit(save, 0, metadata,
                  saving.expected_files(layout, save_optim=False, save_rng=False))


def _check_empty(save: str):
    """A new checkpoint at iteration 0 in a directory with others would move its tracker
    back to 0 under a run that resumes from it."""
    path = Path(save)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"--save {path} is not a directory")
    if not path.exists():
        return
    # Staging dirs are leftovers of an interrupted save; prepare_staging replaces them.
    entries = sorted(p.name for p in path.iterdir() if not p.name.endswith(".tmp"))
    if entries:
        raise ConfigError(f"--save {path} is not empty (holds {entries[:5]}); the imported "
                          f"checkpoint needs a directory of its own")


def load_flags(config: GPTConfig) -> list[str]:
    """The pretrain_gpt.py model flags whose config loads this checkpoint (the fields
    model_fields.MODEL_FIELDS compares, plus norm_epsilon, which it does not)."""
    c = config
    flags = ["--num-layers", c.num_layers, "--hidden-size", c.hidden_size,
             "--ffn-hidden-size", c.ffn_hidden_size, "--num-attention-heads",
             c.num_attention_heads]
    if c.num_query_groups != c.num_attention_heads:
        flags += ["--group-query-attention", "--num-query-groups", c.num_query_groups]
    if c.kv_channels * c.num_attention_heads != c.hidden_size and not c.multi_latent_attention:
        flags += ["--kv-channels", c.kv_channels]
    flags += ["--max-position-embeddings", c.max_position_embeddings,
              "--position-embedding-type", c.position_embedding_type]
    if c.position_embedding_type == "rope":
        flags += ["--rotary-base", c.rotary_base, "--rotary-percent", c.rotary_percent]
    flags += ["--normalization", c.normalization, "--norm-epsilon", c.norm_epsilon]
    flags += ["--swiglu"] * c.swiglu + ["--disable-bias-linear"] * (not c.add_bias_linear)
    flags += ["--untie-embeddings-and-output-weights"] * c.untie_embeddings_and_output_weights
    flags += ["--qk-layernorm"] * c.qk_layernorm
    flags += ["--mtp-num-layers", c.mtp_num_layers] if c.mtp_num_layers else []
    return [str(f) for f in flags + moe_flags(c) + mla_flags(c)]


def mla_flags(c: GPTConfig) -> list:
    """load_flags' multi-latent-attention part (model_fields.MLA_MODEL_FIELDS)."""
    if not c.multi_latent_attention:
        return []
    flags = ["--multi-latent-attention"]
    flags += [] if c.q_lora_rank is None else ["--q-lora-rank", c.q_lora_rank]
    flags += ["--kv-lora-rank", c.kv_lora_rank, "--qk-head-dim", c.qk_head_dim,
              "--qk-pos-emb-head-dim", c.qk_pos_emb_head_dim, "--v-head-dim", c.v_head_dim,
              "--rope-type", c.rope_type]
    if c.rope_type == "yarn":
        flags += ["--rotary-scaling-factor", c.rotary_scaling_factor, "--mscale", c.mscale,
                  "--mscale-all-dim", c.mscale_all_dim, "--yarn-original-max-position-embeddings",
                  c.yarn_original_max_position_embeddings, "--yarn-beta-fast", c.yarn_beta_fast,
                  "--yarn-beta-slow", c.yarn_beta_slow]
    return flags


def moe_flags(c: GPTConfig) -> list:
    """load_flags' MoE part (model_fields.MOE_FIELDS); --moe-layer-freq as Megatron's list."""
    if not c.num_experts:
        return []
    pattern = [int(c.is_moe_layer(i)) for i in range(c.num_layers)]
    freq = 1 if all(pattern) else "[" + ",".join(map(str, pattern)) + "]"
    flags = ["--num-experts", c.num_experts, "--moe-ffn-hidden-size", c.moe_ffn_hidden_size,
             "--moe-router-topk", c.moe_router_topk, "--moe-layer-freq", freq,
             "--moe-router-score-function", c.moe_router_score_function]
    if c.moe_shared_expert_intermediate_size:
        flags += ["--moe-shared-expert-intermediate-size", c.moe_shared_expert_intermediate_size]
    for name in ("moe_router_topk_scaling_factor", "moe_router_num_groups",
                 "moe_router_group_topk"):
        if getattr(c, name) is not None:
            flags += [flag_name(name), getattr(c, name)]
    return (flags + ["--moe-router-pre-softmax"] * c.moe_router_pre_softmax
            + ["--moe-router-enable-expert-bias"] * c.moe_router_enable_expert_bias)


def import_(args) -> Path:
    if not Path(args.import_hf).is_dir():
        raise ConfigError(f"--import-hf {args.import_hf} is not a directory (save a hub "
                          f"model locally first, e.g. with save_pretrained)")
    _check_empty(args.save)
    try:
        fields, state = import_from_hf(args.import_hf)
    except (OSError, ValueError) as error:  # no config.json or weights, or unreadable ones
        raise ConfigError(f"--import-hf {args.import_hf}: cannot load a HF model there: "
                          f"{error}") from error
    padded = pad_vocab_size(fields["vocab_size"], args.make_vocab_size_divisible_by, 1)
    config = GPTConfig(**fields, padded_vocab_size=padded)
    state = {name: t.contiguous() for name, t in pad_vocab(state, padded).items()}
    final = save_single_process_checkpoint(args.save, config, state, str(args.import_hf))
    print(f"imported {args.import_hf} as {final}; train from it with a tokenizer of "
          f"{config.vocab_size} tokens (or --vocab-size {config.vocab_size}) and\n"
          f"  python pretrain_gpt.py --load {shlex.quote(args.save)} --finetune "
          f"{shlex.join(load_flags(config))}")
    return final


# --- Megatron-LM: megalite <-> megatron.core GPTModel checkpoints ----------------------------

def export_megatron(args) -> Path:
    iteration, directory, meta = find_checkpoint(args.load, args.iteration)
    config, state = full_state_dict(directory, meta)
    tp, pp = args.target_tensor_parallel_size or 1, args.target_pipeline_parallel_size or 1
    fmt = args.ckpt_format or "torch_dist"
    out = write_megatron(args.export_megatron, config, state, iteration, fmt, tp, pp,
                         args.make_vocab_size_divisible_by,
                         {"consumed_train_samples": meta["consumed_train_samples"],
                          "consumed_valid_samples": meta["consumed_valid_samples"]},
                         overwrite=args.overwrite)
    print(f"exported iteration {iteration} of {args.load} to {out} (Megatron --ckpt-format "
          f"{fmt}, TP {tp}, PP {pp}); the optimizer is not exported: Megatron starts it "
          f"fresh (load with --no-load-optim --no-load-rng)")
    return out


def import_megatron(args) -> Path:
    _check_empty(args.save)
    final = megatron_convert.import_megatron(args.import_megatron, args.save, args.ckpt_format,
                                             megatron_convert.shape_flags_given(args),
                                             args.vocab_size)
    meta = read_metadata(final)
    config = GPTConfig(**meta["model"], padded_vocab_size=meta["model"]["vocab_size"])
    print(f"imported {args.import_megatron} as {final} (iteration {meta['iteration']}); "
          f"continue from it with\n  python pretrain_gpt.py --load {shlex.quote(args.save)} "
          f"--vocab-size {config.vocab_size} {shlex.join(load_flags(config))}")
    return final


# --- command line --------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    g = parser.add_argument_group("export a megalite checkpoint to HF")
    g.add_argument("--load", metavar="DIR",
                   help="megalite save directory (as pretrain_gpt.py --save)")
    g.add_argument("--iteration", type=int, default=None, metavar="N",
                   help="checkpoint iteration to export (default: the one the tracker names)")
    g.add_argument("--export-hf", metavar="DIR", help="output directory for the HF model")
    g.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="dtype of the exported weights (default: as saved)")
    g.add_argument("--overwrite", action="store_true", help="replace an existing --export-hf")
    g = parser.add_argument_group("import a HF model as a megalite checkpoint")
    g.add_argument("--import-hf", metavar="DIR",
                   help="HF model directory (GPT-2, Llama, Qwen3, Mixtral, Qwen2-MoE, "
                        "Qwen3-MoE or DeepSeek-V3)")
    g.add_argument("--save", metavar="DIR", help="new megalite save directory (empty or absent)")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=None, metavar="N",
                   help="pad the vocabulary to a multiple of this (default 128; "
                        "pretrain_gpt.py repads to its own TP size on load)")
    megatron_convert.add_megatron_args(parser)
    args = parser.parse_args(argv)
    _check_flags(parser, args)
    try:
        check_storage_path("--load", args.load)
        check_storage_path("--save", args.save, local_only=True)
    except ConfigError as error:
        parser.error(str(error))
    if args.make_vocab_size_divisible_by is None:
        args.make_vocab_size_divisible_by = 128
    return args


DIRECTIONS = {"export_hf": "--export-hf", "import_hf": "--import-hf",
              "export_megatron": "--export-megatron", "import_megatron": "--import-megatron"}


def _check_flags(parser: argparse.ArgumentParser, args: argparse.Namespace):
    """Exactly one direction, with its own flags only (parser.error exits with 2)."""
    chosen = [d for d in DIRECTIONS if getattr(args, d) is not None]
    if len(chosen) != 1:
        parser.error("pass exactly one of --export-hf or --export-megatron (with --load), "
                     "--import-hf or --import-megatron (with --save)")
    direction = chosen[0]
    exporting = direction.startswith("export")
    if exporting and args.load is None:
        parser.error(f"{DIRECTIONS[direction]} needs --load (the megalite save directory)")
    if not exporting and args.save is None:
        parser.error(f"{DIRECTIONS[direction]} needs --save (the megalite save directory "
                     f"to write)")
    others = {f for d, flags in DIRECTION_FLAGS.items() for f in flags}
    wrong = [flag_name(name) for name in sorted(others - set(DIRECTION_FLAGS[direction]))
             if getattr(args, name) not in (None, False)]
    if direction != "import_megatron":
        wrong += [flag_name(n) for n in megatron_convert.shape_flags_given(args)]
    if wrong:
        parser.error(f"not used with {DIRECTIONS[direction]}: {', '.join(wrong)}")
    if args.iteration is not None and args.iteration < 0:
        parser.error(f"--iteration must be >= 0, got {args.iteration}")
    for name in ("make_vocab_size_divisible_by", "target_tensor_parallel_size",
                 "target_pipeline_parallel_size", "vocab_size"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            parser.error(f"{flag_name(name)} must be positive, got {getattr(args, name)}")


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if args.export_hf is not None:
            export(args)
        elif args.import_hf is not None:
            import_(args)
        elif args.export_megatron is not None:
            export_megatron(args)
        else:
            import_megatron(args)
    except (MegaliteError, ImportError) as e:  # ImportError: transformers is not installed
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
