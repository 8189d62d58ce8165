"""A Megatron-LM checkpoint converted into a megalite checkpoint (tools/convert_checkpoint.py
--import-megatron): the files a one-process run (TP 1, PP 1, DP 1) writes (saving.py), which
a load at any megalite layout reshards, at the Megatron checkpoint's iteration, with its
consumed samples and learning-rate step, and Adam's state where it maps one to one
(optimizer_state.py).
"""

import argparse
import dataclasses
from pathlib import Path

import torch

import megalite
from megalite.checkpointing import saving
from megalite.checkpointing.storage import commit, prepare_staging, save_tensor_file
from megalite.config.flags import flag_name
from megalite.errors import ConfigError
from megalite.megatron_checkpoint import layout
from megalite.megatron_checkpoint.optimizer_state import AdamState, adam_state
from megalite.megatron_checkpoint.reader import MegatronCheckpoint, read_checkpoint

# Model-shape flags of pretrain_gpt.py the import checks against the checkpoint's args:
# GPTConfig field (the flag's dest) -> type; switches are flag dest -> (field, value when given).
SHAPE_FLAGS = dict(
    num_layers=int, hidden_size=int, ffn_hidden_size=int, num_attention_heads=int,
    num_query_groups=int, kv_channels=int, seq_length=int, max_position_embeddings=int,
    rotary_base=int, rotary_percent=float, norm_epsilon=float, position_embedding_type=str,
    normalization=str)
SHAPE_SWITCHES = {"swiglu": ("swiglu", True), "disable_bias_linear": ("add_bias_linear", False),
                  "untie_embeddings_and_output_weights":
                      ("untie_embeddings_and_output_weights", True)}


def add_megatron_args(parser: argparse.ArgumentParser):
    """tools/convert_checkpoint.py's Megatron flags, and the model flags it checks."""
    g = parser.add_argument_group("Megatron-LM checkpoints (Megatron's flag names)")
    g.add_argument("--import-megatron", metavar="DIR",
                   help="Megatron save directory (with latest_checkpointed_iteration.txt) to "
                        "convert into --save")
    g.add_argument("--export-megatron", metavar="DIR",
                   help="write the --load checkpoint as a Megatron save directory")
    g.add_argument("--ckpt-format", choices=["torch", "torch_dist"], default=None,
                   help="Megatron format: read (default: detected) or written (default "
                        "torch_dist, Megatron's)")
    g.add_argument("--target-tensor-parallel-size", type=int, default=None, metavar="N",
                   help="TP size of the exported Megatron checkpoint (default 1)")
    g.add_argument("--target-pipeline-parallel-size", type=int, default=None, metavar="N",
                   help="PP size of the exported Megatron checkpoint (default 1)")
    g.add_argument("--vocab-size", type=int, default=None, metavar="N",
                   help="the tokenizer's vocabulary, when the Megatron args do not record it "
                        "(default: every saved row)")
    g = parser.add_argument_group("model flags checked against the Megatron args "
                                  "(--import-megatron; optional)")
    for name, kind in SHAPE_FLAGS.items():
        g.add_argument(flag_name(name), type=kind, default=argparse.SUPPRESS)
    for name in (*SHAPE_SWITCHES, "group_query_attention"):
        g.add_argument(flag_name(name), action="store_true", default=argparse.SUPPRESS)


def shape_flags_given(args: argparse.Namespace) -> dict:
    """The model flags on the command line (their defaults are SUPPRESS: absent if not)."""
    return {n: getattr(args, n) for n in (*SHAPE_FLAGS, *SHAPE_SWITCHES) if hasattr(args, n)}


def check_flags(ckpt: MegatronCheckpoint, given: dict) -> None:
    """`given`: flag dest -> value of the model flags on the command line. Any that
    disagrees with the checkpoint's args is named, with both values."""
    c = ckpt.config
    wanted = [(n, v) if n in SHAPE_FLAGS else SHAPE_SWITCHES[n] for n, v in given.items()
              if n in SHAPE_FLAGS or (n in SHAPE_SWITCHES and v)]
    differing = [f"{f}: checkpoint args {getattr(c, f)!r}, command line {v!r}"
                 for f, v in wanted if getattr(c, f) != v]
    if differing:
        raise ConfigError(f"Megatron checkpoint {ckpt.directory} holds another model than the "
                          f"flags describe; differing fields:\n  " + "\n  ".join(differing))


def import_megatron(load: str, save: str, ckpt_format: str | None = None,
                    given_flags: dict | None = None, vocab_size: int | None = None) -> Path:
    ckpt = read_checkpoint(load, ckpt_format)
    check_flags(ckpt, given_flags or {})
    rows = ckpt.config.padded_vocab_size
    vocab = vocab_size or ckpt.config.vocab_size or rows
    if vocab > rows:
        raise ConfigError(f"--vocab-size {vocab} exceeds the checkpoint's {rows} vocabulary rows")
    config = dataclasses.replace(ckpt.config, vocab_size=vocab)
    adam, why = adam_state(ckpt)
    if adam is None:
        print(f"note: {ckpt.directory}: {why}; a run from the imported checkpoint starts a "
              f"fresh optimizer (Adam moments zero, step 0)", flush=True)
    return write_megalite_checkpoint(
        save, config, ckpt.state, ckpt.iteration, ckpt.consumed("train"), ckpt.scheduler_steps,
        adam, {"converted_from_megatron": str(ckpt.directory), "ckpt_format": ckpt.ckpt_format})


def write_megalite_checkpoint(save: str, config, state: dict[str, torch.Tensor],
                              iteration: int, consumed: int, scheduler_steps: int,
                              adam: AdamState | None, origin: dict) -> Path:
    """A one-process run's checkpoint of `state` (saving.py's files), committed atomically."""
    params = {n: p for n, p in layout.meta_params(config).items() if n in state}
    staging = prepare_staging(save, iteration)
    save_tensor_file({"params": {n: t.contiguous() for n, t in state.items()},
                      **saving.shard_layout(params)}, staging / saving.model_file(0, 0))
    if adam is not None:
        segments = {n: {"range": torch.tensor([0, t.numel()]),
                        **{k: v.reshape(-1).contiguous() for k, v in adam.tensors[n].items()}}
                    for n, t in state.items()}
        save_tensor_file({"step": adam.step, "segments": segments},
                         staging / saving.optim_file(0, 0, 0))
    metadata = {"format_version": saving.FORMAT_VERSION,
                "megalite_version": megalite.__version__, "torch_version": torch.__version__,
                "layout": saving.SINGLE_PROCESS_LAYOUT, "model": saving.model_fields(config),
                "has_optimizer": adam is not None, "has_rng": False,
                "consumed_train_samples": consumed, "consumed_valid_samples": 0,
                "scheduler": {"num_steps": scheduler_steps}, "grad_scaler": None,
                "config": origin, "run_file": None}
    return commit(save, iteration, metadata, saving.expected_files(
        saving.SINGLE_PROCESS_LAYOUT, save_optim=adam is not None, save_rng=False))
