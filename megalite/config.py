"""The frozen configuration `pretrain` hands to each part, one dataclass per part.

Each field says what it is, its unit and the flag it comes from. Every fact is stored
once: the model's shape (sequence length, vocabulary, sequence parallelism) lives in
`GPTConfig` and nowhere else. megalite/validation/ builds
these from the parsed flags and derives what is derived (global batch, micro-batches,
schedule lengths in samples, padded vocabulary) there and only there.
"""

import enum
from dataclasses import dataclass

import torch

from megalite.parallel_state import RankGrid

DEFAULT_BUCKET_SIZE = 40_000_000
"""Elements per data-parallel gradient bucket when --ddp-bucket-size is unset (Megatron's
default): parameters are cut, in order, into buckets of at most this many elements of one
dtype, so a model of thousands of tensors costs a handful of collectives per step."""

DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
"""Short names (as Megatron's --bf16, --fp16) of the dtypes of parameters and gradients."""


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """The model (megalite/model/): its shape and the choices that change what it
    computes."""
    num_layers: int
    """Transformer layers of the whole model, all pipeline stages (--num-layers)."""
    hidden_size: int
    """Width of the residual stream, h (--hidden-size)."""
    ffn_hidden_size: int
    """Width of the MLP's hidden layer (--ffn-hidden-size; default 4h, or 8h/3 rounded down
    to a multiple of 64 with --swiglu)."""
    num_attention_heads: int
    """Query heads (--num-attention-heads)."""
    num_query_groups: int
    """K/V heads; equal to num_attention_heads without grouped-query attention
    (--num-query-groups with --group-query-attention)."""
    kv_channels: int
    """Per-head dimension (--kv-channels; default hidden_size / num_attention_heads)."""
    seq_length: int
    """Tokens per training sequence (--seq-length)."""
    max_position_embeddings: int
    """Rows of the learned position table (--max-position-embeddings; default
    seq_length)."""
    padded_vocab_size: int
    """Vocabulary padded to a multiple of --make-vocab-size-divisible-by x TP."""
    vocab_size: int | None = None
    """The tokenizer's vocabulary; logits of the padding beyond it are masked out.
    None: no padding (vocab_size = padded_vocab_size)."""
    position_embedding_type: str = "learned_absolute"
    """Positions: "learned_absolute" (a table) or "rope" (--position-embedding-type)."""
    rotary_base: int = 10000
    """RoPE: base of the rotation frequencies (--rotary-base)."""
    rotary_percent: float = 1.0
    """RoPE: fraction of each head's channels rotated (--rotary-percent)."""
    normalization: str = "LayerNorm"
    """Norm layers: "LayerNorm" or "RMSNorm" (--normalization)."""
    norm_epsilon: float = 1e-5
    """Added to the variance in each normalization (--norm-epsilon)."""
    swiglu: bool = False
    """SwiGLU MLP instead of GeLU (--swiglu)."""
    add_bias_linear: bool = True
    """Biases in the linear layers (not --disable-bias-linear)."""
    untie_embeddings_and_output_weights: bool = False
    """Output layer with its own weights instead of the input embedding's
    (--untie-embeddings-and-output-weights)."""
    attention_dropout: float = 0.1
    """Dropout probability on the attention weights (--attention-dropout)."""
    hidden_dropout: float = 0.1
    """Dropout probability on the embedding and each residual branch (--hidden-dropout)."""
    init_method_std: float = 0.02
    """Standard deviation of the normal weight init; output projections get
    std / sqrt(2 x num_layers) (--init-method-std)."""
    attention_backend: str = "sdpa"
    """Core attention kernel: "auto", "flash", "sdpa" or "unfused" (--attention-backend;
    --use-flash-attn is "flash")."""
    sequence_parallel: bool = False
    """Activations outside the TP regions split over the sequence across TP ranks
    (--sequence-parallel; off at TP 1, where it is the identity)."""
    recompute_granularity: str | None = None
    """None, "full" (transformer layers) or "selective" (core attention only)
    (--recompute-granularity)."""
    recompute_method: str | None = None
    """With "full": "uniform" (groups of recompute_num_layers layers) or "block" (the
    first recompute_num_layers layers of each model chunk) (--recompute-method)."""
    recompute_num_layers: int = 1
    """Layers per recompute group or block (--recompute-num-layers)."""
    compile_layers: bool | None = False
    """torch.compile each transformer layer (--compile-layers). None: neither
    --compile-layers nor --no-compile-layers was given, and training.build_model and the
    memory planner decide for their device (Config.layers_compiled); a model built
    elsewhere with None runs eagerly."""
    cross_entropy_loss_fusion: bool = False
    """Compile the loss even with eager layers, at TP 1 (--cross-entropy-loss-fusion)."""
    cp_comm_type: str = "p2p"
    """How attention reaches the keys of other context-parallel ranks: "p2p" (ring) or
    "all_gather" (--cp-comm-type); unused at CP 1."""
    fp8_format: str | None = None
    """FP8 GEMMs in the transformer layers' linear layers: "e4m3" or "hybrid" (e5m2
    gradients); None: none (--fp8-format)."""
    fp8_recipe: str = "tensorwise"
    """How FP8 operands are scaled: "tensorwise" or "rowwise" (--fp8-recipe)."""
    first_last_layers_bf16: bool = False
    """Keep the first and last transformer layers out of FP8 (--first-last-layers-bf16)."""
    num_layers_at_start_in_bf16: int = 1
    """Layers kept out of FP8 at the start (--num-layers-at-start-in-bf16)."""
    num_layers_at_end_in_bf16: int = 1
    """Layers kept out of FP8 at the end (--num-layers-at-end-in-bf16)."""
    num_experts: int | None = None
    """Routed experts per MoE layer; None: a dense model (--num-experts)."""
    moe_ffn_hidden_size: int | None = None
    """Hidden width F of each routed expert (--moe-ffn-hidden-size; default
    ffn_hidden_size)."""
    moe_router_topk: int = 2
    """Experts each token is routed to, k (--moe-router-topk)."""
    moe_layer_pattern: tuple[bool, ...] | None = None
    """Per global layer: whether its MLP is a MoE layer (derived once from --moe-layer-freq);
    None without experts."""
    moe_shared_expert_intermediate_size: int | None = None
    """Hidden width of the shared experts, a dense MLP every token goes through; None: none
    (--moe-shared-expert-intermediate-size)."""
    moe_router_load_balancing_type: str = "aux_loss"
    """"aux_loss" (Switch Transformer), "seq_aux_loss" (per sequence, DeepSeek-V2/V3) or
    "none" (--moe-router-load-balancing-type)."""
    moe_aux_loss_coeff: float = 0.0
    """Weight of the load-balancing loss (--moe-aux-loss-coeff)."""
    moe_z_loss_coeff: float | None = None
    """Weight of the router z-loss (ST-MoE); None: none (--moe-z-loss-coeff)."""
    moe_router_enable_expert_bias: bool = False
    """Auxiliary-loss-free balancing (DeepSeek-V3 §2.1.2): a per-expert bias added to the
    scores for the choice of experts only (--moe-router-enable-expert-bias)."""
    moe_router_bias_update_rate: float = 1e-3
    """Step u of the expert-bias update after each optimizer step
    (--moe-router-bias-update-rate)."""
    moe_router_score_function: str = "softmax"
    """"softmax" or "sigmoid" (normalised over the top k) (--moe-router-score-function)."""
    moe_router_pre_softmax: bool = False
    """Softmax over all experts, then the top k; off: the top k logits, then a softmax among
    them (--moe-router-pre-softmax)."""
    moe_expert_capacity_factor: float | None = None
    """Expert capacity = ceil(tokens x k / experts x factor); None: dropless
    (--moe-expert-capacity-factor)."""
    moe_token_drop_policy: str = "probs"
    """Beyond capacity drop the lowest-probability ("probs") or the latest ("position")
    pairs (--moe-token-drop-policy)."""
    moe_pad_expert_input_to_capacity: bool = False
    """Pad every expert's input to its capacity (--moe-pad-expert-input-to-capacity)."""
    moe_grouped_gemm: bool = False
    """The experts in grouped GEMMs (torch._grouped_mm), else a loop over the experts
    (--moe-grouped-gemm)."""
    moe_token_dispatcher_type: str = "allgather"
    """How tokens reach experts on other EP ranks: "allgather" or "alltoall"
    (--moe-token-dispatcher-type)."""

    def loss_compiled(self, layers_compiled: bool, tp_size: int) -> bool:
        """Whether the loss runs under torch.compile: with compiled layers or
        --cross-entropy-loss-fusion, where one rank holds the whole vocabulary (TP 1; over
        a TP group it is the eager vocab-parallel one, whose all-reduces a graph would
        break on). The model builds it so and the memory planner plans it so."""
        return (layers_compiled or self.cross_entropy_loss_fusion) and tp_size == 1

    @property
    def query_projection_size(self) -> int:
        return self.num_attention_heads * self.kv_channels

    @property
    def kv_projection_size(self) -> int:
        return self.num_query_groups * self.kv_channels

    def is_moe_layer(self, layer: int) -> bool:
        """Whether global layer `layer`'s MLP is a MoE layer (moe_layer_pattern)."""
        return self.moe_layer_pattern is not None and bool(self.moe_layer_pattern[layer])


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    """TP: ranks a layer's weights are split over (--tensor-model-parallel-size)."""
    pipeline_model_parallel_size: int = 1
    """PP: pipeline stages (--pipeline-model-parallel-size)."""
    virtual_pipeline_model_parallel_size: int | None = None
    """Model chunks per pipeline rank, None without interleaving (derived from
    --num-layers-per-virtual-pipeline-stage)."""
    pipeline_layer_counts: tuple[int, ...] | None = None
    """Layers of each global pipeline stage (chunk c of rank r is stage c*p + r), None for
    the even split (derived from --decoder-first/last-pipeline-num-layers and
    --account-for-embedding/loss-in-pipeline-split: stages.stage_layer_counts)."""
    data_parallel_size: int = 1
    """DP: world size / (TP x CP x PP) (derived)."""
    use_distributed_optimizer: bool = False
    """ZeRO-1: optimizer state sharded over DP (--use-distributed-optimizer)."""
    ddp_bucket_size: int = DEFAULT_BUCKET_SIZE
    """Elements per data-parallel gradient reduction (--ddp-bucket-size)."""
    overlap_grad_reduce: bool = False
    """Reduce each gradient bucket during backward (--overlap-grad-reduce)."""
    overlap_param_gather: bool = False
    """ZeRO-1: all-gather parameters during the next forward (--overlap-param-gather)."""
    accumulate_allreduce_grads_in_fp32: bool = False
    """Gradient buffer in fp32 whatever the parameters' dtype
    (--accumulate-allreduce-grads-in-fp32; always on with --bf16, as in Megatron)."""
    pipeline_schedule: str = "1f1b"
    """1f1b (interleaved with several chunks), gpipe or zb-h1 (--pipeline-schedule)."""
    context_parallel_size: int = 1
    """CP: ranks each sequence is split over (--context-parallel-size)."""
    use_torch_fsdp2: bool = False
    """ZeRO-2/3 with torch's fully_shard over DP (--use-torch-fsdp2)."""
    data_parallel_sharding_strategy: str = "optim_grads_params"
    """FSDP2: "optim_grads" (ZeRO-2) or "optim_grads_params" (ZeRO-3)
    (--data-parallel-sharding-strategy)."""
    optimizer_cpu_offload: bool = False
    """fp32 main parameters, Adam moments and the step on the host
    (--optimizer-cpu-offload)."""
    fsdp_grad_reduce_every_micro_batch: bool = False
    """FSDP2: reduce-scatter gradients after every micro-batch into the shards, not once
    per step after accumulating them unsharded (--fsdp-grad-reduce-every-micro-batch)."""
    expert_model_parallel_size: int = 1
    """EP: ranks the routed experts of each MoE layer are split over
    (--expert-model-parallel-size)."""

    @property
    def grid(self) -> RankGrid:
        """The rank grid of these sizes (its groups, `dp_cp_size`), for `ParallelState`."""
        tp, pp, cp = (self.tensor_model_parallel_size, self.pipeline_model_parallel_size,
                      self.context_parallel_size)
        return RankGrid(tp * pp * cp * self.data_parallel_size, tp, pp, cp,
                        self.expert_model_parallel_size)


@dataclass(frozen=True, kw_only=True)
class TrainingConfig:
    micro_batch_size: int
    """Sequences per forward/backward pass on one rank (--micro-batch-size)."""
    global_batch_size: int
    """Sequences per optimizer step over all DP ranks (--global-batch-size; default
    micro-batch x DP). Everything counted in samples is derived from this value."""
    num_microbatches: int
    """Micro-batches per DP rank per step: global / (micro x DP) (derived); with uneven
    shares the largest share (what the planner sizes a rank for)."""
    data_parallel_shares: tuple[int, ...] | None = None
    """Micro-batches of each DP rank per step, None for num_microbatches each (derived from
    --data-parallel-shares; `auto` starts even and re-balances, data/shares.py)."""
    data_parallel_shares_auto: bool = False
    """--data-parallel-shares auto: shares set from each DP replica's measured speed."""
    data_parallel_shares_threshold: float = 0.2
    """Re-balance when a replica's speed moves by more than this fraction
    (--data-parallel-shares-threshold)."""
    data_parallel_shares_window: int = 3
    """Steps timed per measurement of the speeds (--data-parallel-shares-window)."""
    train_iters: int | None = None
    """Optimizer steps of the run (--train-iters, or --train-samples // global batch);
    None in the model-only configuration of the tools."""
    train_samples: int | None = None
    """Sequences of the run: train_iters x global batch, or --train-samples (derived)."""
    exit_interval: int | None = None
    """Exit after an iteration that is a multiple of this (--exit-interval)."""
    eval_interval: int = 1000
    """Iterations between validation runs (--eval-interval)."""
    eval_iters: int = 100
    """Global batches per validation run (--eval-iters)."""
    seed: int = 1234
    """Seed of weights, data order and dropout (--seed)."""


class OptimizerKind(enum.Enum):
    """Which optimizer the flags ask for (`Config.optimizer_kind`), read by the
    optimizer builder, the memory planner and checkpointing."""
    FP32 = "fp32"
    """AdamW directly on fp32 parameters."""
    FP32_MAIN_PARAMS = "fp32_main_params"
    """fp32 main copies of bf16/fp16 parameters, not sharded."""
    SHARDED_FP32_MAIN_PARAMS = "sharded_fp32_main_params"
    """fp32 main copies and Adam moments sharded over DP (ZeRO-1)."""
    FULLY_SHARDED = "fully_sharded"
    """fp32 parameters sharded over DP by FSDP2 (ZeRO-2/3): each rank's shard is the main
    copy, its Adam moments beside it; bf16/fp16 copies only while gathered."""

    @property
    def has_main_params(self) -> bool:
        return self is not OptimizerKind.FP32

    @property
    def sharded(self) -> bool:
        """Optimizer state split over DP (one checkpoint file per DP rank)."""
        return self in (OptimizerKind.SHARDED_FP32_MAIN_PARAMS, OptimizerKind.FULLY_SHARDED)


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    lr: float
    """Peak learning rate (--lr)."""
    min_lr: float = 0.0
    """Learning rate at the end of the decay (--min-lr)."""
    weight_decay: float = 0.01
    """AdamW decoupled weight decay (--weight-decay)."""
    adam_beta1: float = 0.9
    """(--adam-beta1)"""
    adam_beta2: float = 0.999
    """(--adam-beta2)"""
    adam_eps: float = 1e-8
    """(--adam-eps)"""
    clip_grad: float = 1.0
    """Global gradient-norm clip, 0 for none (--clip-grad)."""


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """Learning-rate schedule in units of consumed samples, as Megatron counts it."""
    max_lr: float
    """Peak learning rate (--lr)."""
    min_lr: float
    """Final learning rate (--min-lr)."""
    decay_style: str
    """constant, linear, cosine or WSD (--lr-decay-style)."""
    warmup_steps: int
    """Warm-up length in samples (--lr-warmup-iters x global batch, --lr-warmup-samples
    or --lr-warmup-fraction x decay)."""
    decay_steps: int
    """Samples at which the decay ends (--lr-decay-iters x global batch or
    --lr-decay-samples; default the whole run)."""
    init_lr: float = 0.0
    """Learning rate at the start of warm-up (--lr-warmup-init)."""
    wsd_decay_steps: int | None = None
    """WSD: samples of the final anneal (--lr-wsd-decay-iters x global batch or
    --lr-wsd-decay-samples)."""
    wsd_decay_style: str = "exponential"
    """WSD: shape of the final anneal (--lr-wsd-decay-style)."""


@dataclass(frozen=True, kw_only=True)
class PrecisionConfig:
    bf16: bool = False
    """bf16 parameters and activations, fp32 main parameters (--bf16)."""
    fp16: bool = False
    """fp16 parameters with loss scaling, fp32 main parameters (--fp16)."""
    loss_scale: float | None = None
    """A fixed fp16 loss scale; None means dynamic scaling (--loss-scale)."""
    initial_loss_scale: float = 2.0 ** 32
    """Dynamic scaling: first scale (--initial-loss-scale)."""
    min_loss_scale: float = 1.0
    """Dynamic scaling: floor (--min-loss-scale)."""
    loss_scale_window: int = 1000
    """Dynamic scaling: clean steps before the scale doubles (--loss-scale-window)."""
    hysteresis: int = 2
    """Dynamic scaling: overflows tolerated before the scale halves (--hysteresis)."""

    @property
    def params_dtype(self) -> torch.dtype:
        """The dtype of the model's parameters, activations and pipeline sends (Megatron's
        params_dtype), and so the one its matmuls run in; the optimizer's main copies are
        fp32 whatever it is."""
        return torch.bfloat16 if self.bf16 else torch.float16 if self.fp16 else torch.float32

    @property
    def params_bytes(self) -> int:
        """Bytes per element of params_dtype."""
        return self.params_dtype.itemsize


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    mock_data: bool = False
    """Synthetic counting documents instead of files (--mock-data)."""
    data_path: tuple[str, ...] = ()
    """Dataset prefixes, optionally preceded by weights, as given (--data-path)."""
    split: str = "969,30,1"
    """Train/valid/test proportions of each dataset's documents (--split)."""
    data_cache_path: str | None = None
    """Directory of the cached sample indices; None: beside the data (--data-cache-path)."""
    eod_mask_loss: bool = False
    """No loss where the input token is end-of-document (--eod-mask-loss)."""
    num_workers: int = 2
    """Data loader worker processes (--num-workers)."""


@dataclass(frozen=True, kw_only=True)
class LoggingConfig:
    log_interval: int = 100
    """Iterations per log line (--log-interval)."""
    log_throughput: bool = False
    """Add TFLOP/s per GPU to the log line (--log-throughput)."""
    tensorboard_dir: str | None = None
    """Where TensorBoard event files go; None: none written (--tensorboard-dir)."""
    tensorboard_log_interval: int = 1
    """Iterations between TensorBoard scalars (--tensorboard-log-interval)."""
    scaling_baseline_tokens_per_sec: float | None = None
    """One GPU's tokens/s: the log line adds tokens/s per GPU over it
    (--scaling-baseline-tokens-per-sec, megalite's own flag)."""
    wandb_project: str | None = None
    """Weights & Biases project; None: no W&B run (--wandb-project)."""
    wandb_exp_name: str | None = None
    """The W&B run's name, required with a project (--wandb-exp-name)."""
    wandb_save_dir: str | None = None
    """Where W&B writes its files; None: {--save}/wandb as Megatron, else wandb's default
    (--wandb-save-dir)."""


@dataclass(frozen=True, kw_only=True)
class DistributedConfig:
    backend: str | None = None
    """nccl or gloo; None: nccl when an accelerator is visible (--distributed-backend)."""
    timeout_minutes: float = 10
    """Collective timeout in minutes, fractions allowed (--distributed-timeout-minutes)."""


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    save: str | None = None
    """Directory checkpoints are written to (--save)."""
    load: str | None = None
    """Directory to resume from (--load)."""
    save_interval: int | None = None
    """Iterations between checkpoints (--save-interval)."""
    keep_last: int = 0
    """Checkpoints to keep, 0: all (--keep-last-n-checkpoints)."""
    save_optim: bool = True
    """Write optimizer state (not --no-save-optim)."""
    load_optim: bool = True
    """Read optimizer state (not --no-load-optim)."""
    load_rng: bool = True
    """Restore the RNG states (not --no-load-rng)."""
    finetune: bool = False
    """Load the model only and start at iteration 0 (--finetune)."""
    exit_signal_handler: bool = False
    """Save and exit on SIGTERM/SIGUSR1 (--exit-signal-handler)."""
    exit_duration_in_mins: float | None = None
    """Save and exit after this many minutes of training (--exit-duration-in-mins)."""
    check_for_nan: bool = True
    """Stop on a NaN/inf loss or gradient (not --no-check-for-nan-in-loss-and-grad)."""
    async_save: bool = False
    """Snapshot to host memory, write in a background thread, publish once every rank's
    files are written (--async-save; checkpointing/async_save.py)."""
    non_persistent_save_interval: int | None = None
    """Iterations between node-local saves (--non-persistent-save-interval)."""
    non_persistent_ckpt_type: str | None = None
    """Where they go: "local" (--non-persistent-ckpt-type)."""
    non_persistent_local_ckpt_dir: str | None = None
    """The node-local directory (--non-persistent-local-ckpt-dir; checkpointing/local.py)."""


@dataclass(frozen=True, kw_only=True)
class MonitoringConfig:
    """What a run reports about itself beyond the log line's loss (megalite/monitoring/)."""
    peak_tflops: float | None = None
    """Dense peak TFLOP/s per device for MFU; None: the table's entry for the device
    (--peak-tflops, megalite's own flag)."""
    log_memory_to_tensorboard: bool = False
    """Memory (max over ranks) as TensorBoard scalars (--log-memory-to-tensorboard)."""
    timing_log_level: int = 0
    """0: no phase timers; 1: phases run once a step; 2: also per micro-batch
    (--timing-log-level)."""
    timing_log_option: str = "minmax"
    """Timers reduced over ranks as max, (min, max) or all (--timing-log-option)."""
    log_timers_to_tensorboard: bool = False
    """Each timer's max over ranks as a TensorBoard scalar (--log-timers-to-tensorboard)."""
    log_straggler: bool = False
    """Name the slowest and fastest rank each log interval (--log-straggler)."""
    check_weight_hash_across_dp_replicas_interval: int | None = None
    """Iterations between DP replica hash checks; None: never
    (--check-weight-hash-across-dp-replicas-interval)."""
    log_params_norm: bool = False
    """Parameter L2 norm on the log line (--log-params-norm)."""
    log_num_zeros_in_grad: bool = False
    """Zero gradient elements on the log line (--log-num-zeros-in-grad)."""
    profile: bool = False
    """Record a torch.profiler trace (--profile)."""
    profile_step_start: int = 10
    """Iterations done when the profile starts (--profile-step-start)."""
    profile_step_end: int = 12
    """Iteration after which it stops (--profile-step-end)."""
    profile_ranks: tuple[int, ...] = (0,)
    """Global ranks that profile (--profile-ranks)."""
    profile_dir: str = "profile"
    """Where traces are written (--profile-dir, megalite's own; default the TensorBoard
    directory, else ./profile)."""
    record_memory_history: bool = False
    """Keep the CUDA allocator's history for snapshots (--record-memory-history)."""
    memory_snapshot_path: str = "snapshot.pickle"
    """Where the CUDA memory snapshot goes (--memory-snapshot-path; .rank<r> added with
    several ranks)."""


@dataclass(frozen=True, kw_only=True)
class GradCompressionConfig:
    """PowerSGD on the DP x CP gradient reduction (Vogels et al. 2019; megalite's own flags,
    named after torch's PowerSGDState fields: distributed/powersgd.py)."""
    kind: str = "none"
    """"none" or "powersgd" (--grad-compression)."""
    rank: int = 1
    """Columns of P and Q per matrix, torch's matrix_approximation_rank (--powersgd-rank)."""
    start_iter: int = 1000
    """Steps reduced uncompressed before compression starts, torch's start_powerSGD_iter
    (--powersgd-start-iter)."""
    min_compression_rate: float = 2.0
    """A matrix n x m is compressed only when n*m > rate * (n+m)*rank; vectors never
    (--powersgd-min-compression-rate)."""
    error_feedback: bool = True
    """Add the last step's compression error to the gradient (--no-powersgd-error-feedback)."""
    warm_start: bool = True
    """Start the power iteration from the last step's Q (--no-powersgd-warm-start)."""
    orthogonalization_epsilon: float = 0.0
    """Added to column norms in Gram-Schmidt (--powersgd-orthogonalization-epsilon)."""

    @property
    def enabled(self) -> bool:
        return self.kind == "powersgd"


@dataclass(frozen=True, kw_only=True)
class Config:
    """The whole run. The model-only configuration of the tools
    (validation.validate_model_args) has no optimizer, scheduler or data."""
    model: GPTConfig
    parallel: ParallelConfig
    training: TrainingConfig
    precision: PrecisionConfig
    logging: LoggingConfig
    distributed: DistributedConfig
    checkpoint: CheckpointConfig = CheckpointConfig()
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    data: DataConfig | None = None
    monitoring: MonitoringConfig = MonitoringConfig()
    grad_compression: GradCompressionConfig = GradCompressionConfig()

    @property
    def optimizer_kind(self) -> OptimizerKind:
        """ZeRO-1 shards fp32 main parameters over DP (fp32 models too, as in Megatron);
        bf16/fp16 parameters get unsharded fp32 main copies; fp32 ones plain AdamW."""
        if self.parallel.use_torch_fsdp2:
            return OptimizerKind.FULLY_SHARDED
        if self.parallel.use_distributed_optimizer:
            return OptimizerKind.SHARDED_FP32_MAIN_PARAMS
        if self.precision.params_dtype != torch.float32:
            return OptimizerKind.FP32_MAIN_PARAMS
        return OptimizerKind.FP32

    def layers_compiled(self, device_type: str) -> bool:
        """Whether each transformer layer runs under torch.compile on a `device_type`
        ("cuda", "cpu") device: as --compile-layers / --no-compile-layers say, else
        compile_by_default. training.build_model builds it so and the memory planner plans
        it so: one decision, read in both places."""
        if self.model.compile_layers is not None:
            return self.model.compile_layers
        return compile_by_default(self, device_type)

    @property
    def grad_dtype(self) -> torch.dtype:
        """The dtype gradients are accumulated and reduced over DP x CP in (the gradient
        buffer's; FSDP2's reduce_dtype): fp32 under --accumulate-allreduce-grads-in-fp32,
        else the parameters'."""
        if self.parallel.accumulate_allreduce_grads_in_fp32:
            return torch.float32
        return self.precision.params_dtype

    @property
    def grad_bytes(self) -> int:
        """Bytes per element of grad_dtype."""
        return self.grad_dtype.itemsize



def compile_by_default(config: Config, device_type: str) -> bool:
    """--compile-layers when neither it nor --no-compile-layers is given. On a GPU eager
    layers spend as long on their elementwise work (norms, RoPE, SwiGLU, residual adds,
    casts: one memory pass each) as on their GEMMs, which compiling fuses away (37% -> 51%
    MFU, docs/benchmarks.md); a CPU gains little and would wait minutes for inductor's C++
    build. Only where compiled layers have run on a GPU: TP 1 and CP 1 (no collective
    inside a layer), dense layers (MoE's routed shapes change every step), not under FSDP2
    (its hooks around compiled layers have not run on a GPU), not under zb-h1, whose
    split backward a compiled layer does not make, and not with selective recompute, whose
    checkpoint inside the layer does not trace."""
    p = config.parallel
    return (device_type == "cuda" and p.tensor_model_parallel_size == 1
            and p.context_parallel_size == 1 and not config.model.num_experts
            and not p.use_torch_fsdp2 and p.pipeline_schedule != "zb-h1"
            and config.model.recompute_granularity != "selective")
