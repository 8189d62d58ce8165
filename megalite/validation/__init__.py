"""Parsed flags -> the frozen Config (megalite/config.py), or a ConfigError naming the flags.

Megatron's derived defaults are applied here, each once: ffn size, kv channels, query
groups, padded vocabulary, data-parallel size, global batch (micro-batch x DP when unset)
and everything counted in samples from it (run length, warm-up, decay). Two entry points:
`validate_args` for training, `validate_model_args` for the tools (no optimizer, schedule
or data). The parallel layout and the batch are checked in layout.py, the checks all parts
share in checks.py.
"""

import dataclasses
import importlib.util

from megalite.config import (CheckpointConfig, Config, DataConfig, DistributedConfig,
                            GPTConfig, LoggingConfig, MonitoringConfig, OptimizerConfig,
                            ParallelConfig, PrecisionConfig, SchedulerConfig, TrainingConfig)
from megalite.errors import ConfigError
from megalite.validation.checks import check_fraction, check_positive, flag, from_flags, require
from megalite.validation.fp8 import check_fp8
from megalite.validation.grad_compression import grad_compression_config
from megalite.validation.layout import batch, parallel_config, validate_pipeline_schedule
from megalite.validation.moe import moe_model_fields
from megalite.validation.uneven import shares_batch

MODEL_FLAGS = ("num_layers", "hidden_size", "num_attention_heads", "seq_length")


def validate_args(args, world_size: int = 1,
                  tokenizer_vocab_size: int | None = None) -> Config:
    """The training configuration. `tokenizer_vocab_size` is the vocabulary of the
    tokenizer --tokenizer-type built (None without one). Raises ConfigError."""
    require(args, *MODEL_FLAGS, "micro_batch_size", "lr")
    _check_data_source(args)
    _check_wandb(args)
    config = validate_model_args(args, world_size, tokenizer_vocab_size)
    global_batch = config.training.global_batch_size
    train_iters, train_samples = _run_length(args, global_batch)
    return dataclasses.replace(
        config, optimizer=_optimizer_config(args),
        training=dataclasses.replace(config.training, train_iters=train_iters,
                                     train_samples=train_samples),
        scheduler=_scheduler_config(args, global_batch, train_samples),
        data=from_flags(DataConfig, args, data_path=tuple(args.data_path or ())),
        monitoring=_validate_monitoring(args, world_size))


def _check_wandb(args):
    """On every rank, before any work: the last rank alone opens the W&B run."""
    if not args.wandb_project:
        return
    if not args.wandb_exp_name:
        raise ConfigError(f"--wandb-project {args.wandb_project}: --wandb-exp-name is "
                          "required (the run's name)")
    if importlib.util.find_spec("wandb") is None:
        raise ConfigError("--wandb-project needs wandb, which is not installed: "
                          "pip install -e .[wandb]  (or pip install wandb)")


def validate_model_args(args, world_size: int = 1,
                        tokenizer_vocab_size: int | None = None) -> Config:
    """Model, parallel layout, precision, batch (micro-batch 1 without
    --micro-batch-size), checkpoint and distributed flags only: for
    tools/estimate_memory.py and tools/generate.py. No optimizer, scheduler or data
    (None), no run length. Raises ConfigError."""
    require(args, *MODEL_FLAGS)
    check_positive(args, *MODEL_FLAGS, "micro_batch_size", "log_interval", "eval_interval",
                    "make_vocab_size_divisible_by", "tensor_model_parallel_size",
                    "pipeline_model_parallel_size", "distributed_timeout_minutes")
    parallel = parallel_config(args, world_size)
    shares = None
    if args.data_parallel_shares is None:
        micro, global_batch, num_micro = batch(args, parallel)
    else:
        micro, global_batch, shares = shares_batch(args, parallel)
        num_micro = max(shares)
    validate_pipeline_schedule(args, parallel, num_micro)
    return Config(
        model=_model_config(args, parallel, _vocab_size(args, tokenizer_vocab_size)),
        parallel=parallel,
        training=TrainingConfig(micro_batch_size=micro, global_batch_size=global_batch,
                                num_microbatches=num_micro, exit_interval=args.exit_interval,
                                data_parallel_shares=shares,
                                data_parallel_shares_auto=args.data_parallel_shares == "auto",
                                data_parallel_shares_threshold=(
                                    args.data_parallel_shares_threshold),
                                data_parallel_shares_window=args.data_parallel_shares_window,
                                eval_interval=args.eval_interval, eval_iters=args.eval_iters,
                                seed=args.seed),
        precision=_precision_config(args),
        logging=from_flags(LoggingConfig, args),
        distributed=DistributedConfig(backend=args.distributed_backend,
                                      timeout_minutes=args.distributed_timeout_minutes),
        checkpoint=_checkpoint_config(args),
        grad_compression=grad_compression_config(args, parallel))


def pad_vocab_size(vocab_size: int, divisible_by: int, tp_size: int) -> int:
    """Megatron's padding: round up to a multiple of divisible_by x TP so every TP shard
    of the embedding and output layer has the same number of rows."""
    multiple = divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple


# Model.

def _model_config(args, parallel: ParallelConfig, vocab_size: int) -> GPTConfig:
    heads, hidden, tp = (args.num_attention_heads, args.hidden_size,
                         parallel.tensor_model_parallel_size)
    kv_channels = args.kv_channels
    if kv_channels is None:
        if hidden % heads:
            raise ConfigError(f"--hidden-size={hidden} is not divisible by "
                              f"--num-attention-heads={heads} (or set --kv-channels)")
        kv_channels = hidden // heads
    groups = args.num_query_groups if args.group_query_attention else heads
    if groups <= 0 or heads % groups:
        raise ConfigError(f"--num-attention-heads={heads} is not divisible by "
                          f"--num-query-groups={groups}")
    _check_tensor_parallel_split(args, heads, groups, tp)
    _check_positions(args, kv_channels)
    check_fp8(args, parallel)
    check_fraction(args, "attention_dropout", "hidden_dropout")
    check_positive(args, "init_method_std")
    ffn = _ffn_size(args, tp)
    return from_flags(
        GPTConfig, args, ffn_hidden_size=ffn, num_query_groups=groups,
        kv_channels=kv_channels,
        max_position_embeddings=args.max_position_embeddings or args.seq_length,
        padded_vocab_size=pad_vocab_size(vocab_size, args.make_vocab_size_divisible_by, tp),
        vocab_size=vocab_size, attention_backend=_attention_backend(args, kv_channels),
        # At TP 1 sequence parallelism is the identity; Megatron turns it off likewise.
        sequence_parallel=args.sequence_parallel and tp > 1,
        recompute_num_layers=_recompute_num_layers(args),
        **moe_model_fields(args, parallel, ffn))


def _ffn_size(args, tp: int) -> int:
    if args.ffn_hidden_size is not None:
        return args.ffn_hidden_size
    # Megatron's rule: SwiGLU has two input projections, so shrink to keep the
    # parameter count of a 4h GeLU MLP, rounded down to a multiple of 64.
    ffn = int(4 * args.hidden_size * 2 / 3 / 64) * 64 if args.swiglu else 4 * args.hidden_size
    if ffn % tp:
        raise ConfigError(f"the default MLP width {ffn} is not divisible by "
                          f"--tensor-model-parallel-size={tp}: set --ffn-hidden-size")
    return ffn


def _check_positions(args, kv_channels: int):
    max_pos = args.max_position_embeddings or args.seq_length
    if args.position_embedding_type == "learned_absolute" and args.seq_length > max_pos:
        raise ConfigError(f"--seq-length={args.seq_length} exceeds "
                          f"--max-position-embeddings={max_pos}")
    if not 0.0 < args.rotary_percent <= 1.0:
        raise ConfigError(f"--rotary-percent must be in (0, 1], got {args.rotary_percent}")
    if args.position_embedding_type == "rope" and int(kv_channels * args.rotary_percent) % 2:
        raise ConfigError(f"RoPE rotates channel pairs: --kv-channels={kv_channels} x "
                          f"--rotary-percent={args.rotary_percent} must be even")


def _recompute_num_layers(args) -> int:
    """Megatron's rules: full recompute names its method; selective takes none."""
    granularity, method, n = (args.recompute_granularity, args.recompute_method,
                              args.recompute_num_layers)
    if granularity == "full" and method is None:
        raise ConfigError("--recompute-granularity full needs --recompute-method "
                          "(uniform or block)")
    if granularity == "selective" and args.compile_layers:
        # Its checkpoint sits inside the layer's forward, with a context_fn that swaps the
        # model-parallel RNG states: torch.compile cannot trace that (torch 2.13).
        raise ConfigError("--recompute-granularity selective recomputes inside each layer, "
                          "which --compile-layers cannot trace; inductor already recomputes "
                          "what is cheap in a compiled layer: drop one of the two, or use "
                          "--recompute-granularity full")
    if granularity != "full" and (method is not None or n is not None):
        raise ConfigError(f"--recompute-method/--recompute-num-layers apply to "
                          f"--recompute-granularity full only (got --recompute-granularity="
                          f"{granularity})")
    check_positive(args, "recompute_num_layers")
    return n or 1


def _check_tensor_parallel_split(args, heads: int, groups: int, tp: int):
    """Attention splits whole query groups (and heads) across TP ranks; the MLP splits
    its hidden units; sequence parallelism splits the sequence."""
    if heads % tp or groups % tp:
        raise ConfigError(f"--tensor-model-parallel-size={tp} must divide "
                          f"--num-attention-heads={heads} and the query groups ({groups}, "
                          "--num-query-groups under --group-query-attention)")
    if args.ffn_hidden_size is not None and args.ffn_hidden_size % tp:
        raise ConfigError(f"--ffn-hidden-size={args.ffn_hidden_size} is not divisible by "
                          f"--tensor-model-parallel-size={tp}")
    if args.sequence_parallel and args.seq_length % tp:
        raise ConfigError(f"--sequence-parallel splits the sequence across TP ranks: "
                          f"--seq-length={args.seq_length} is not divisible by "
                          f"--tensor-model-parallel-size={tp}")


def _attention_backend(args, kv_channels: int) -> str:
    backend = args.attention_backend
    if args.use_flash_attn:
        if backend not in ("auto", "flash"):
            raise ConfigError(f"--use-flash-attn conflicts with --attention-backend {backend}")
        backend = "flash"
    if backend == "flash" and (kv_channels > 256 or kv_channels % 8):
        # flash-attn's kernels exist for head sizes up to 256 in steps of 8.
        raise ConfigError(f"--attention-backend flash (flash-attn) needs a head size "
                          f"(--kv-channels, default --hidden-size / --num-attention-heads) "
                          f"<= 256 and a multiple of 8, got {kv_channels}")
    return backend


def _vocab_size(args, tokenizer_vocab_size: int | None) -> int:
    if tokenizer_vocab_size is not None:
        return tokenizer_vocab_size
    if args.vocab_size is None or args.vocab_size < 3:
        raise ConfigError(f"the vocabulary comes from --tokenizer-type (and its files) or "
                          f"--vocab-size >= 3 (--mock-data), got --vocab-size={args.vocab_size}")
    return args.vocab_size


# Training only: data source, run length, optimizer, schedule.

def _check_data_source(args):
    if args.mock_data == bool(args.data_path):
        raise ConfigError("pass exactly one data source: --data-path PREFIX... (with "
                          "--tokenizer-type) or --mock-data (with --vocab-size)")
    if args.data_path and args.tokenizer_type is None:
        raise ConfigError("--data-path needs --tokenizer-type (and its files) to know the "
                          "vocabulary and the end-of-document id")
    if args.num_workers < 0:
        raise ConfigError(f"--num-workers must be >= 0, got {args.num_workers}")


def _run_length(args, global_batch: int) -> tuple[int, int]:
    """(train_iters, train_samples): Megatron's --train-samples run counts
    --train-samples // global batch iterations, and its schedule the samples as given."""
    if (args.train_iters is None) == (args.train_samples is None):
        raise ConfigError("pass exactly one of --train-iters and --train-samples "
                          f"(got {args.train_iters} and {args.train_samples})")
    check_positive(args, "train_iters", "train_samples", "exit_interval")
    if args.eval_iters < 0:
        raise ConfigError(f"--eval-iters must be >= 0, got {args.eval_iters}")
    if args.train_iters is not None:
        return args.train_iters, args.train_iters * global_batch
    if args.train_samples < global_batch:
        raise ConfigError(f"--train-samples={args.train_samples} is less than one global "
                          f"batch (--global-batch-size={global_batch})")
    return args.train_samples // global_batch, args.train_samples


def _optimizer_config(args) -> OptimizerConfig:
    check_positive(args, "lr")
    if not 0.0 <= args.min_lr <= args.lr:
        raise ConfigError(f"--min-lr={args.min_lr} must be in [0, --lr={args.lr}]")
    check_fraction(args, "adam_beta1", "adam_beta2")
    if args.clip_grad < 0 or args.weight_decay < 0 or args.adam_eps <= 0:
        raise ConfigError(f"need --clip-grad >= 0, --weight-decay >= 0, --adam-eps > 0; got "
                          f"{args.clip_grad}, {args.weight_decay}, {args.adam_eps}")
    return from_flags(OptimizerConfig, args)


def _scheduler_config(args, global_batch: int, train_samples: int) -> SchedulerConfig:
    """Megatron counts schedule steps in samples: iteration flags are multiplied by the
    global batch, so --train-iters and --train-samples runs share one code path."""
    if args.train_iters is not None:
        _reject_flags(args, "samples")
        to_samples = lambda iters: None if iters is None else iters * global_batch  # noqa: E731
        decay = to_samples(args.lr_decay_iters) or train_samples
        warmup, wsd = to_samples(args.lr_warmup_iters), to_samples(args.lr_wsd_decay_iters)
    else:
        _reject_flags(args, "iters")
        decay = args.lr_decay_samples or train_samples
        warmup, wsd = args.lr_warmup_samples, args.lr_wsd_decay_samples
    if args.lr_warmup_fraction is not None:
        if warmup:
            raise ConfigError("pass only one of --lr-warmup-fraction and "
                              "--lr-warmup-iters/--lr-warmup-samples")
        check_fraction(args, "lr_warmup_fraction")
        warmup = int(args.lr_warmup_fraction * decay)
    if decay <= 0 or warmup < 0 or (warmup >= decay and args.lr_decay_style != "constant"):
        raise ConfigError(f"learning-rate warm-up ({warmup} samples) must be shorter than the "
                          f"decay ({decay} samples): check --lr-warmup-* and --lr-decay-*")
    if args.lr_decay_style == "WSD" and (wsd is None or not 0 < wsd <= decay - warmup):
        raise ConfigError("--lr-decay-style WSD needs --lr-wsd-decay-iters (or -samples) in "
                          f"(0, decay - warm-up = {decay - warmup} samples], got {wsd}")
    return SchedulerConfig(max_lr=args.lr, min_lr=args.min_lr, decay_style=args.lr_decay_style,
                           warmup_steps=warmup, decay_steps=decay, init_lr=args.lr_warmup_init,
                           wsd_decay_steps=wsd, wsd_decay_style=args.lr_wsd_decay_style)


def _reject_flags(args, unit: str):
    """The schedule is given in the run's unit: iterations with --train-iters, samples
    with --train-samples."""
    other = "iters" if unit == "samples" else "samples"
    named = [n for n in (f"lr_decay_{unit}", f"lr_wsd_decay_{unit}")
             if getattr(args, n) is not None]
    for name in named + ([f"lr_warmup_{unit}"] if getattr(args, f"lr_warmup_{unit}") else []):
        raise ConfigError(f"{flag(name)} goes with --train-{unit}, not --train-{other}")


def _precision_config(args) -> PrecisionConfig:
    if args.bf16 and args.fp16:
        raise ConfigError("--bf16 and --fp16 are mutually exclusive")
    check_positive(args, "loss_scale")
    if args.min_loss_scale <= 0 or args.initial_loss_scale < args.min_loss_scale:
        raise ConfigError(f"need 0 < --min-loss-scale={args.min_loss_scale} <= "
                          f"--initial-loss-scale={args.initial_loss_scale}")
    if args.loss_scale_window <= 0 or args.hysteresis <= 0:
        raise ConfigError(f"--loss-scale-window={args.loss_scale_window} and "
                          f"--hysteresis={args.hysteresis} must be positive")
    return from_flags(PrecisionConfig, args, loss_scale_window=int(args.loss_scale_window))


def _checkpoint_config(args) -> CheckpointConfig:
    check_positive(args, "save_interval", "exit_duration_in_mins")
    if args.save_interval is not None and args.save is None:
        raise ConfigError(f"--save-interval={args.save_interval} needs --save (where to write)")
    if args.keep_last_n_checkpoints < 0:
        raise ConfigError("--keep-last-n-checkpoints must be >= 0 (0 keeps all), got "
                          f"{args.keep_last_n_checkpoints}")
    if args.finetune and args.load is None:
        raise ConfigError("--finetune needs --load (the checkpoint to start from)")
    if args.async_save and args.save is None:
        raise ConfigError("--async-save needs --save (where to write)")
    if args.overwrite_save and args.save is None:
        raise ConfigError("--overwrite-save needs --save (the directory to write into)")
    _check_non_persistent(args)
    return from_flags(CheckpointConfig, args, keep_last=args.keep_last_n_checkpoints,
                      save_optim=not args.no_save_optim, load_optim=not args.no_load_optim,
                      load_rng=not args.no_load_rng,
                      check_for_nan=args.check_for_nan_in_loss_and_grad)


def _check_non_persistent(args) -> None:
    check_positive(args, "non_persistent_save_interval")
    interval = args.non_persistent_save_interval
    if interval is None:
        return
    if args.save is None:
        raise ConfigError(f"--non-persistent-save-interval={interval} needs --save (the "
                          "persistent checkpoints it stands in for between saves)")
    if args.non_persistent_ckpt_type != "local":
        raise ConfigError(f"--non-persistent-save-interval={interval} needs "
                          "--non-persistent-ckpt-type local, got "
                          f"{args.non_persistent_ckpt_type}")
    if args.non_persistent_local_ckpt_dir is None:
        raise ConfigError("--non-persistent-ckpt-type local needs "
                          "--non-persistent-local-ckpt-dir (a directory on each node's disk)")


def _validate_monitoring(args, world_size: int) -> MonitoringConfig:
    check_positive(args, "peak_tflops", "check_weight_hash_across_dp_replicas_interval",
                   "scaling_baseline_tokens_per_sec")
    if args.profile:
        if not 0 <= args.profile_step_start < args.profile_step_end:
            raise ConfigError("--profile needs 0 <= --profile-step-start < --profile-step-end, "
                              f"got {args.profile_step_start} and {args.profile_step_end}")
        outside = [r for r in args.profile_ranks if not 0 <= r < world_size]
        if outside:
            raise ConfigError(f"--profile-ranks {outside} outside the world of {world_size} "
                              "ranks")
    return from_flags(MonitoringConfig, args, profile_ranks=tuple(args.profile_ranks),
                      profile_dir=args.profile_dir or args.tensorboard_dir or "profile")
