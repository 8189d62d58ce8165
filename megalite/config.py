"""Validated, frozen configuration: what `pretrain` hands to each part.

`validate_args(namespace, world_size)` applies Megatron's derived defaults (ffn size,
kv channels, query groups, global batch, decay steps, ...) and rejects every combination
that cannot work with a `ConfigError` naming the flags and their values. Each section is
its own dataclass so a part receives only what it uses.
"""

import math
from dataclasses import dataclass

from megalite.distributed.data_parallel import DEFAULT_BUCKET_SIZE
from megalite.errors import ConfigError
from megalite.model.config import GPTConfig
from megalite.parallel_state import RankGrid
from megalite.pipeline_parallel.schedules import validate_schedule_args


@dataclass(frozen=True)
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    data_parallel_size: int = 1
    """Inferred: world size / (TP x PP)."""
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = False
    ddp_bucket_size: int = DEFAULT_BUCKET_SIZE
    """Elements per data-parallel gradient all-reduce."""
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    accumulate_allreduce_grads_in_fp32: bool = False
    """Gradient buffer in fp32 whatever the parameters' dtype."""


@dataclass(frozen=True)
class TrainingConfig:
    micro_batch_size: int
    global_batch_size: int
    train_iters: int
    num_microbatches: int
    """Micro-batches per DP rank per step: global / (micro x DP)."""
    exit_interval: int | None = None
    eval_interval: int = 1000
    eval_iters: int = 100
    seed: int = 1234


@dataclass(frozen=True)
class OptimizerConfig:
    lr: float
    min_lr: float = 0.0
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0


@dataclass(frozen=True)
class SchedulerConfig:
    """Learning-rate schedule in units of consumed samples, as Megatron counts it."""
    max_lr: float
    min_lr: float
    decay_style: str
    warmup_steps: int
    decay_steps: int
    init_lr: float = 0.0
    wsd_decay_steps: int | None = None
    wsd_decay_style: str = "exponential"


@dataclass(frozen=True)
class PrecisionConfig:
    bf16: bool = False
    fp16: bool = False
    loss_scale: float | None = None
    """A fixed fp16 loss scale; None means dynamic scaling."""
    initial_loss_scale: float = 2.0 ** 32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2


@dataclass(frozen=True)
class DataConfig:
    seq_length: int
    mock_data: bool = False
    vocab_size: int | None = None
    """The tokenizer's vocabulary (or --vocab-size for --mock-data), before padding."""
    data_path: tuple[str, ...] = ()
    """--data-path as given: prefixes, optionally preceded by weights."""
    split: str = "969,30,1"
    data_cache_path: str | None = None
    eod_mask_loss: bool = False
    num_workers: int = 2


@dataclass(frozen=True)
class LoggingConfig:
    log_interval: int = 100
    log_throughput: bool = False
    tensorboard_dir: str | None = None
    tensorboard_log_interval: int = 1


@dataclass(frozen=True)
class DistributedConfig:
    backend: str | None = None
    """None: nccl when an accelerator is visible, else gloo."""
    timeout_minutes: int = 10


@dataclass(frozen=True)
class CheckpointConfig:
    save: str | None = None
    load: str | None = None
    save_interval: int | None = None
    keep_last: int = 0
    """Checkpoints to keep (0: all)."""
    save_optim: bool = True
    load_optim: bool = True
    load_rng: bool = True
    finetune: bool = False
    exit_signal_handler: bool = False
    exit_duration_in_mins: float | None = None
    check_for_nan: bool = True


@dataclass(frozen=True)
class Config:
    model: GPTConfig
    parallel: ParallelConfig
    training: TrainingConfig
    optimizer: OptimizerConfig
    scheduler: SchedulerConfig
    precision: PrecisionConfig
    data: DataConfig
    logging: LoggingConfig
    distributed: DistributedConfig
    checkpoint: CheckpointConfig = CheckpointConfig()


def validate_args(args, world_size: int = 1,
                  tokenizer_vocab_size: int | None = None) -> Config:
    """Check the parsed flags and build the frozen config. Raises ConfigError.

    `tokenizer_vocab_size` is the vocabulary of the tokenizer --tokenizer-type built
    (None without one); it sets the padded vocabulary of the model.
    """
    _require(args, "num_layers", "hidden_size", "num_attention_heads", "seq_length",
             "micro_batch_size", "lr")
    _check_positive(args, "num_layers", "hidden_size", "num_attention_heads", "seq_length",
                    "micro_batch_size", "log_interval", "eval_interval",
                    "make_vocab_size_divisible_by", "tensor_model_parallel_size",
                    "pipeline_model_parallel_size", "distributed_timeout_minutes")
    parallel = _parallel_config(args, world_size)
    vocab_size = _vocab_size(args, tokenizer_vocab_size)
    return Config(
        model=_model_config(args, parallel, vocab_size),
        parallel=parallel,
        training=_training_config(args, parallel),
        optimizer=_optimizer_config(args),
        scheduler=_scheduler_config(args),
        precision=_precision_config(args),
        data=DataConfig(args.seq_length, args.mock_data, vocab_size, tuple(args.data_path or ()),
                        args.split, args.data_cache_path, args.eod_mask_loss,
                        args.num_workers),
        logging=LoggingConfig(args.log_interval, args.log_throughput, args.tensorboard_dir,
                              args.tensorboard_log_interval),
        distributed=DistributedConfig(args.distributed_backend, args.distributed_timeout_minutes),
        checkpoint=_checkpoint_config(args),
    )


def _checkpoint_config(args) -> CheckpointConfig:
    _check_positive(args, "save_interval", "exit_duration_in_mins")
    if args.save_interval is not None and args.save is None:
        raise ConfigError(f"--save-interval={args.save_interval} needs --save (where to write)")
    if args.keep_last_n_checkpoints < 0:
        raise ConfigError("--keep-last-n-checkpoints must be >= 0 (0 keeps all), got "
                          f"{args.keep_last_n_checkpoints}")
    if args.finetune and args.load is None:
        raise ConfigError("--finetune needs --load (the checkpoint to start from)")
    return CheckpointConfig(args.save, args.load, args.save_interval,
                            args.keep_last_n_checkpoints, not args.no_save_optim,
                            not args.no_load_optim, not args.no_load_rng, args.finetune,
                            args.exit_signal_handler, args.exit_duration_in_mins,
                            args.check_for_nan_in_loss_and_grad)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _require(args, *names):
    missing = [_flag(n) for n in names if getattr(args, n) is None]
    if missing:
        raise ConfigError(f"missing required flag(s): {', '.join(missing)}")


def _check_positive(args, *names):
    for name in names:
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise ConfigError(f"{_flag(name)} must be positive, got {value}")


def _parallel_config(args, world_size: int) -> ParallelConfig:
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    dp = RankGrid(world_size, tp, pp).data_parallel_size
    if args.ddp_bucket_size is not None and args.ddp_bucket_size <= 0:
        raise ConfigError(f"--ddp-bucket-size must be positive, got {args.ddp_bucket_size}")
    if args.sequence_parallel and args.seq_length % tp:
        raise ConfigError(f"--sequence-parallel splits the sequence across TP ranks: "
                          f"--seq-length={args.seq_length} is not divisible by "
                          f"--tensor-model-parallel-size={tp}")
    # At TP 1 sequence parallelism is the identity; Megatron turns it off likewise.
    if args.overlap_param_gather and not (args.use_distributed_optimizer
                                          and args.overlap_grad_reduce):
        # As in Megatron: only ZeRO-1 gathers parameters, and the overlap of the gather
        # is only worth having together with the overlap of the reduction.
        raise ConfigError("--overlap-param-gather needs --use-distributed-optimizer and "
                          f"--overlap-grad-reduce (got --use-distributed-optimizer="
                          f"{args.use_distributed_optimizer}, --overlap-grad-reduce="
                          f"{args.overlap_grad_reduce})")
    return ParallelConfig(tp, pp, _virtual_stages(args, pp), dp,
                          args.sequence_parallel and tp > 1, args.use_distributed_optimizer,
                          args.ddp_bucket_size or DEFAULT_BUCKET_SIZE, args.overlap_grad_reduce,
                          args.overlap_param_gather, args.accumulate_allreduce_grads_in_fp32)


def _virtual_stages(args, pp: int) -> int | None:
    """Layers split evenly over p stages, and with --num-layers-per-virtual-pipeline-stage
    k each rank holds v = L / (p k) chunks of k layers."""
    layers, per_virtual = args.num_layers, args.num_layers_per_virtual_pipeline_stage
    if layers % pp:
        raise ConfigError(f"--num-layers={layers} is not divisible by "
                          f"--pipeline-model-parallel-size={pp}")
    if per_virtual is None:
        return None
    if per_virtual <= 0 or layers % (pp * per_virtual):
        raise ConfigError(f"--num-layers={layers} is not divisible by "
                          f"--pipeline-model-parallel-size={pp} x "
                          f"--num-layers-per-virtual-pipeline-stage={per_virtual}")
    return layers // (pp * per_virtual)


def _model_config(args, parallel: ParallelConfig, vocab_size: int) -> GPTConfig:
    heads, hidden = args.num_attention_heads, args.hidden_size
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
    _check_tensor_parallel_split(args, heads, groups, parallel.tensor_model_parallel_size)
    ffn = args.ffn_hidden_size
    if ffn is None:
        # Megatron's rule: SwiGLU has two input projections, so shrink to keep the
        # parameter count of a 4h GeLU MLP, rounded down to a multiple of 64.
        ffn = int(4 * hidden * 2 / 3 / 64) * 64 if args.swiglu else 4 * hidden
        if ffn % parallel.tensor_model_parallel_size:
            raise ConfigError(f"the default MLP width {ffn} is not divisible by "
                              f"--tensor-model-parallel-size="
                              f"{parallel.tensor_model_parallel_size}: set --ffn-hidden-size")
    max_pos = args.max_position_embeddings or args.seq_length
    if args.position_embedding_type == "learned_absolute" and args.seq_length > max_pos:
        raise ConfigError(f"--seq-length={args.seq_length} exceeds "
                          f"--max-position-embeddings={max_pos}")
    if not 0.0 < args.rotary_percent <= 1.0:
        raise ConfigError(f"--rotary-percent must be in (0, 1], got {args.rotary_percent}")
    if args.position_embedding_type == "rope" and int(kv_channels * args.rotary_percent) % 2:
        raise ConfigError(f"RoPE rotates channel pairs: --kv-channels={kv_channels} x "
                          f"--rotary-percent={args.rotary_percent} must be even")
    for name in ("attention_dropout", "hidden_dropout"):
        if not 0.0 <= getattr(args, name) < 1.0:
            raise ConfigError(f"{_flag(name)} must be in [0, 1), got {getattr(args, name)}")
    if args.init_method_std <= 0:
        raise ConfigError(f"--init-method-std must be positive, got {args.init_method_std}")
    return GPTConfig(
        num_layers=args.num_layers, hidden_size=hidden, ffn_hidden_size=ffn,
        num_attention_heads=heads, num_query_groups=groups, kv_channels=kv_channels,
        seq_length=args.seq_length, max_position_embeddings=max_pos,
        padded_vocab_size=pad_vocab_size(vocab_size, args.make_vocab_size_divisible_by,
                                         parallel.tensor_model_parallel_size),
        position_embedding_type=args.position_embedding_type, rotary_base=args.rotary_base,
        rotary_percent=args.rotary_percent, normalization=args.normalization,
        norm_epsilon=args.norm_epsilon, swiglu=args.swiglu, add_bias_linear=args.add_bias_linear,
        untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
        attention_dropout=args.attention_dropout, hidden_dropout=args.hidden_dropout,
        init_method_std=args.init_method_std, attention_backend=_attention_backend(args),
        sequence_parallel=parallel.sequence_parallel, vocab_size=vocab_size,
        compile_layers=args.compile_layers, **_recompute(args),
    )


def _recompute(args) -> dict:
    """Megatron's rules: full recompute names its method; selective takes none."""
    granularity, method, n = (args.recompute_granularity, args.recompute_method,
                              args.recompute_num_layers)
    if granularity == "full" and method is None:
        raise ConfigError("--recompute-granularity full needs --recompute-method "
                          "(uniform or block)")
    if granularity != "full" and (method is not None or n is not None):
        raise ConfigError(f"--recompute-method/--recompute-num-layers apply to "
                          f"--recompute-granularity full only (got --recompute-granularity="
                          f"{granularity})")
    if n is not None and n <= 0:
        raise ConfigError(f"--recompute-num-layers must be positive, got {n}")
    return dict(recompute_granularity=granularity, recompute_method=method,
                recompute_num_layers=n or 1)


def _check_tensor_parallel_split(args, heads: int, groups: int, tp: int):
    """Attention splits whole query groups (and heads) across TP ranks; the MLP splits
    its hidden units."""
    if heads % tp or groups % tp:
        raise ConfigError(f"--tensor-model-parallel-size={tp} must divide "
                          f"--num-attention-heads={heads} and the query groups ({groups}, "
                          "--num-query-groups under --group-query-attention)")
    if args.ffn_hidden_size is not None and args.ffn_hidden_size % tp:
        raise ConfigError(f"--ffn-hidden-size={args.ffn_hidden_size} is not divisible by "
                          f"--tensor-model-parallel-size={tp}")


def _attention_backend(args) -> str:
    if args.use_flash_attn:
        if args.attention_backend not in ("auto", "flash"):
            raise ConfigError(f"--use-flash-attn conflicts with "
                              f"--attention-backend {args.attention_backend}")
        return "flash"
    return args.attention_backend


def _vocab_size(args, tokenizer_vocab_size: int | None) -> int:
    if args.mock_data == bool(args.data_path):
        raise ConfigError("pass exactly one data source: --data-path PREFIX... (with "
                          "--tokenizer-type) or --mock-data (with --vocab-size)")
    if args.data_path and args.tokenizer_type is None:
        raise ConfigError("--data-path needs --tokenizer-type (and its files) to know the "
                          "vocabulary and the end-of-document id")
    if tokenizer_vocab_size is not None:
        return tokenizer_vocab_size
    if args.vocab_size is None or args.vocab_size < 3:
        raise ConfigError(f"--mock-data needs --vocab-size >= 3 (or a --tokenizer-type), "
                          f"got {args.vocab_size}")
    return args.vocab_size


def pad_vocab_size(vocab_size: int, divisible_by: int, tp_size: int) -> int:
    """Megatron's padding: round up to a multiple of divisible_by x TP so every TP shard
    of the embedding and output layer has the same number of rows."""
    multiple = divisible_by * tp_size
    return int(math.ceil(vocab_size / multiple) * multiple)


def _training_config(args, parallel: ParallelConfig) -> TrainingConfig:
    micro, dp = args.micro_batch_size, parallel.data_parallel_size
    global_batch = args.global_batch_size or micro * dp
    if global_batch % (micro * dp):
        raise ConfigError(
            f"--global-batch-size={global_batch} is not divisible by --micro-batch-size={micro} "
            f"x data-parallel size {dp}")
    if (args.train_iters is None) == (args.train_samples is None):
        raise ConfigError("pass exactly one of --train-iters and --train-samples "
                          f"(got {args.train_iters} and {args.train_samples})")
    if args.train_samples is not None:
        train_iters = args.train_samples // global_batch
        if train_iters == 0:
            raise ConfigError(f"--train-samples={args.train_samples} is less than one "
                              f"--global-batch-size={global_batch}")
    else:
        train_iters = args.train_iters
    if train_iters <= 0:
        raise ConfigError(f"--train-iters must be positive, got {train_iters}")
    if args.num_workers < 0:
        raise ConfigError(f"--num-workers must be >= 0, got {args.num_workers}")
    if args.eval_iters < 0:
        raise ConfigError(f"--eval-iters must be >= 0, got {args.eval_iters}")
    if args.exit_interval is not None and args.exit_interval <= 0:
        raise ConfigError(f"--exit-interval must be positive, got {args.exit_interval}")
    num_microbatches = global_batch // (micro * dp)
    validate_schedule_args(parallel.pipeline_model_parallel_size, num_microbatches,
                           parallel.virtual_pipeline_model_parallel_size or 1)
    return TrainingConfig(micro, global_batch, train_iters, num_microbatches,
                          args.exit_interval, args.eval_interval, args.eval_iters, args.seed)


def _optimizer_config(args) -> OptimizerConfig:
    if args.lr <= 0:
        raise ConfigError(f"--lr must be positive, got {args.lr}")
    if not 0.0 <= args.min_lr <= args.lr:
        raise ConfigError(f"--min-lr={args.min_lr} must be in [0, --lr={args.lr}]")
    for name in ("adam_beta1", "adam_beta2"):
        if not 0.0 <= getattr(args, name) < 1.0:
            raise ConfigError(f"{_flag(name)} must be in [0, 1), got {getattr(args, name)}")
    if args.clip_grad < 0 or args.weight_decay < 0 or args.adam_eps <= 0:
        raise ConfigError(f"need --clip-grad >= 0, --weight-decay >= 0, --adam-eps > 0; got "
                          f"{args.clip_grad}, {args.weight_decay}, {args.adam_eps}")
    return OptimizerConfig(args.lr, args.min_lr, args.weight_decay, args.adam_beta1,
                           args.adam_beta2, args.adam_eps, args.clip_grad)


def _scheduler_config(args) -> SchedulerConfig:
    """Megatron counts schedule steps in samples: iteration flags are multiplied by the
    global batch size, so --train-iters and --train-samples runs share one code path."""
    global_batch = args.global_batch_size or args.micro_batch_size
    if args.train_iters is not None:
        _reject_sample_flags(args)
        to_steps = lambda iters: None if iters is None else iters * global_batch  # noqa: E731
        decay = to_steps(args.lr_decay_iters or args.train_iters)
        warmup = to_steps(args.lr_warmup_iters)
        wsd = to_steps(args.lr_wsd_decay_iters)
    else:
        _reject_iteration_flags(args)
        decay = args.lr_decay_samples or args.train_samples
        warmup, wsd = args.lr_warmup_samples, args.lr_wsd_decay_samples
    if args.lr_warmup_fraction is not None:
        if warmup:
            raise ConfigError("pass only one of --lr-warmup-fraction and "
                              "--lr-warmup-iters/--lr-warmup-samples")
        if not 0.0 <= args.lr_warmup_fraction < 1.0:
            raise ConfigError(f"--lr-warmup-fraction must be in [0, 1), got "
                              f"{args.lr_warmup_fraction}")
        warmup = int(args.lr_warmup_fraction * decay)
    if decay <= 0 or warmup < 0 or (warmup >= decay and args.lr_decay_style != "constant"):
        raise ConfigError(f"learning-rate warm-up ({warmup} samples) must be shorter than the "
                          f"decay ({decay} samples): check --lr-warmup-* and --lr-decay-*")
    if args.lr_decay_style == "WSD":
        if wsd is None or not 0 < wsd <= decay - warmup:
            raise ConfigError("--lr-decay-style WSD needs --lr-wsd-decay-iters (or -samples) in "
                              f"(0, decay - warm-up = {decay - warmup} samples], got {wsd}")
    return SchedulerConfig(args.lr, args.min_lr, args.lr_decay_style, warmup, decay,
                           args.lr_warmup_init, wsd, args.lr_wsd_decay_style)


def _reject_sample_flags(args):
    for name in ("lr_decay_samples", "lr_wsd_decay_samples"):
        if getattr(args, name) is not None:
            raise ConfigError(f"{_flag(name)} goes with --train-samples, not --train-iters")
    if args.lr_warmup_samples:
        raise ConfigError("--lr-warmup-samples goes with --train-samples, not --train-iters")


def _reject_iteration_flags(args):
    for name in ("lr_decay_iters", "lr_wsd_decay_iters"):
        if getattr(args, name) is not None:
            raise ConfigError(f"{_flag(name)} goes with --train-iters, not --train-samples")
    if args.lr_warmup_iters:
        raise ConfigError("--lr-warmup-iters goes with --train-iters, not --train-samples")


def _precision_config(args) -> PrecisionConfig:
    if args.bf16 and args.fp16:
        raise ConfigError("--bf16 and --fp16 are mutually exclusive")
    if args.loss_scale is not None and args.loss_scale <= 0:
        raise ConfigError(f"--loss-scale must be positive, got {args.loss_scale}")
    if args.min_loss_scale <= 0 or args.initial_loss_scale < args.min_loss_scale:
        raise ConfigError(f"need 0 < --min-loss-scale={args.min_loss_scale} <= "
                          f"--initial-loss-scale={args.initial_loss_scale}")
    if args.loss_scale_window <= 0 or args.hysteresis <= 0:
        raise ConfigError(f"--loss-scale-window={args.loss_scale_window} and "
                          f"--hysteresis={args.hysteresis} must be positive")
    return PrecisionConfig(args.bf16, args.fp16, args.loss_scale, args.initial_loss_scale,
                           args.min_loss_scale, int(args.loss_scale_window), args.hysteresis)
