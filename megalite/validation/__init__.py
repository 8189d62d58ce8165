"""Parsed flags -> the frozen Config (megalite/config/), or a ConfigError naming the flags.

Each section of Config is built from its fields' flags (config/flags.py `from_flags`) and
the fields derived here, each once: ffn size, kv channels, query groups, padded vocabulary
(model.py), data-parallel size and the pipeline split (layout.py, uneven.py), global batch
(micro-batch x DP when unset) and everything counted in samples from it (schedule.py). Each
module also declares the flags its fields are derived from and no config keeps
(`INPUT_FLAGS`). Two entry points: `validate_args` for training, `validate_model_args` for
the tools (no optimizer, schedule or data).
"""

from megalite.config import Config
from megalite.config.flags import from_flags
from megalite.validation.checks import check_positive, require
from megalite.validation.grad_compression import check_grad_compression
from megalite.validation.layout import (LayoutFlags, batch, parallel_config,
                                        validate_pipeline_schedule)
from megalite.validation.model import KernelSwitches, ModelFlags, model_fields
from megalite.validation.model import pad_vocab_size  # noqa: F401 (megalite.validation's)
from megalite.validation.moe import MoeFlags, RefusedMoeFlags
from megalite.validation.run import (TokenizerFlags, check_checkpoint, check_data_source,
                                     check_wandb, monitoring_fields, precision_fields)
from megalite.validation.schedule import (ScheduleFlags, check_optimizer, run_length,
                                          scheduler_fields)
from megalite.validation.uneven import UnevenFlags

MODEL_FLAGS = ("num_layers", "hidden_size", "num_attention_heads", "seq_length")

INPUT_FLAGS = (ModelFlags, LayoutFlags, ScheduleFlags, TokenizerFlags, UnevenFlags, MoeFlags,
               RefusedMoeFlags, KernelSwitches)
"""Where the flags that no config keeps are declared: config fields are derived from them."""


def validate_args(args, world_size: int = 1,
                  tokenizer_vocab_size: int | None = None) -> Config:
    """The training configuration. `tokenizer_vocab_size` is the vocabulary of the
    tokenizer --tokenizer-type built (None without one). Raises ConfigError."""
    require(args, *MODEL_FLAGS, "micro_batch_size", "lr")
    check_data_source(args)
    check_wandb(args)
    sections = _sections(args, world_size, tokenizer_vocab_size)
    training = sections["training"]
    global_batch = training["global_batch_size"]
    training["train_iters"], training["train_samples"] = run_length(args, global_batch)
    check_optimizer(args)
    return from_flags(Config, args, **sections, optimizer={},
                      scheduler=scheduler_fields(args, global_batch, training["train_samples"]),
                      data=dict(data_path=tuple(args.data_path or ())))


def validate_model_args(args, world_size: int = 1,
                        tokenizer_vocab_size: int | None = None) -> Config:
    """Model, parallel layout, precision, batch (micro-batch 1 without
    --micro-batch-size), checkpoint, monitoring and distributed flags only: for
    tools/estimate_memory.py and tools/generate.py. No optimizer, scheduler or data
    (None), no run length. Raises ConfigError."""
    require(args, *MODEL_FLAGS)
    return from_flags(Config, args, **_sections(args, world_size, tokenizer_vocab_size))


def _sections(args, world_size: int, tokenizer_vocab_size: int | None) -> dict:
    """Config's sections but optimizer, scheduler and data, after their checks: each a dict
    of the fields derived (the rest from their flags), or the section itself."""
    check_positive(args, *MODEL_FLAGS, "micro_batch_size", "log_interval", "eval_interval",
                   "make_vocab_size_divisible_by", "tensor_model_parallel_size",
                   "pipeline_model_parallel_size", "distributed_timeout_minutes")
    parallel = parallel_config(args, world_size)
    micro, global_batch, num_micro, shares = batch(args, parallel)
    validate_pipeline_schedule(args, parallel, num_micro)
    model = model_fields(args, parallel, tokenizer_vocab_size)
    precision = precision_fields(args)
    check_checkpoint(args)
    check_grad_compression(args, parallel)
    return dict(model=model, parallel=parallel, precision=precision,
                training=dict(micro_batch_size=micro, global_batch_size=global_batch,
                              num_microbatches=num_micro, data_parallel_shares=shares,
                              data_parallel_shares_auto=args.data_parallel_shares == "auto",
                              train_iters=None, train_samples=None),
                monitoring=monitoring_fields(args, world_size))
